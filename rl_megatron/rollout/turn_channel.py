"""One rank drives a multi-turn rollout; the others of its generation group follow it.

The environments run on one rank of each group of ranks that generate together (a vLLM
replica's TP ranks, a Megatron replica): their answers arrive at times that differ from
rank to rank, so if every rank ran them, the ranks would submit different requests to an
engine whose steps are collective. Instead the leader runs the driver
(`multi_turn.run_trajectories`) and sends the followers, before each collective engine
step, what it is about to submit; the followers replay it and step with it. At the end the
leader sends the trajectories, so every rank of the group returns the same.

    channel = LeaderChannel(group, leader)     # group None or of one rank: no messages
    if channel.is_leader: channel.send(obj)    # broadcast_object_list from the leader
    else: obj = channel.receive()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LeaderChannel"]


class LeaderChannel:
    """Pickled objects from `leader` (a global rank) to the other ranks of `group`."""

    def __init__(self, group: dist.ProcessGroup | None, leader: int) -> None:
        self.group, self.leader = group, int(leader)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.is_leader = self.size == 1 or dist.get_rank() == self.leader
        # NCCL's object broadcast stages through the current device.
        self._device = None
        if self.size > 1 and dist.get_backend(group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def send(self, obj: Any) -> None:
        """The leader's object to every follower (no-op alone)."""
        if not self.is_leader:
            raise RuntimeError("LeaderChannel.send on a follower")
        if self.size > 1:
            dist.broadcast_object_list(
                [obj], src=self.leader, group=self.group, device=self._device
            )

    def receive(self) -> Any:
        """The leader's next object (followers only)."""
        if self.is_leader:
            raise RuntimeError("LeaderChannel.receive on the leader")
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group, device=self._device)
        return box[0]

    def share(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank (followers pass nothing)."""
        if self.is_leader:
            self.send(obj)
            return obj
        return self.receive()
