"""What each rank holds of every parameter, as row ranges of Hugging Face tensors (pure).

Every layout this project moves weights between — Megatron's training shards at any
(TP, PP, VPP), the Megatron rollout engine at another TP, vLLM's fused parameters — is a
*stack of row ranges of HF tensors* along one dimension of each parameter shard:

    Megatron linear_qkv (TP rank r):  [q_g, k_g, v_g for each of its query groups g]
    vLLM qkv_proj (TP rank r):        [q of its heads; k of its groups; v of its groups]
    linear_fc1 / gate_up_proj:        [gate rows of r; up rows of r]
    embedding / LM head:              [vocabulary rows of r that exist; zero padding]
    o_proj / down_proj (row-parallel): columns of r (dim 1)
    norms (replicated):               all of it
    Megatron expert e (EP rank owning e, ETP rank r): linear_fc1 [gate_r; up_r] of e,
                                      linear_fc2 columns of r of e's down_proj
    vLLM w13_weight [E_local, 2·Fe/t_g, h]: per local expert (a *slot*) [gate_r; up_r] of it
    vLLM w2_weight [E_local, h, Fe/t_g]:    per slot, columns of r of its down_proj

A `ShardSpec` says this for one parameter shard: its name in its owner's namespace, its
shape, the dimension the rows run along, and the ordered `Span`s that fill it. Planning
resharding is then interval arithmetic on HF row ranges (`plan.py`), independent of the
fused layouts. The row arithmetic mirrors `models.conversions` (which builds the tensors
themselves); `tests/unit/test_reshard_plan.py` checks the two agree on every layout.

"Rows" run along the parameter's TP-split dim (0 for column-parallel weights, biases,
embeddings; 1 for row-parallel weights; 0 for replicated tensors), which is the same dim in
every layout for a given HF tensor, so a row range means the same bytes on both sides.

vLLM's fused-MoE parameters stack every local expert along a leading dim (`ShardSpec.stack`
slots): there `dim` counts within one slot, and the spec's rows are numbered slot-major,
row `i` being row `i % slot_rows` of slot `i // slot_rows`. Along dim 0 of a slot that is
the plain row order of the contiguous tensor (w13), so flat copies need nothing new; along
dim 1 (w2's columns) a copy selects its slot first (`rows_view`). A span never crosses a
slot. Megatron keeps one parameter per expert (named by its global index): expert
parallelism only decides which rank holds it (`megatron_specs`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models.families import table
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.layouts import TrainingLayout

# How a parameter's rows are made of HF tensors.
COPY = "copy"  # one HF tensor, split along tp_dim (or whole when tp_dim is None)
QKV_INTERLEAVED = "qkv_interleaved"  # Megatron: [q_g, k_g, v_g] per local query group
QKV_STACKED = "qkv_stacked"  # vLLM: [q (local heads); k (local groups); v]
GATE_UP = "gate_up"  # Megatron and vLLM: [gate_r; up_r]
VOCAB = "vocab"  # embedding / LM head rows of this shard, then zero padding


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """One parameter of a layout: its name and the HF tensors its rows come from."""

    name: str  # `{layer}` = global layer index
    hf: tuple[str, ...]  # HF names (with `{layer}`), in the order the layout uses them
    layout: str  # COPY | QKV_INTERLEAVED | QKV_STACKED | GATE_UP | VOCAB
    tp_dim: int | None  # dim split across TP ranks; None = replicated
    expert: int | None = None  # the global expert of an expanded `{expert}` row
    stacked: bool = False  # one slot of a parameter stacking the experts (vLLM's fused MoE)


@dataclasses.dataclass(frozen=True)
class Span:
    """Rows `[offset, offset + length)` of a shard, taken from rows
    `[hf_start, hf_start + length)` of HF tensor `hf_name` (None: zero padding)."""

    offset: int
    length: int
    hf_name: str | None
    hf_start: int = 0


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """One parameter shard: `shape`, with `spans` filling its `rows` in order.

    stack: 0 for a plain tensor; else the number of slots (local experts) on a leading dim
        ahead of the rows' dims, `dim` counting within one slot (see the module docstring).
    """

    name: str
    shape: tuple[int, ...]
    dim: int
    spans: tuple[Span, ...]
    stack: int = 0

    @property
    def slot_rows(self) -> int:
        """Rows along `dim` in one slot (all of them for a plain tensor)."""
        return self.shape[self.dim + (1 if self.stack else 0)]

    @property
    def rows(self) -> int:
        return max(self.stack, 1) * self.slot_rows

    @property
    def row_numel(self) -> int:
        """Elements per row along `dim` (a column of `h` values for dim 1)."""
        return math.prod(self.shape) // self.rows

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def rows_view(tensor: Any, dim: int, offset: int, rows: int, slot_rows: int = 0) -> Any:
    """Rows `[offset, +rows)` along `dim` of `tensor`; with `slot_rows` (a stacked tensor)
    the rows are numbered slot-major and must lie in one slot."""
    if not slot_rows:
        return tensor.narrow(dim, offset, rows)
    slot, inner = divmod(offset, slot_rows)
    if inner + rows > slot_rows:
        raise AssertionError(f"rows [{offset}, +{rows}) cross a slot of {slot_rows} rows")
    return tensor[slot].narrow(dim, inner, rows)


# ------------------------------------------------------------------------ tables

# Every layout's parameters are the rows of the model's family table (`models/families/`):
# Megatron under the rows' dist-checkpoint names (an engine's own naming is its package's,
# e.g. `rollout/vllm/specs.py`); a row's transform says how each layout stacks its HF tensors.
_MEGATRON_LAYOUT = types.MappingProxyType(
    {table.COPY: COPY, table.QKV: QKV_INTERLEAVED, table.GATE_UP: GATE_UP, table.VOCAB: VOCAB}
)


def megatron_rules(info: HFModelInfo) -> list[ParamRule]:
    """The causal LM's Megatron parameters (dist-checkpoint names), from the family table;
    one per expert for an `{expert}` row."""
    return [
        ParamRule(
            r.megatron,
            tuple(n for n, _ in r.hf),
            _MEGATRON_LAYOUT[r.transform],
            r.tp_dim,
            expert=r.expert,
        )
        for r in hm.rules_for(info, "lm")
    ]


def hf_row_dims(info: HFModelInfo) -> dict[str, int]:
    """HF tensor name (all layers expanded) → the dim its rows run along."""
    out: dict[str, int] = {}
    for rule in megatron_rules(info):
        layers = range(info.num_layers) if "{layer}" in rule.name else [None]
        for layer in layers:
            for name in rule.hf:
                out[name.format(layer=layer)] = rule.tp_dim or 0
    return out


# ------------------------------------------------------------------------ spans


def _split(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tensor-parallel size {tp}")
    part = size // tp
    return rank * part, part


def shard_spec(
    rule: ParamRule,
    layer: int | None,
    info: HFModelInfo,
    tp: int,
    tp_rank: int,
    padded_vocab: int,
) -> ShardSpec:
    """The shard of `rule`'s parameter held by TP rank `tp_rank` of `tp`.

    Args:
        layer: global layer index for per-layer rules, None otherwise.
        padded_vocab: rows of the whole (unsplit) embedding / LM head in this layout.
    """
    h, d = info.hidden_size, info.head_dim
    nq, ng = info.num_attention_heads, info.num_key_value_heads
    names = [n.format(layer=layer) for n in rule.hf]
    spans: list[Span] = []

    def add(name: str | None, start: int, length: int) -> None:
        offset = spans[-1].offset + spans[-1].length if spans else 0
        spans.append(Span(offset, length, name, start))

    is_bias = rule.name.endswith(".bias")
    if rule.layout == COPY:
        full = hf_tensor_shape(names[0], info)
        if rule.tp_dim is None:
            add(names[0], 0, full[0])
            return ShardSpec(rule.name.format(layer=layer), full, 0, tuple(spans))
        start, part = _split(full[rule.tp_dim], tp, tp_rank, _dim_name(names[0], rule.tp_dim))
        add(names[0], start, part)
        shape = tuple(part if i == rule.tp_dim else s for i, s in enumerate(full))
        return ShardSpec(rule.name.format(layer=layer), shape, rule.tp_dim, tuple(spans))
    if rule.layout == QKV_INTERLEAVED:
        g0, local = _split(ng, tp, tp_rank, "num_key_value_heads")
        per_group = nq // ng
        for g in range(g0, g0 + local):
            add(names[0], g * per_group * d, per_group * d)
            add(names[1], g * d, d)
            add(names[2], g * d, d)
    elif rule.layout == QKV_STACKED:
        q0, q_local = _split(nq, tp, tp_rank, "num_attention_heads")
        add(names[0], q0 * d, q_local * d)
        if tp <= ng:
            k0, k_local = _split(ng, tp, tp_rank, "num_key_value_heads")
        else:
            # vLLM replicates KV heads when TP exceeds them: rank r holds head r // (tp/ng).
            if tp % ng:
                raise ValueError(f"tensor-parallel size {tp} is not a multiple of kv heads {ng}")
            k0, k_local = tp_rank // (tp // ng), 1
        add(names[1], k0 * d, k_local * d)
        add(names[2], k0 * d, k_local * d)
    elif rule.layout == GATE_UP:
        # F for a dense MLP, Fe for an expert
        ffn = hf_tensor_shape(names[0], info)[0]
        f0, f_local = _split(ffn, tp, tp_rank, "intermediate_size")
        add(names[0], f0, f_local)
        add(names[1], f0, f_local)
    elif rule.layout == VOCAB:
        r0, part = _split(padded_vocab, tp, tp_rank, "padded vocabulary")
        if padded_vocab < info.vocab_size:
            raise ValueError(f"padded vocabulary {padded_vocab} < vocab_size {info.vocab_size}")
        real = max(0, min(r0 + part, info.vocab_size) - r0)
        if real:
            add(names[0], r0, real)
        if part - real:
            add(None, 0, part - real)
    else:
        raise AssertionError(f"unknown layout {rule.layout}")
    rows = spans[-1].offset + spans[-1].length
    shape = (rows,) if is_bias else (rows, h)
    return ShardSpec(rule.name.format(layer=layer), shape, 0, tuple(spans))


_LAYER_NUMBER = re.compile(r"\.layers\.\d+\.")


def hf_tensor_shape(name: str, info: HFModelInfo) -> tuple[int, ...]:
    """Full shape of HF tensor `name` (layer number expanded), from the HF name table."""
    # Shapes do not depend on the layer: look the name up with its number as `{layer}`.
    template = _LAYER_NUMBER.sub(".layers.{layer}.", name, count=1)
    for rule in hm.rules_for(info, "lm"):
        for hf_name, shape in rule.hf:
            if hf_name == template:
                return table.hf_shape(shape, info)
    raise KeyError(name)


def _dim_name(hf_name: str, dim: int) -> str:
    return f"{hf_name.rsplit('.', 2)[-2]} dim {dim}"


# ------------------------------------------------------------------- layouts


def chunk_layers(num_layers: int, pp: int, vpp: int | None, pp_rank: int, vp_stage: int) -> range:
    """Global layers of one model chunk, as megatron-core places them (uniform split).

    Without VPP stage s holds `[s·L/p, (s+1)·L/p)`. With `vpp` chunks per stage, chunk v of
    stage s holds `L/(p·vpp)` layers starting at `v·L/vpp + s·L/(p·vpp)`
    (megatron/core/transformer/transformer_layer.py, `get_transformer_layer_offset`).
    """
    chunks = vpp or 1
    if num_layers % (pp * chunks):
        raise ValueError(f"num_layers={num_layers} is not divisible by pp·vpp={pp * chunks}")
    per_chunk = num_layers // (pp * chunks)
    start = vp_stage * (num_layers // chunks) + pp_rank * per_chunk
    return range(start, start + per_chunk)


def megatron_specs(
    info: HFModelInfo,
    layout: TrainingLayout,
    rank: int,
    padded_vocab: int,
) -> list[ShardSpec]:
    """Every parameter shard a Megatron rank holds (all its VPP chunks), in model order.

    Names are dist-checkpoint names with global layer numbers. Mirrors `GPTModel`: the
    embedding lives in the first chunk of the first stage; the final norm and the output
    layer in the last chunk of the last stage, where a tied output layer has its own
    weight only if that chunk is not also the first (pp = 1 shares one tensor).
    """
    coords = layout.coordinates(rank)
    tp_rank, pp_rank = coords["tp"], coords["pp"]
    chunks = layout.vpp or 1
    rules = megatron_rules(info)
    by_name = {rule.name: rule for rule in rules}
    # Experts: this rank's EP rank holds [e0, e0 + E/ep), each split over the expert-TP ranks.
    experts = expert_coords(layout, rank, info)
    layer_rules = [
        rule
        for rule in rules
        if "{layer}" in rule.name and (rule.expert is None or rule.expert in experts["held"])
    ]

    def spec(rule: ParamRule, layer: int | None = None) -> ShardSpec:
        if rule.expert is not None:
            return shard_spec(rule, layer, info, experts["etp"], experts["etp_rank"], padded_vocab)
        return shard_spec(rule, layer, info, layout.tp, tp_rank, padded_vocab)

    specs: list[ShardSpec] = []
    for v in range(chunks):
        first = pp_rank == 0 and v == 0
        last = pp_rank == layout.pp - 1 and v == chunks - 1
        if first:
            specs.append(spec(by_name[table.EMBEDDING.megatron]))
        for layer in chunk_layers(info.num_layers, layout.pp, layout.vpp, pp_rank, v):
            specs += [spec(rule, layer) for rule in layer_rules]
        if last:
            specs.append(spec(by_name[table.FINAL_NORM.megatron]))
            if not (first and info.tie_word_embeddings):
                specs.append(spec(by_name[table.LM_HEAD.megatron]))
    return specs


def megatron_generation_specs(
    info: HFModelInfo, tp: int, tp_rank: int, padded_vocab: int
) -> list[ShardSpec]:
    """A Megatron model's shards at TP `tp`, PP 1 (`plan.TargetSpecs`): a generation
    layout under Megatron's own names, e.g. a Megatron engine at another TP size."""
    return megatron_specs(info, TrainingLayout(tp=tp, pp=1, dp=1), tp_rank, padded_vocab)


def expert_coords(layout: TrainingLayout, rank: int, info: HFModelInfo) -> dict[str, Any]:
    """A Megatron rank's experts: the global experts it holds (`held`, those of its EP
    rank: megatron-core gives EP rank r experts [r·E/ep, (r+1)·E/ep)) and the expert-TP
    group splitting each (`etp`, `etp_rank`)."""
    if not info.num_experts:
        return {"held": range(0), "etp": 1, "etp_rank": 0}
    e = layout.expert_coordinates(rank)
    e0, local = _split(info.num_experts, layout.ep, e["ep"], "num_experts")
    return {"held": range(e0, e0 + local), "etp": layout.expert_tp, "etp_rank": e["etp"]}


def stack_slots(slots: list[ShardSpec]) -> ShardSpec:
    """One spec for a parameter stacking `slots` (equal shapes) on a new leading dim."""
    first = slots[0]
    slot_rows = first.shape[first.dim]
    spans = tuple(
        dataclasses.replace(span, offset=i * slot_rows + span.offset)
        for i, slot in enumerate(slots)
        for span in slot.spans
    )
    return ShardSpec(first.name, (len(slots), *first.shape), first.dim, spans, stack=len(slots))


# ------------------------------------------------------------------------ checks


# Read per tensor on every sync (2k+ tensors for an MoE actor with one per expert): through
# `torch.Tensor`, a `Parameter`'s size costs ~0.8 µs (the subclass's Python-level
# dispatch), through its C base less; the values are the same. A size is still the dearest
# read (~0.3 µs: it builds a `torch.Size`; a stride tuple or an address ~0.04–0.07 µs,
# development CPU), so it is read once per tensor and sync at most (`tensor_facts`).
_BASE = torch._C.TensorBase
size_of, data_ptr_of, stride_of, device_index_of = (
    _BASE.size,
    _BASE.data_ptr,
    _BASE.stride,
    _BASE.get_device,
)


def spec_shapes(specs: Sequence[ShardSpec]) -> dict[str, tuple[int, ...]]:
    """Name → shape of each spec: what `check_tensors` compares with (keep it per plan)."""
    return {s.name: s.shape for s in specs}


def check_tensors(
    specs: Sequence[ShardSpec] | Mapping[str, tuple[int, ...]],
    tensors: Mapping[str, Any],
    what: str,
) -> list[str]:
    """Problems (one line each) if `tensors` (name → tensor or shape) do not match `specs`
    (shard specs, or their `spec_shapes`)."""
    want = specs if isinstance(specs, Mapping) else spec_shapes(specs)
    # Run on every sync over every parameter (2k for an MoE actor with one tensor per
    # expert): the common case, all present and all equal, is a few C-level passes.
    if tensors.keys() == want.keys():
        try:
            have = list(map(size_of, tensors.values()))
        except TypeError:  # shapes given, not tensors
            have = list(tensors.values())
        if have == list(map(want.__getitem__, tensors)):  # torch.Size equals its tuple
            return []
    problems = []
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"{what} lacks parameter '{name}' (plan shape {list(shape)})")
            continue
        have = tuple(getattr(tensors[name], "shape", tensors[name]))
        if have != tuple(shape):
            problems.append(f"{what} '{name}' has shape {list(have)}, the plan {list(shape)}")
    problems += [
        f"{what} parameter '{name}' is not in the plan" for name in tensors if name not in want
    ]
    return problems
