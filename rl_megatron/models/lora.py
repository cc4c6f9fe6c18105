"""LoRA adapters on megatron-core's parallel linears: y = base(x) + (alpha/r)·B(A(dropout(x))).

    adapters = apply_lora(chunks, config.actor.lora, seed)   # before DDP; base frozen
    with adapters_disabled(chunks): ...                      # the base model (the reference)
    merged = merged_weight(adapter)                          # W + (alpha/r)·B·A, one tensor

Each adapted linear keeps its module, its parameters and their names (so checkpoints, the
HF name tables and the resharding sources see the base weights as before); the adapter is a
sibling module `<name>_lora` (parameters `lora_a` [r, in], `lora_b` [out, r], torch's and
PEFT's orientation), added to the output by a forward hook on the base linear.

Sharding follows the adapted layer, so every parallel degree works unchanged:

* column-parallel (`linear_qkv`, `linear_fc1`; weight rows split over TP): A is full and
  replicated, B is split like the weight's rows (the same rows: the QKV interleave per query
  group and fc1's [gate; up] per shard are the base weight's, so a per-shard B follows them).
  The r-wide activation A·x is the one all TP ranks share: without sequence parallelism it
  crosses `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of its gradient,
  so A's gradient is complete on every rank); with it, each rank computes A on its sequence
  slice and all-gathers the r-wide result (its backward reduce-scatters), so A's gradient is
  partial over the sequence and is summed over TP by megatron-core's `finalize_model_grads`
  (`sequence_parallel` attribute, as on the layer norms).
* row-parallel (`linear_proj`, `linear_fc2`; weight columns split over TP): A is split like
  the input (its columns), B is full. A's partial sums over TP are reduced once, on the
  r-wide activation (all-reduce, or reduce-scatter over the sequence with sequence
  parallelism: then B's gradient is partial over the sequence, `sequence_parallel` again),
  never inside the base's reduction, so the base's output and its bias are untouched.
* an expert's linears (`SequentialMLP`, expert TP 1): no TP collective (the token dispatcher
  moves the tokens); A and B carry the base weight's `allreduce` flag, so megatron-core's DDP
  reduces them over the expert-data-parallel group as it does the expert weights.

Initialisation: B = 0, so an adapted model starts as its base, exactly. A is kaiming-uniform
(torch.nn.Linear's default) drawn in full from a generator seeded by the run seed and the
adapter's global name (global layer, global expert), then sliced for its TP shard: every TP
rank agrees where A is replicated, and any TP / PP / EP layout starts from the same adapters.
Dropout (on the adapter's input only) draws from megatron's model-parallel RNG where the
input is split over TP (row-parallel, or sequence parallel), from the default RNG where it is
replicated, so the replicated r-wide activation stays identical on every TP rank.

Transformer Engine's linears are not adapted (the fused layer-norm linear hides the
normalised input the adapter needs): `apply_lora` refuses them in one line, and the trainer
builds a LoRA actor on the local layer spec (`trainer/build.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from torch import Tensor

# How each adapted module splits over TP: its megatron-core name → parallel mode.
MODES = {
    "linear_qkv": "column",
    "linear_proj": "row",
    "linear_fc1": "column",
    "linear_fc2": "row",
    "output_layer": "column",  # the LM head (vocabulary rows split over TP), not tied
}
SUFFIX = "_lora"  # the adapter of module `name` is its sibling `name + SUFFIX`


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one parallel linear, sharded like it (module docstring).

    Args:
        base: the adapted `ColumnParallelLinear` / `RowParallelLinear` (this rank's shard).
        mode: "column" or "row", how `base` splits over TP.
        rank, alpha, dropout: `actor.lora.*`.
        seed: the adapter's own seed (`apply_lora`: run seed and global name).
        gated: `base` is a gated MLP's `linear_fc1` ([gate; up] rows per TP shard).
    """

    def __init__(
        self,
        base: torch.nn.Module,
        mode: str,
        rank: int,
        alpha: float,
        dropout: float,
        seed: int,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.mode, self.rank, self.scale = mode, rank, alpha / rank
        # The adapted linear, held weakly (a module attribute would register it twice).
        self.base = weakref.ref(base)
        self.enabled = True  # `adapters_disabled` turns the update off
        self.tp_group = base.tp_group
        expert_comm = bool(getattr(base, "explicit_expert_comm", False))
        tp = self.tp_group.size() if self.tp_group is not None else 1
        # Collectives over TP unless the layer leaves them to the expert token dispatcher.
        self.communicate = tp > 1 and not expert_comm
        self.sequence_parallel = bool(base.sequence_parallel) and self.communicate
        self.dropout_p = dropout
        # fc1 of a gated MLP holds [gate; up] per TP shard: B's rows too (checkpoint layout).
        self.gated = gated
        self.vocab_rows = False  # B's rows are the LM head's padded vocabulary (`_adapt_head`)
        out_local, in_local = base.weight.shape
        in_full = in_local * tp if mode == "row" else in_local
        weight = base.weight
        gen = torch.Generator().manual_seed(seed)
        a_full = torch.empty(rank, in_full, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=gen)
        if mode == "row":
            tp_rank = self.tp_group.rank() if tp > 1 else 0
            a_full = a_full[:, tp_rank * in_local : (tp_rank + 1) * in_local]
        kw = {"dtype": weight.dtype, "device": weight.device}
        self.lora_a = torch.nn.Parameter(a_full.contiguous().to(**kw))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, rank, **kw))
        split, full = (self.lora_b, self.lora_a) if mode == "column" else (self.lora_a, self.lora_b)
        # The split one is sharded like the base weight (rows for column, columns for row);
        # grad-norm counts it on every TP rank, the replicated one once.
        tensor_parallel.set_tensor_model_parallel_attributes(
            split, tp > 1 and not expert_comm, 0 if mode == "column" else 1, 1
        )
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(full)
        # Partial over the sequence with sequence parallelism: summed over TP like the norms.
        full.sequence_parallel = self.sequence_parallel
        if hasattr(weight, "allreduce"):  # expert weights: reduced over expert-DP instead
            for p in (self.lora_a, self.lora_b):
                p.allreduce = weight.allreduce

    def forward(self, x: Tensor) -> Tensor:
        """The scaled update for the base's input `x` ([s, b, in] sequence-first, as the
        base receives it); its shape is the base output's."""
        if self.dropout_p > 0 and self.training:
            # Masks must agree across TP where the input is replicated (column, no SP).
            split_input = self.mode == "row" or self.sequence_parallel
            rng = (
                tensor_parallel.get_cuda_rng_tracker().fork()
                if split_input and self.communicate
                else contextlib.nullcontext()
            )
            with rng:
                x = F.dropout(x, self.dropout_p, training=True)
        h = F.linear(x, self.lora_a)  # [s, b, r]: full (column) or partial over TP (row)
        if self.communicate:
            group = self.tp_group
            if self.mode == "column":
                if self.sequence_parallel:
                    h = tensor_parallel.gather_from_sequence_parallel_region(h, group=group)
                else:
                    h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=group)
            elif self.sequence_parallel:
                h = tensor_parallel.reduce_scatter_to_sequence_parallel_region(h, group=group)
            else:
                h = tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=group)
        return F.linear(h, self.lora_b) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """dist_checkpointing view: the split factor sharded on TP like the base weight, so
        a checkpoint holds the same global tensors at any TP (fc1's B as [gate; up], as
        megatron-core's MLP stores fc1's weight)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        split = {"lora_b": 0} if self.mode == "column" else {"lora_a": 1}
        out = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            split,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.vocab_rows:
            # The LM head's vocabulary padding depends on TP (megatron-core marks the head's
            # weight the same way): a checkpoint loads at another TP, its padding rows
            # cut or zero-filled.
            out[f"{prefix}lora_b"].allow_shape_mismatch = True
        if self.gated:
            key = f"{prefix}lora_b"
            singleton = metadata.get("singleton_local_shards", False)
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out


def _add_update(adapter: LoraAdapter):
    """Forward hook on the base linear: (out, bias) → (out + update, bias)."""

    def hook(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0]), bias

    return hook


def _add_head_update(adapter: LoraAdapter):
    """Forward hook (with kwargs) on the LM head: its logits may be gathered over TP (the
    layer's `gather_output`, or GPTModel's `runtime_gather_output`), and inside
    `chunked_logprobs.output_hidden_states` it returns the hidden states instead, whose
    log-probs take the adapter through `head_weight` rather than here."""

    def hook(module, args, kwargs, output):
        if not adapter.enabled or getattr(module, "returns_hidden_states", False):
            return output
        out, bias = output
        update = adapter(args[0])
        gather = kwargs.get("runtime_gather_output")
        if (module.gather_output if gather is None else gather) and adapter.communicate:
            update = tensor_parallel.gather_from_tensor_model_parallel_region(
                update, group=adapter.tp_group
            )
        return out + update, bias

    return hook


def _adapter_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _global_names(chunk: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(local module path, global key, module) for every module inside decoder layers;
    the key numbers layers and experts globally, so it is the same in every layout."""
    for i, layer in enumerate(chunk.decoder.layers):
        for path, module in layer.named_modules():
            key = path
            found = _EXPERT.match(path)
            if found:
                # Rank r of the EP group holds experts [r·n, (r+1)·n) (megatron-core).
                experts = layer.get_submodule(found["owner"])
                offset = experts.ep_group.rank() * experts.num_local_experts
                expert = offset + int(found["local"])
                key = f"{found['owner']}.local_experts.{expert}{found['rest']}"
            yield f"decoder.layers.{i}.{path}", f"{layer.layer_number - 1}.{key}", module


_EXPERT = re.compile(r"(?P<owner>.*)\.local_experts\.(?P<local>\d+)(?P<rest>.*)")


def apply_lora(
    chunks: Sequence[torch.nn.Module],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    seed: int,
) -> list[LoraAdapter]:
    """Freeze `chunks` and add an adapter to every targeted linear; before DDP wraps them.

    Args:
        chunks: this rank's `GPTModel` chunks (unwrapped).
        rank, alpha, dropout, target_modules: `actor.lora.*` (rank > 0).
        seed: the run seed (`trainer.seed`); A's draw is a function of it and the name only.
    Returns the adapters added, in module order.
    """
    if rank <= 0:
        raise ValueError(f"apply_lora needs rank > 0, got {rank}")
    adapters = []
    for chunk in chunks:
        chunk.requires_grad_(False)
        for path, key, module in list(_global_names(chunk)):
            parent_path, _, name = path.rpartition(".")
            if name not in target_modules:
                continue
            mode = MODES[name]
            expected = (
                tensor_parallel.ColumnParallelLinear
                if mode == "column"
                else tensor_parallel.RowParallelLinear
            )
            if not isinstance(module, expected):
                raise RuntimeError(
                    f"actor.lora.target_modules: {path} is a {type(module).__name__}, not "
                    f"megatron-core's {expected.__name__}; LoRA needs the local layer spec "
                    "(Transformer Engine linears are not adapted yet)"
                )
            gated = name == "linear_fc1" and module.config.gated_linear_unit
            adapter = LoraAdapter(
                module, mode, rank, alpha, dropout, _adapter_seed(seed, key), gated
            )
            chunk.get_submodule(parent_path).add_module(name + SUFFIX, adapter)
            module.register_forward_hook(_add_update(adapter))
            adapters.append(adapter)
        if "output_layer" in target_modules and getattr(chunk, "post_process", False):
            adapters.append(_adapt_head(chunk, rank, alpha, dropout, seed))
    if not adapters:
        raise RuntimeError(
            f"actor.lora.target_modules: none of {list(target_modules)} is in the model"
        )
    return adapters


def _adapt_head(chunk: torch.nn.Module, rank: int, alpha: float, dropout: float, seed: int):
    """The LM head's adapter (`output_layer_lora`, a sibling of `output_layer`).

    A randomly initialised model's frozen head caps every logit near |W_v|·|h| (the final
    norm fixes |h|), so adapters inside the layers cannot make any token likely; PEFT
    names the same target `lm_head`. A head tied to the embedding is refused: merging
    into it would change the input embedding too.
    """
    head = chunk.output_layer
    if not isinstance(head, tensor_parallel.ColumnParallelLinear) or head.weight is None:
        raise RuntimeError(
            "actor.lora.target_modules: output_layer needs an untied LM head "
            f"(model.tie_word_embeddings is on, or the head is a {type(head).__name__})"
        )
    adapter = LoraAdapter(head, "column", rank, alpha, dropout, _adapter_seed(seed, "output_layer"))
    adapter.vocab_rows = True
    chunk.add_module("output_layer" + SUFFIX, adapter)
    head.register_forward_hook(_add_head_update(adapter), with_kwargs=True)
    return adapter


def head_weight(model: torch.nn.Module, weight: Tensor) -> Tensor:
    """The LM head's weight as the model uses it: W + (alpha/r)·B·A with an enabled head
    adapter (differentiable in A and B, for log-probs computed from the hidden states),
    `weight` itself otherwise. The product is made in W's dtype like `merged_weight`."""
    adapter = getattr(model, "output_layer" + SUFFIX, None)
    if adapter is None or not adapter.enabled:
        return weight
    lora_a = adapter.lora_a
    if adapter.communicate:
        # Each TP rank's weight gradient covers its vocabulary rows only, so A's (replicated)
        # gradient is partial: summed over TP in the backward, as the hook's path sums it.
        lora_a = tensor_parallel.copy_to_tensor_model_parallel_region(
            lora_a, group=adapter.tp_group
        )
    return weight + _update(adapter, lora_a, weight.dtype)


def adapters_of(chunks: Sequence[torch.nn.Module]) -> list[LoraAdapter]:
    """Every adapter in `chunks` (wrappers allowed), in module order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoraAdapter)]


def adapter_param_ids(module: torch.nn.Module) -> frozenset[int]:
    """ids of the adapter parameters in `module`: not HF weights, merged into their base."""
    return frozenset(
        id(p) for m in module.modules() if isinstance(m, LoraAdapter) for p in m.parameters()
    )


def adapters_by_weight(module: torch.nn.Module) -> dict[int, LoraAdapter]:
    """id(adapted base weight) → its adapter, for every adapter in `module`."""
    return {
        id(a.base().weight): a
        for a in module.modules()
        if isinstance(a, LoraAdapter) and a.base() is not None
    }


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The chunks compute their base model (adapters skipped) inside the block."""
    adapters = adapters_of(chunks)
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(adapters, before):
            a.enabled = state


@torch.no_grad()
def merged_weight(weight: Tensor, adapter: LoraAdapter) -> Tensor:
    """W + (alpha/r)·B·A for this rank's shard, in W's dtype: a new tensor, W untouched.

    The order is fixed (B·A, then the scale, then the sum, each in W's dtype), so a merge
    by hand in that order gives the same bits.
    """
    return weight + _update(adapter, adapter.lora_a, weight.dtype)


def _update(adapter: LoraAdapter, lora_a: Tensor, dtype: torch.dtype) -> Tensor:
    """(alpha/r)·B·A in `dtype`, in the one order both merges use (B·A, then the scale)."""
    return (adapter.lora_b.to(dtype) @ lora_a.to(dtype)) * adapter.scale
