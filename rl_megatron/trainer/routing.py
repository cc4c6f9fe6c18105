"""A role's MoE routing around its forward: the rollout's routing replayed (R3) or compared.

A micro-batch may carry the rollout's routing (`routed_experts`, `[b, s, L, k]` aligned
with its ids). With `router_replay` the routers of the forwarded chunk take those experts
(`models/router_replay.replay_routing` installs its hook for the one forward and puts back
what was there); with only `compare_routing`, they keep their own choice and the mismatch
is counted. Roles that ignore the routing (a reference, an MoE reward model of another
shape) forward without either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.hf_loader import unwrap
from rl_megatron.models.router_replay import RoutingStats, replay_routing
from rl_megatron.parallel import ParallelGroups


def around_forward(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    replay: bool,
    compare: bool,
    stats: RoutingStats | None,
    tp: dist.ProcessGroup,
    sequence_parallel: bool,
    role: str,
) -> contextlib.AbstractContextManager:
    """The context to run `model` (one chunk, maybe DDP-wrapped) in on `batch` (one
    micro-batch): the rollout's routing replayed (`replay`) or only compared (`compare`),
    mismatches counted into `stats`; nothing to do when neither is on or the batch carries
    no routing. tp, sequence_parallel: with sequence parallelism each TP rank's routers see
    its share of the tokens. role: the role's name in errors."""
    if replay and "routed_experts" not in batch:
        raise ValueError(
            f"{role}: router_replay is on but the batch has no routed_experts "
            f"(the rollout engine recorded no routing)"
        )
    if "routed_experts" not in batch or not (replay or compare):
        return contextlib.nullcontext()
    return replay_routing(
        unwrap(model),
        batch["routed_experts"],
        replay=replay,
        stats=stats,
        sp_rank=dist.get_rank(tp) if sequence_parallel else 0,
        sp_size=dist.get_world_size(tp) if sequence_parallel else 1,
    )


def mismatch_fraction(
    stats: RoutingStats,
    groups: ParallelGroups,
    sequence_parallel: bool,
    device: torch.device,
) -> float | None:
    """Of the (token, layer) pairs with a recorded routing in `stats`, the fraction whose
    recorded top-k set differs from the router's own choice, summed over pipeline stages and
    DP (and TP with sequence parallelism, which splits the tokens). None when nothing was
    recorded. Collective over the role's ranks."""
    counts = torch.stack([stats.mismatched, stats.recorded]).to(device).double()
    reduce_over = [groups.pp, groups.dp]
    if sequence_parallel:
        reduce_over.append(groups.tp)
    for group in reduce_over:
        dist.all_reduce(counts, group=group)
    mismatched, recorded = counts.tolist()
    return mismatched / recorded if recorded else None
