"""Routing replay (R3): a forward's MoE routers take their experts from a recorded routing.

megatron-core's top-k router hands every token's top-k choice to the object in its
`router_replay` attribute (`TopKRouter.routing` → `moe_utils.topk_routing_with_score_function`
→ `router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`);
with `TransformerConfig.moe_enable_routing_replay` it builds one `RouterReplay` per router
there (megatron/core/transformer/moe/router_replay.py). That class keeps every router of
the process in one class-level list and takes one tensor per entry of it, so with an MoE
actor and an MoE reference in one process its `set_replay_data` would need routing for both
models, in build order. `replay_routing` instead puts an object of its own in that attribute
of one model chunk's routers, for one forward, and puts back what was there after: the same
hook, one model, explicit layers.

Routing layout (what the rollout recorded), aligned with the model's `input_ids`:

    routing  [b, s, L, k]  int   expert ids of token (row, column) at layer l (0-based,
                                 global over pipeline stages); -1 where not recorded
             [1, T, L, k]        for packed micro-batches (THD), the same as their ids

A router of global layer l (megatron-core's 1-based `layer_number` − 1) sees its input
sequence-first, `[s, b, h]` flattened to `s·b` tokens (token (row i, column j) is number
j·b + i); with sequence parallelism, this TP rank's `s/tp` consecutive columns. A token whose
routing is -1 keeps the router's own choice: prompt tokens when the engine returned no
prompt routing, padding, and a response's last token, which no engine forwards (its output
predicts nothing the trainer reads). The experts' weights (`probs`) are always the router's
own scores at the replayed experts, so gradients still reach the router.

Each replayed router also compares its own top-k set with the recorded one on every
recorded token (`RoutingStats`): the mismatch that replay removes, layer by layer, given
the (replayed) routing of the layers below.

Recording goes through the same hook: within `record_routing(model)` each router computes
its own top-k as it would without a hook (so nothing about the forward changes) and keeps
the indices, which `RoutingRecorder.take()` returns after each forward as one
`[tokens, L, k]` tensor in the routers' token order (the Megatron rollout engine's routing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["RoutingRecorder", "RoutingStats", "moe_routers", "record_routing", "replay_routing"]


@dataclass
class RoutingStats:
    """Running counts over replayed forwards: (token, layer) pairs with a recorded routing,
    and those whose recorded top-k set differs from the router's own."""

    mismatched: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    recorded: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))

    def add(self, mismatched: torch.Tensor, recorded: torch.Tensor) -> None:
        self.mismatched = self.mismatched.to(mismatched.device) + mismatched
        self.recorded = self.recorded.to(recorded.device) + recorded


def moe_routers(model: torch.nn.Module) -> list[tuple[int, TopKRouter]]:
    """The top-k routers of a model chunk with their global layer index (0-based), in
    layer order."""
    routers = [(m.layer_number - 1, m) for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(routers, key=lambda pair: pair[0])


class _Replay:
    """megatron-core's `router_replay` hook for one router and one forward."""

    def __init__(self, target: torch.Tensor, replay: bool, stats: RoutingStats | None) -> None:
        self.target, self.replay, self.stats = target, replay, stats  # target: [tokens, k]

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target.to(device=own.device, dtype=own.dtype)
        if target.shape != own.shape:
            raise ValueError(
                f"routing replay: the router sees {tuple(own.shape)} (tokens, top-k) but the "
                f"recorded routing gives {tuple(target.shape)}"
            )
        known = (target >= 0).all(dim=-1)
        if self.stats is not None:
            differ = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)
            self.stats.add((differ & known).sum(), known.sum())
        chosen = torch.where(known[:, None], target, own) if self.replay else own
        return scores.gather(1, chosen), chosen


@contextlib.contextmanager
def replay_routing(
    model: torch.nn.Module,
    routing: torch.Tensor,
    *,
    replay: bool = True,
    stats: RoutingStats | None = None,
    sp_rank: int = 0,
    sp_size: int = 1,
) -> Iterator[None]:
    """Within the block, `model`'s routers route as `routing` says (module docstring).

    model: one model chunk (its routers: the layers of its pipeline stage).
    routing: `[b, s, L, k]` (or packed `[1, T, L, k]`), batch-first like the chunk's
        input ids; -1 where the router's own choice stands.
    replay: False keeps every router's own choice (only `stats` are counted).
    stats: counts of (token, layer) pairs whose recorded set differs from the router's own.
    sp_rank, sp_size: with sequence parallelism, this rank's place in the TP group (each
        rank's routers see `s / sp_size` consecutive columns).
    """
    routers = moe_routers(model)
    seq_first = routing.transpose(0, 1)  # [s, b, L, k]: the routers' token order
    if sp_size > 1:
        width = seq_first.shape[0] // sp_size
        seq_first = seq_first[sp_rank * width : (sp_rank + 1) * width]
    k = seq_first.shape[-1]
    previous = [router.router_replay for _, router in routers]
    try:
        for layer, router in routers:
            if layer >= seq_first.shape[2]:
                raise ValueError(
                    f"routing replay: the routing has {seq_first.shape[2]} layers, the model "
                    f"has a router at layer {layer}"
                )
            target = seq_first[:, :, layer].reshape(-1, k)
            router.router_replay = _Replay(target, replay, stats)
        yield
    finally:
        for (_, router), old in zip(routers, previous):
            router.router_replay = old


class RoutingRecorder:
    """The experts a model chunk's routers chose in its latest forward (`record_routing`)."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = layers  # global layer index (0-based) of each router, in layer order
        self._latest: dict[int, torch.Tensor] = {}  # layer -> [tokens, k]

    def take(self) -> torch.Tensor:
        """The latest forward's routing, then forgotten: `[tokens, L, k]` int16 on the
        model's device, token order the routers' (sequence-first, `[s, b]` flattened: token
        (row i, column j) of a `[b, s]` input is number j·b + i), layers `self.layers`."""
        missing = [layer for layer in self.layers if layer not in self._latest]
        if missing:
            raise RuntimeError(
                f"routing recorder: the routers of layers {missing} did not run since the last "
                f"take() (a replayed CUDA graph runs no Python hook)"
            )
        latest, self._latest = self._latest, {}
        return torch.stack([latest[layer] for layer in self.layers], dim=1).to(torch.int16)


class _Record:
    """megatron-core's `router_replay` hook that routes as the router would and keeps it."""

    def __init__(self, recorder: RoutingRecorder, layer: int) -> None:
        self.recorder, self.layer = recorder, layer

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        values, indices = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        self.recorder._latest[self.layer] = indices  # [tokens, k]; stays on the device
        return values, indices


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[RoutingRecorder]:
    """Within the block, `model`'s routers keep the experts they choose (their own top-k,
    unchanged); `recorder.take()` after each forward returns them (`RoutingRecorder`).

    model: one model chunk with MoE layers. Routers with megatron-core's fused top-k
    (`moe_router_fusion`, TE) never call the hook: `take()` then raises.
    """
    routers = moe_routers(model)
    if not routers:
        raise ValueError("routing recorder: the model has no MoE router")
    recorder = RoutingRecorder([layer for layer, _ in routers])
    previous = [router.router_replay for _, router in routers]
    try:
        for layer, router in routers:
            router.router_replay = _Record(recorder, layer)
        yield recorder
    finally:
        for (_, router), old in zip(routers, previous):
            router.router_replay = old
