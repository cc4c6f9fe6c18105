"""Split placement (`trainer.mode: split_async`): some ranks of the launch only generate.

    world = init_split_world(env, rollout_ranks, timeout_s, rendezvous_timeout_s)
    world.generates           # this rank is one of the last `rollout_ranks`
    world.bridge              # every rank of the launch, global rank numbers

The first W − R ranks train, the last R (`placement.rollout_ranks`) generate. Each side gets
a default process group of its own — its ranks numbered from 0, its world size its own —
so megatron-core, the trainer and the engines initialise on it exactly as they would in a
launch of that size (none of them knows the other side exists). The two sides talk only
through `bridge`, a process group over the whole launch made directly from the launch's
store (it is not torch's default group, so no collective of either side can reach into the
other by mistake); everything that crosses it is point to point (`split_rollouts.py`).

Why two default groups rather than one world with megatron-core on a subgroup:
megatron-core's `initialize_model_parallel` builds its groups from the default group's
size, and every `new_group` is collective over the default group, so the generation ranks
would have to take part in every group the training ranks make (and vice versa).

`RANK` and `WORLD_SIZE` are set to the side's numbers after the split: vLLM's in-process
engine (`external_launcher`) reads them. `LOCAL_RANK` keeps the launch's value (it picks
the GPU).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_megatron.parallel import ParallelLayout


@dataclass(frozen=True)
class SplitWorld:
    rank: int  # in the launch
    world_size: int  # of the launch
    rollout_ranks: int  # the last this many ranks generate
    bridge: dist.ProcessGroup  # the whole launch, global rank numbers

    @property
    def train_size(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def generates(self) -> bool:
        return self.rank >= self.train_size

    @property
    def side_rank(self) -> int:
        """This rank's number in its side's default group."""
        return self.rank - self.train_size if self.generates else self.rank

    def training_rank(self, side_rank: int) -> int:
        """The launch rank of training rank `side_rank`."""
        return side_rank

    def generation_rank(self, side_rank: int) -> int:
        """The launch rank of generation rank `side_rank`."""
        return self.train_size + side_rank

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """`tensor` to launch rank `dst` (blocks until it has gone)."""
        self.bridge.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Into `tensor` from launch rank `src` (blocks until it has arrived)."""
        self.bridge.recv([tensor], src, 0).wait()

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
    ) -> None:
        """A resharding round over the bridge (`executor.Transport`): every send and
        receive posted, then waited for. Posted in launch-rank order on both ends: a rank
        of split placement's weight plan only sends (training) or only receives
        (generation), so ordered posting cannot wait in a cycle where a transport runs
        one pair at a time (NCCL's point-to-point on one communicator)."""
        works = [self.bridge.send([t], dst, 0) for t, dst in sorted(sends, key=lambda m: m[1])]
        works += [self.bridge.recv([t], src, 0) for t, src in sorted(recvs, key=lambda m: m[1])]
        for work in works:
            work.wait()


def generating_layout(rollout_tp: int, rollout_ranks: int) -> ParallelLayout:
    """The generation ranks' own layout: TP groups of `rollout.tp`, one replica each."""
    return ParallelLayout(tp=rollout_tp, pp=1, dp=rollout_ranks // rollout_tp)


def check_split(world_size: int, rollout_ranks: int) -> None:
    """`placement.rollout_ranks` leaves both sides at least one rank."""
    if not 0 < rollout_ranks < world_size:
        raise ValueError(
            f"placement.rollout_ranks={rollout_ranks} must be in [1, {world_size - 1}] for a "
            f"launch of {world_size} ranks (both sides need one)"
        )


def launch_store(env, timeout_s: float) -> dist.Store:
    """The launch's store: torchrun's agent store, else our rendezvous (`distributed.py`)."""
    from rl_megatron.distributed import rendezvous_store

    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        store, _, _ = next(
            dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout)
        )
        return store
    return rendezvous_store(env, timeout_s)


def init_split_world(
    env, rollout_ranks: int, timeout_s: int, rendezvous_timeout_s: float = 600
) -> tuple[SplitWorld, torch.device]:
    """The side's default process group and the bridge (collective over the launch)."""
    check_split(env.world_size, rollout_ranks)
    from rl_megatron.distributed import rank_device

    backend, device = rank_device(env)
    store = launch_store(env, rendezvous_timeout_s)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    timeout = datetime.timedelta(seconds=timeout_s)
    train_size = env.world_size - rollout_ranks
    generates = env.rank >= train_size
    side, side_rank = ("generate", env.rank - train_size) if generates else ("train", env.rank)
    side_size = rollout_ranks if generates else train_size
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"rlm/{side}", store),
        rank=side_rank,
        world_size=side_size,
        timeout=timeout,
    )
    bridge_store = dist.PrefixStore("rlm/bridge", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        bridge = dist.ProcessGroupNCCL(bridge_store, env.rank, env.world_size, options)
    else:
        bridge = dist.ProcessGroupGloo(bridge_store, env.rank, env.world_size, timeout)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(side_rank), str(side_size)
    world = SplitWorld(env.rank, env.world_size, rollout_ranks, bridge)
    return world, device
