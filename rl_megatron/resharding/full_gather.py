"""The name-based weight sync: every rank gathers every full HF tensor (fallback, baseline).

What most open-source RL trainers do: each tensor-parallel group all-gathers each
parameter, the pipeline stage that owns it broadcasts the full tensor to the other stages,
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
    for stage in range(training.pp):
        rank = stage * training.tp  # tp rank 0 of the stage, first replica
        for spec in shards.megatron_specs(info, training, rank, padded_vocab):
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
) -> SyncStats:
    """Push the actor's weights to `engine` under HF names, full shapes (collective).

    Args:
        model_chunks: this rank's actor chunks.
        engine: a `RolloutEngine` (begin / load_weights / finish), on every rank.
        tp_group, pp_group: the training layout's tensor- and pipeline-parallel groups.
        bucket_mb: HF tensors are passed to `load_weights` in buckets of about this size.
    """
    rank = dist.get_rank()
    coords = training.coordinates(rank)
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
        mine = coords["pp"] == stage
        if mine:
            shard = sources[name]
            if rule.tp_dim is None or training.tp == 1:
                full_parts = [shard]  # replicated over TP, or nothing to gather
            else:
                full_parts = [torch.empty_like(shard) for _ in range(training.tp)]
                dist.all_gather(full_parts, shard.contiguous(), group=tp_group)
                stats.bytes_received += shard.nbytes * (training.tp - 1)
                stats.bytes_sent += shard.nbytes * (training.tp - 1)
            named = hm.megatron_to_hf(rule, layer, full_parts, info)
        else:
            named = [(n.format(layer=layer), None) for n, _ in rule.hf]
        out = []
        for hf_name, tensor in named:
            hf_shape = table.hf_shape(_hf_symbolic(rule, hf_name, layer), info)
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
                    self._spans.setdefault(span.hf_name, []).append((spec.name, spec.dim, span))
                else:
                    store.tensors[spec.name].narrow(spec.dim, span.offset, span.length).zero_()

    def begin_weight_update(self, version: int) -> None:
        self._pending = version

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for hf_name, tensor in weights:
            for name, dim, span in self._spans.get(hf_name, []):
                dst = self.store.tensors[name].narrow(dim, span.offset, span.length)
                dst.copy_(tensor.narrow(dim, span.hf_start, span.length))

    def finish_weight_update(self) -> None:
        self.weight_version = self._pending


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
