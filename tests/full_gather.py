"""The name-based weight sync: every rank gathers every full HF tensor (fallback, baseline).

What most open-source RL trainers do: each tensor-parallel group all-gathers each
parameter (an expert: its expert-TP group), the expert-parallel rank holding an expert
broadcasts it over its EP group, the pipeline stage that owns it broadcasts the full tensor
to the other stages,
it is converted to its Hugging Face name(s) and shape(s), and the engine's
`load_weights` slices its own shard out of it. Works for any engine that accepts HF names
(vLLM, the Megatron engine, anything else), which is why it stays as the fallback; it
moves the whole model to every rank, which is why it is the baseline the resharding
benchmark compares against.

Memory: full HF tensors are buffered up to one bucket before each `load_weights` call
(`peak_staging_bytes` counts them; the gathered TP shards of the tensor in flight come on
top); a single tensor larger than the bucket is still passed whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models.families import table
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding import shards
from rl_megatron.resharding.agreement import MIB
from rl_megatron.resharding.executor import SyncStats
from rl_megatron.resharding.layouts import TrainingLayout
from rl_megatron.resharding.sources import megatron_sources


def _model_params(info: HFModelInfo, training: TrainingLayout, padded_vocab: int):
    """(pipeline stage, Megatron name, rule, layer) of every exported parameter, in the
    same order on every rank."""
    rules = {r.megatron: r for r in hm.rules_for(info, "lm")}
    out = []
    etp, ep = training.expert_tp, training.ep
    for stage in range(training.pp):
        # etp rank 0 of each EP rank of the stage (megatron-core's expert mesh, etp-ep-pp):
        # together they hold every expert; the first of them is tp rank 0 as well.
        ranks = [e * etp + stage * etp * ep for e in range(ep)] if info.num_experts else []
        specs = shards.megatron_specs(info, training, stage * training.tp, padded_vocab)
        seen = {spec.name for spec in specs}
        for rank in ranks:
            specs += [
                s for s in shards.megatron_specs(info, training, rank, padded_vocab)
                if s.name not in seen and not seen.add(s.name)
            ]  # fmt: skip
        order = {name: i for i, name in enumerate(rules)}
        for spec in sorted(specs, key=lambda s: _param_order(s.name, order)):
            parts = spec.name.split(".")
            layer = int(parts[2]) if parts[:2] == ["decoder", "layers"] else None
            canonical = (
                spec.name if layer is None else spec.name.replace(f".{layer}.", ".{layer}.", 1)
            )
            rule = rules[canonical]
            if not rule.export:
                continue  # a tied head's copy on the last stage: the embedding is exported
            out.append((stage, spec.name, rule, layer))
    return out


@torch.no_grad()
def full_gather_sync(
    model_chunks: Sequence[torch.nn.Module],
    engine: Any,
    *,
    info: HFModelInfo,
    training: TrainingLayout,
    version: int,
    bucket_mb: float,
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup,
    ep_group: dist.ProcessGroup | None = None,
    etp_group: dist.ProcessGroup | None = None,
) -> SyncStats:
    """Push the actor's weights to `engine` under HF names, full shapes (collective).

    Args:
        model_chunks: this rank's actor chunks.
        engine: a `RolloutEngine` (begin / load_weights / finish), on every rank.
        tp_group, pp_group: the training layout's tensor- and pipeline-parallel groups.
        ep_group, etp_group: its expert-parallel and expert-TP groups (MoE at ep or etp > 1).
        bucket_mb: HF tensors are passed to `load_weights` in buckets of about this size.
    """
    rank = dist.get_rank()
    coords = training.coordinates(rank)
    experts = shards.expert_coords(training, rank, info)
    ep_rank = training.expert_coordinates(rank)["ep"] if info.num_experts else 0
    per_ep = info.num_experts // training.ep if info.num_experts else 0
    sources = megatron_sources(model_chunks, info)
    some = next(iter(sources.values()))
    dtype, device, elem = some.dtype, some.device, some.element_size()
    padded = _padded_vocab(sources, training, pp_group, device)
    stats = SyncStats(rank=rank)
    bucket: list[tuple[str, torch.Tensor]] = []
    held = live_peak = 0
    limit = bucket_mb * MIB
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start_alloc = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    engine.begin_weight_update(version)
    for stage, name, rule, layer in _model_params(info, training, padded):
        on_stage = coords["pp"] == stage
        expert = rule.expert is not None
        mine = on_stage and (not expert or rule.expert in experts["held"])
        split, group = (experts["etp"], etp_group) if expert else (training.tp, tp_group)
        if mine:
            shard = sources[name]
            if rule.tp_dim is None or split == 1:
                full_parts = [shard]  # replicated over TP, or nothing to gather
            else:
                full_parts = [torch.empty_like(shard) for _ in range(split)]
                dist.all_gather(full_parts, shard.contiguous(), group=group)
                stats.bytes_received += shard.nbytes * (split - 1)
                stats.bytes_sent += shard.nbytes * (split - 1)
            named = hm.megatron_to_hf(rule, layer, full_parts, info)
        else:
            named = [(n.format(layer=layer), None) for n, _ in rule.hf]
        out = []
        for hf_name, tensor in named:
            hf_shape = table.hf_shape(_hf_symbolic(rule, hf_name, layer), info)
            if expert and training.ep > 1 and on_stage:
                # The EP rank holding the expert sends it to the others of its EP group.
                owner = rule.expert // per_ep
                if tensor is None:
                    tensor = torch.empty(hf_shape, dtype=dtype, device=device)
                    stats.bytes_received += tensor.nbytes
                else:
                    tensor = tensor.contiguous()
                    stats.bytes_sent += tensor.nbytes * (training.ep - 1)
                src = rank + (owner - ep_rank) * experts["etp"]
                dist.broadcast(tensor, src=src, group=ep_group)
            if training.pp > 1:
                if tensor is None:
                    tensor = torch.empty(hf_shape, dtype=dtype, device=device)
                    stats.bytes_received += tensor.nbytes
                else:
                    tensor = tensor.contiguous()
                    stats.bytes_sent += tensor.nbytes * (training.pp - 1)
                src = rank + (stage - coords["pp"]) * training.tp
                dist.broadcast(tensor, src=src, group=pp_group)
            out.append((hf_name, tensor))
            held += tensor.numel() * elem
        live_peak = max(live_peak, held)
        bucket += out
        if held >= limit:
            engine.load_weights(bucket)
            bucket, held = [], 0
    if bucket:
        engine.load_weights(bucket)
    engine.finish_weight_update()
    stats.wall_s = time.perf_counter() - t0
    stats.peak_staging_bytes = live_peak
    if cuda:
        stats.device_peak_extra_bytes = torch.cuda.max_memory_allocated(device) - start_alloc
    return stats


class SpecNameLoader:
    """An HF-named `load_weights` into a tensor-store target: each rank copies its own rows
    out of every full HF tensor it is given (what vLLM's loaders do), by the store's shard
    specs. The name-based path's sink in the benchmark, next to the resharded store."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.weight_version: int | None = None
        self._spans: dict[str, list[tuple[str, int, shards.Span]]] = {}
        for spec in store.specs:
            for span in spec.spans:
                if span.hf_name is not None:
                    self._spans.setdefault(span.hf_name, []).append((spec, span))
                else:
                    self._rows(spec, span).zero_()

    def begin_weight_update(self, version: int) -> None:
        self._pending = version

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for hf_name, tensor in weights:
            for spec, span in self._spans.get(hf_name, []):
                self._rows(spec, span).copy_(tensor.narrow(spec.dim, span.hf_start, span.length))

    def _rows(self, spec: shards.ShardSpec, span: shards.Span) -> torch.Tensor:
        slot_rows = spec.slot_rows if spec.stack else 0
        tensor = self.store.tensors[spec.name]
        return shards.rows_view(tensor, spec.dim, span.offset, span.length, slot_rows)

    def finish_weight_update(self) -> None:
        self.weight_version = self._pending


def _param_order(name: str, order: dict[str, int]) -> tuple[int, int]:
    """Model order: embedding, layers (each in table order, experts by index), the rest."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return (0 if name.startswith("embedding") else 2**31), order.get(name, 0)
    layer = int(parts[2])
    return layer + 1, order[name.replace(f".{layer}.", ".{layer}.", 1)]


def _hf_symbolic(rule: table.Rule, hf_name: str, layer: int | None) -> table.Shape:
    for name, shape in rule.hf:
        if name.format(layer=layer) == hf_name:
            return shape
    raise AssertionError(f"{hf_name} is not made by {rule.megatron}")


def _padded_vocab(sources, training, pp_group, device) -> int:
    """Megatron's padded vocabulary (middle stages hold no embedding: max over stages)."""
    mine = 0
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in sources:
            mine = sources[name].shape[0] * training.tp
    t = torch.tensor([mine], dtype=torch.int64, device=device)
    if training.pp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pp_group)
    return int(t.item())
