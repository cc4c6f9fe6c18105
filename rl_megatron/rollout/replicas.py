"""Generation replicas and prompt groups: which ranks generate together, and who gets which prompts.

vLLM's `external_launcher` makes each block of t_g consecutive ranks one tensor-parallel
engine (a generation replica). Ranks that pass the same prompts to `generate` form a
*prompt group*; its replicas each take a contiguous share of the prompts. Plain rank
arithmetic, no vLLM and no torch.distributed: the engine passes in world size and rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLayout:
    """Where this rank sits among generation replicas and prompt groups (checked once)."""

    world_size: int
    rank: int
    tp: int
    group_ranks: tuple[int, ...]  # this rank's prompt group, sorted
    replica_index: int  # position of this rank's replica inside its prompt group
    num_replicas: int  # generation replicas in the prompt group (d_g)
    global_replica: int  # rank // tp: the replica's index in the world

    @classmethod
    def build(
        cls, world_size: int, rank: int, tp: int, prompt_groups: Sequence[Sequence[int]] | None
    ) -> ReplicaLayout:
        if world_size % tp:
            raise ValueError(f"rollout.tp={tp} must divide the world size {world_size}")
        groups = [list(range(world_size))] if prompt_groups is None else prompt_groups
        groups = [sorted(int(r) for r in g) for g in groups]
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(world_size)):
            raise ValueError(
                f"prompt groups {groups} must partition the ranks 0..{world_size - 1}, "
                f"each rank exactly once"
            )
        mine = next(g for g in groups if rank in g)
        for g in groups:
            for r in g:
                block = range(r // tp * tp, r // tp * tp + tp)
                if not set(block) <= set(g):
                    raise ValueError(
                        f"prompt group {g} splits the generation replica of ranks "
                        f"{list(block)} (rollout.tp={tp} makes blocks of consecutive ranks); "
                        f"each replica must lie inside one prompt group"
                    )
        replicas = sorted({r // tp for r in mine})
        return cls(
            world_size=world_size,
            rank=rank,
            tp=tp,
            group_ranks=tuple(mine),
            replica_index=replicas.index(rank // tp),
            num_replicas=len(replicas),
            global_replica=rank // tp,
        )

    def share(self, num_items: int) -> range:
        """Contiguous, near-equal share of `num_items` for this replica."""
        base, extra = divmod(num_items, self.num_replicas)
        k = self.replica_index
        start = k * base + min(k, extra)
        return range(start, start + base + (1 if k < extra else 0))

    @property
    def is_replica_leader(self) -> bool:
        """The replica's first rank speaks for it in gathers (its TP peers hold the same)."""
        return self.rank % self.tp == 0
