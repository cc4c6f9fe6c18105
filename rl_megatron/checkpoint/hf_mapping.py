"""HF ⇄ Megatron conversion of whole models, driven by the family name tables.

The rows themselves — for each Megatron parameter, its HF tensors, transform and TP shard
dim — are the family tables of `models/families/` (one module per family, `table.py` the
format); the layout arithmetic is the named transforms of `models/conversions.py`. This
module picks a model's rows (`rules_for`), asserts a checkpoint holds exactly the tensors
they consume, and builds one Megatron TP shard from HF tensors or HF tensors from TP
shards. The loader (`hf_loader`), the exporter (`hf_export`), the checkpoint tools, the
Megatron engine's weight update and the resharding shard specs all go through it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container

import torch

from rl_megatron.models import conversions as cv
from rl_megatron.models.families import family
from rl_megatron.models.families.table import (
    COPY,
    GATE_UP,
    QKV,
    TIED_LM_HEAD,
    VALUE_HEAD,
    VOCAB,
    Rule,
    hf_shape,
)
from rl_megatron.models.hf_config import HFModelInfo

# HF tensors some checkpoints carry that the model does not need.
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


class MappingError(ValueError):
    """A checkpoint that does not match the table; the message is one line."""


def rules_for(info: HFModelInfo, head: str = "lm") -> list[Rule]:
    """The rules of one model: decoder layers, embedding, final norm and the head.

    A table's `{expert}` rows come out expanded, one row per global expert (`Rule.expert`).

    Args:
        head: "lm" (causal LM head), "value" (scalar head from `score.weight`) or "none"
            (no head rule: a critic whose value head starts fresh).
    """
    table = family(info.model_type)
    layers = [
        expanded
        for rule in table.layers
        for expanded in (
            [rule.for_expert(e) for e in range(info.num_experts)] if rule.per_expert else [rule]
        )
    ]
    rules = [table.embedding, *layers, table.final_norm]
    if head == "lm":
        rules.append(TIED_LM_HEAD if info.tie_word_embeddings else table.lm_head)
    elif head == "value":
        rules.append(VALUE_HEAD)
    elif head != "none":
        raise ValueError(f"head must be 'lm', 'value' or 'none', got '{head}'")
    return rules


def expected_hf_tensors(rules: list[Rule], info: HFModelInfo) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the rules consume, all layers expanded, with its shape."""
    out: dict[str, tuple[int, ...]] = {}
    for rule in rules:
        for layer in range(info.num_layers) if rule.per_layer else [None]:
            for name, shape in rule.hf:
                out[name.format(layer=layer)] = hf_shape(shape, info)
    return out


def check_hf_tensors(
    available: dict[str, tuple[int, ...]],
    rules: list[Rule],
    info: HFModelInfo,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Assert the checkpoint holds exactly the tensors the rules consume, with their shapes.

    Args:
        available: HF tensor name → shape, as stored in the checkpoint.
        ignore: names the caller deliberately leaves unused (e.g. `lm_head.weight` for a
            critic whose head starts fresh).
    """
    expected = expected_hf_tensors(rules, info)
    for name, shape in expected.items():
        if name not in available:
            raise MappingError(f"checkpoint lacks tensor '{name}' (expected shape {list(shape)})")
        if tuple(available[name]) != shape:
            raise MappingError(
                f"tensor '{name}' has shape {list(available[name])}, config.json implies "
                f"{list(shape)}"
            )
    for name in available:
        if name in expected or IGNORED_HF.match(name) or ignore(name):
            continue
        if info.tie_word_embeddings and name == "lm_head.weight":
            continue  # some tied checkpoints store the head as well; it equals the embedding
        raise MappingError(
            f"checkpoint tensor '{name}' has no place in the {info.model_type} model"
        )


# ------------------------------------------------------------------- name helpers

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# The local spec names the norms as separate modules; dist_checkpointing stores them under
# the TE spec's fused names (megatron-core's sharded_state_dict_keys_map) where the fused
# linear exists: an MoE layer's pre-MLP norm keeps its own name (`models/specs.py`).
_LOCAL_TO_CANONICAL = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
# One expert's weights: `SequentialMLP`'s `local_experts.<i>.linear_fc1.weight` (the local
# spec) or `TEGroupedMLP`'s `linear_fc1.weight<i>` (TE, grouped GEMM); i is the local index.
_EXPERT_RES = (
    re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.\w+)$"),
    re.compile(r"^mlp\.experts\.(linear_fc[12]\.[a-z_]+?)(\d+)$"),
)
_STORED_EXPERT = re.compile(r"\.experts\.\d+\.")


def canonical_param_name(
    name: str,
    global_layer: Callable[[int], int],
    global_expert: Callable[[int], int] | None = None,
    known: Container[str] | None = None,
) -> tuple[str, int | None]:
    """Module parameter name → (rule name with `{layer}`, global layer index or None).

    Args:
        name: as in `GPTModel.named_parameters()`, e.g. `decoder.layers.0.input_layernorm.weight`.
        global_layer: local layer index in this model chunk → global layer index.
        global_expert: local expert index on this expert-parallel rank → global expert
            index (`global_expert_fn`); an expert's rule name carries the global index.
        known: the rule names of the model; a local-spec norm is renamed to its fused
            name only where the model has that name (dense MLPs, not MoE layers).
    """
    m = _LAYER_RE.match(name)
    if not m:
        return name, None
    rest = m.group(2)
    for local, canonical in _LOCAL_TO_CANONICAL:
        if rest.startswith(local):
            renamed = canonical + rest[len(local) :]
            if known is None or "decoder.layers.{layer}." + renamed in known:
                rest = renamed
    if global_expert is not None:
        for i, pattern in enumerate(_EXPERT_RES):
            x = pattern.match(rest)
            if x:
                local, tail = (x.group(1), x.group(2)) if i == 0 else (x.group(2), x.group(1))
                rest = f"mlp.experts.experts.{global_expert(int(local))}.{tail}"
                break
    return "decoder.layers.{layer}." + rest, global_layer(int(m.group(1)))


def stored_layer_key(rule: Rule) -> str:
    """The dist-checkpoint key of a per-layer row when megatron-core stacks its layers (and,
    for an expert's row, the experts: `[layers, E, ...]`), e.g. `decoder.layers.mlp.router.weight`."""
    return _STORED_EXPERT.sub(".experts.", rule.megatron).replace("{layer}.", "")


def shard_coords(rule: Rule, tp: tuple[int, int], etp: tuple[int, int]) -> tuple[int, int]:
    """(size, rank) of the group that splits `rule` along `tp_dim`: an expert's rows split
    over the expert-TP ranks (`parallel.etp`), every other row over the TP ranks."""
    return etp if rule.expert is not None else tp


# ------------------------------------------------------------------- transforms

Reader = Callable[[str, int | None, int, int], torch.Tensor]
"""read(hf_name, dim, start, end): the HF tensor, sliced to [start, end) along dim (all
of it when dim is None). Lets the loader read only a rank's slice from disk."""


def hf_to_megatron_shard(
    rule: Rule,
    layer: int | None,
    read: Reader,
    info: HFModelInfo,
    tp: int,
    tp_rank: int,
    padded_vocab: int,
) -> torch.Tensor:
    """Build one Megatron TP shard of `rule.megatron` from HF tensors, reading only its slice.

    `tp`, `tp_rank`: the group that splits the row (`shard_coords`: expert-TP for an expert).
    """
    names = [n.format(layer=layer) for n, _ in rule.hf]
    if rule.transform == COPY:
        if rule.tp_dim is None:
            return read(names[0], None, 0, 0)
        size = hf_shape(rule.hf[0][1], info)[rule.tp_dim]
        return read(names[0], rule.tp_dim, *cv.shard_range(size, tp, tp_rank))
    if rule.transform == QKV:
        d = info.head_dim
        q0, q1 = cv.shard_range(info.num_attention_heads, tp, tp_rank)
        k0, k1 = cv.shard_range(info.num_key_value_heads, tp, tp_rank)
        q = read(names[0], 0, q0 * d, q1 * d)
        k = read(names[1], 0, k0 * d, k1 * d)
        v = read(names[2], 0, k0 * d, k1 * d)
        return cv.interleave_qkv(q, k, v, k1 - k0)
    if rule.transform == GATE_UP:
        # F for a dense MLP, Fe for an expert
        f0, f1 = cv.shard_range(hf_shape(rule.hf[0][1], info)[0], tp, tp_rank)
        return cv.fuse_gate_up(read(names[0], 0, f0, f1), read(names[1], 0, f0, f1))
    if rule.transform == VOCAB:
        r0, r1 = cv.shard_range(padded_vocab, tp, tp_rank)
        real_end = min(r1, info.vocab_size)
        rows = read(names[0], 0, r0, real_end) if real_end > r0 else None
        if rows is None:  # this rank holds padding only
            return torch.zeros(r1 - r0, info.hidden_size)
        return cv.pad_vocab(rows, r1 - r0)
    raise AssertionError(f"unknown transform {rule.transform}")


def megatron_to_hf(
    rule: Rule, layer: int | None, shards: list[torch.Tensor], info: HFModelInfo
) -> list[tuple[str, torch.Tensor]]:
    """Turn the TP shards (rank order; expert-TP for an expert) of one Megatron parameter into
    HF `(name, tensor)`s."""
    names = [n.format(layer=layer) for n, _ in rule.hf]
    if rule.transform == COPY:
        full = shards[0] if rule.tp_dim is None else cv.tp_merge(shards, rule.tp_dim)
        return [(names[0], full)]
    if rule.transform == QKV:
        # Each shard holds whole query groups, so concatenation gives the TP=1 tensor.
        q, k, v = cv.deinterleave_qkv(
            cv.tp_merge(shards, 0), info.num_attention_heads, info.num_key_value_heads
        )
        return list(zip(names, (q, k, v)))
    if rule.transform == GATE_UP:
        return list(zip(names, cv.split_gate_up(cv.merge_gated_shards(shards))))
    if rule.transform == VOCAB:
        return [(names[0], cv.unpad_vocab(cv.tp_merge(shards, 0), info.vocab_size))]
    raise AssertionError(f"unknown transform {rule.transform}")
