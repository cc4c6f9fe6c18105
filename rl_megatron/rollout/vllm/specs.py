"""vLLM's parameter layout, for the weight sync: which rows of which HF tensors each of its
parameters holds on each rank of a `tp`-way engine (`vllm_specs`, the target side of a
resharding plan), and its padded vocabulary.

vLLM names a parameter as the family table's `vllm_name` says, stacks q/k/v (not
interleaved as Megatron does) and fuses gate/up as Megatron does; without expert
parallelism it holds every expert on every rank, stacked in one parameter per layer where
its name has no `{expert}`.
"""

from __future__ import annotations

import types

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models.families import family, table
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding import shards

# vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to a multiple of
# this before splitting it (vllm/model_executor/layers/vocab_parallel_embedding.py,
# DEFAULT_VOCAB_PADDING_SIZE).
VLLM_VOCAB_PADDING = 64


_VLLM_LAYOUT = types.MappingProxyType(
    {
        table.COPY: shards.COPY,
        table.QKV: shards.QKV_STACKED,
        table.GATE_UP: shards.GATE_UP,
        table.VOCAB: shards.VOCAB,
    }
)


def vllm_rules(info: HFModelInfo) -> list[shards.ParamRule]:
    """vLLM's parameters for `info`, from the family table, in its module order (a bias
    right after its weight, so a layer is complete as soon as possible); a tied LM head is
    the embedding (its row is not exported)."""
    rows = [r for r in hm.rules_for(info, "lm") if r.export]
    names = {r.vllm_name for r in rows}
    # An `{expert}` row whose vLLM name has no `{expert}` fills one stacked parameter.
    stacked = {
        r.vllm_name
        for r in family(info.model_type).layers
        if r.per_expert and "{expert}" not in r.vllm_name
    }
    ordered = []
    for row in rows:
        weight = row.vllm_name.removesuffix("bias") + "weight"
        if row.vllm_name.endswith(".bias") and weight in names:
            continue  # placed right after its weight
        ordered.append(row)
        ordered += [r for r in rows if r.vllm_name == row.vllm_name.removesuffix("weight") + "bias"]
    return [
        shards.ParamRule(
            r.vllm_name,
            tuple(n for n, _ in r.hf),
            _VLLM_LAYOUT[r.transform],
            r.tp_dim,
            expert=r.expert,
            stacked=r.vllm_name in stacked,
        )
        for r in ordered
    ]


def vllm_specs(
    info: HFModelInfo, tp: int, tp_rank: int, padded_vocab: int
) -> list[shards.ShardSpec]:
    """Every parameter shard of vLLM's model on one rank of a `tp`-way engine, model order.

    vLLM without expert parallelism (the only mode supported here) holds every expert on
    every rank, each split over its TP ranks like a dense MLP (vllm/model_executor/layers/
    fused_moe/routed_experts.py, `_load_w13` / `_load_w2`); slot e is global expert e.
    """
    specs = []
    stacks: dict[str, list[shards.ShardSpec]] = {}  # stacked parameter → its slots so far
    for rule in vllm_rules(info):
        layers = range(info.num_layers) if "{layer}" in rule.name else [None]
        for layer in layers:
            one = shards.shard_spec(rule, layer, info, tp, tp_rank, padded_vocab)
            if not rule.stacked:
                specs.append(one)
                continue
            slots = stacks.setdefault(one.name, [])
            if rule.expert != len(slots):
                raise AssertionError(f"{one.name}: expert {rule.expert} out of order")
            slots.append(one)
    specs += [shards.stack_slots(slots) for slots in stacks.values()]
    # vLLM's module order: embedding, layers, norm, head.
    return sorted(specs, key=_model_order)


def _model_order(spec: shards.ShardSpec) -> tuple[int, int]:
    parts = spec.name.split(".")
    if "layers" in parts:
        return 1, int(parts[parts.index("layers") + 1])
    if "embed" in spec.name:
        return 0, 0
    return 2, 0


def vllm_padded_vocab(vocab_size: int, tp: int) -> int:
    """vLLM's padded vocabulary (the whole table; each of `tp` ranks holds 1/tp of it)."""
    padded = -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % tp:
        raise ValueError(f"vLLM's padded vocabulary {padded} is not divisible by tp={tp}")
    return padded
