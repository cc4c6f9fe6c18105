"""A LoRA actor's weights as an engine must receive them: W + (alpha/r)·B·A, per rank shard.

    merge = LoraMerge()
    sent = merge(model_chunks, sources)   # the parameter table, adapted weights merged
    ...                                   # the sync reads `sent` only; then it is dropped

An engine that generates with its own copy of the weights (vLLM) has no adapters: it must be
sent the merged weight of every adapted linear (`models/lora.py`). The merge is done per
rank shard, on the shard the sync would have sent (`merged_weight`: a column-parallel B is
split like W's rows, fc1's [gate; up] and the QKV interleave included; a row-parallel A like
W's columns; an expert's adapters sit on its own weights; the LM head's B is split like its
vocabulary rows, padding included), so the plan, the copy program and the engine's layout
are the same as for a plain actor: only the source tensors differ.

The merged tensors are temporaries, made when the sync starts and freed when it returns: the
extra memory is the adapted weights of this rank (with all four linear kinds adapted, nearly
all of its parameter bytes; not the embeddings, norms or, unless adapted, the LM head) plus
one B·A product, during the sync only (`SyncStats.lora_merged_bytes`; not in its
`device_peak_extra_bytes`, which counts from the executor's start, when the merges already
exist). The trainer's base weights are never written.

A source table without adapters is returned as it is (one lookup per chunk per sync), so a
plain actor's sync pays nothing and keeps its copy views (`weight_sync.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from rl_megatron.checkpoint.hf_loader import unwrap
from rl_megatron.models.lora import LoraAdapter, adapters_of, merged_weight


class LoraMerge:
    """Replaces the adapted weights of a source table by their merges, sync after sync.

    Which adapters a chunk holds is read once per chunk (held weakly, as `SourceTable`
    holds it); which weight each adapts is read on every call (its base module's `weight`
    now), so a replaced base weight is still found and merged. An adapter added to a chunk
    after its first sync is not seen: build a new chunk instead (as for `SourceTable`).
    """

    def __init__(self) -> None:
        self._adapters: weakref.WeakKeyDictionary[torch.nn.Module, list[LoraAdapter]] = (
            weakref.WeakKeyDictionary()
        )
        self.merged_bytes = 0  # bytes of the merges the last call made (`SyncStats`)

    def adapters(self, model_chunks: Sequence[torch.nn.Module]) -> list[LoraAdapter]:
        """The adapters of `model_chunks` (wrappers allowed), in module order."""
        out: list[LoraAdapter] = []
        for chunk in model_chunks:
            model = unwrap(chunk)
            found = self._adapters.get(model)
            if found is None:
                found = self._adapters[model] = adapters_of([model])
            out += found
        return out

    @torch.no_grad()
    def __call__(
        self, model_chunks: Sequence[torch.nn.Module], sources: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """`sources` (this rank's parameters by name, `sources.SourceTable`) with each
        adapted weight replaced by a new tensor W + (alpha/r)·B·A in W's dtype (the same
        names, in the same order); `sources` itself when `model_chunks` hold no adapter.

        Raises RuntimeError if an adapter's weight is not among `sources`: the engine would
        be sent a weight without its adapter.
        """
        adapters = self.adapters(model_chunks)
        self.merged_bytes = 0
        if not adapters:
            return sources
        by_weight = {}
        for adapter in adapters:
            base = adapter.base()
            if base is not None:
                by_weight[id(base.weight)] = adapter
        merged = dict(sources)
        done: dict[int, torch.Tensor] = {}  # one merge per weight, were one sent twice
        for name, weight in sources.items():
            adapter = by_weight.get(id(weight))
            if adapter is not None:
                if id(weight) not in done:
                    done[id(weight)] = merged_weight(weight, adapter)
                merged[name] = done[id(weight)]
        if len(done) != len(by_weight):
            raise RuntimeError(
                f"weight sync: {len(by_weight) - len(done)} of {len(by_weight)} LoRA adapters "
                "adapt a weight the sync does not send; it would go to the engine unmerged"
            )
        self.merged_bytes = sum(t.nbytes for t in done.values())
        return merged
