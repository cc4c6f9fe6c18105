"""The format of a model family's name table: one row per Megatron parameter.

A row (`Rule`) says, for one parameter of the Megatron model:

    megatron   its dist-checkpoint name; `{layer}` stands for the global layer index and
               `{expert}` for the global expert index (MoE, below)
    hf         the Hugging Face tensors it is made of, in order, each with a symbolic shape
    transform  which named transform (`models/conversions.py`) turns them into it:
                 COPY     one HF tensor, split along `tp_dim` (or whole when replicated)
                 QKV      q, k, v → Megatron's per-group interleaved `linear_qkv`
                          (vLLM's `qkv_proj` stacks the same rows `[q; k; v]` per shard)
                 GATE_UP  gate, up → `[gate_r; up_r]` per TP shard (Megatron and vLLM)
                 VOCAB    embedding / LM head rows, zero-padded to the layout's vocabulary
    tp_dim     the dim megatron-core splits across TP ranks — the parameter's
               `partition_dim` (tests/multirank/test_name_tables.py checks it on the built
               model); None: replicated on every TP rank. vLLM splits the same dim. An
               `{expert}` row is split across the expert-TP ranks (`parallel.etp`) instead.
    vllm       the vLLM parameter it fills ("" = the row's one HF name); for an `{expert}`
               row without `{expert}`, the fused-MoE parameter stacking the experts
    export     False: another row writes the HF tensor (a tied head)

A `Family` is a model type's rows — embedding, the per-layer rows, final norm, LM head — and
the flags its HF config needs. The HF loader and exporter, the checkpoint tools, the
Megatron engine's weight update and the resharding shard specs all read these rows
(`checkpoint/hf_mapping.py` applies them); nothing else names a parameter.

A per-layer tensor is one more row of `Family.layers`: Qwen3's QK-norm (`qwen3.py`) is
`Rule(M + "self_attention.q_layernorm.weight", ((H + "self_attn.q_norm.weight", ("d",)),),
COPY, None)` with `d` the head dim, and its key twin, with the flag `qk_norm`.

Mixture-of-experts layers (`qwen3_moe.py`, `mixtral.py`) add a second placeholder, `{expert}`
(the global expert index), and the symbols `E` (experts) and `Fe` (one expert's FFN size):

* a row whose every name holds `{expert}` is one row per expert. `rules_for` expands it into
  `E` rows (one per global expert, the number in place of `{expert}`), so everything
  downstream reads plain rows. Its Megatron name is
  `decoder.layers.{layer}.mlp.experts.experts.{expert}.linear_fc1.weight`: without `{layer}.`
  and `{expert}.` it is megatron-core's dist-checkpoint key (`MoELayer.experts`, whose
  `SequentialMLP` / `TEGroupedMLP` adds its own `experts.`, stores every layer's experts as
  one tensor `[layers, E, ...]`, the global expert index on the second axis); the module
  holding expert e on expert-parallel rank r is `mlp.experts.local_experts.{e - r·E/ep}`
  (TE's grouped GEMM: `mlp.experts.linear_fc1.weight{e - r·E/ep}`), which
  `checkpoint/hf_mapping.canonical_param_name` maps to the row.
* an `{expert}` row whose vLLM name lacks `{expert}` names vLLM's fused-MoE parameter, which
  stacks every (local) expert along a new leading dim: `w13_weight [E_local, 2·Fe/t_g, h]`
  (each expert's `[gate_r; up_r]`), `w2_weight [E_local, h, Fe/t_g]`. Only the resharding
  shard specs read it (`resharding/shards.py`); the HF converters never stack.
* a row whose HF names hold `{expert}` while its Megatron name does not (Megatron's legacy
  grouped-GEMM weights, stacked) is not converted: `Family` refuses it (one line).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_megatron.models.hf_config import HFModelInfo

COPY, QKV, GATE_UP, VOCAB = "copy", "qkv", "gate_up", "vocab"
# megatron-core's QK-norm modules (`SelfAttention.q_layernorm` / `k_layernorm`).
_QK_NORMS = frozenset({"q_layernorm", "k_layernorm"})
# How many HF tensors each transform consumes.
_ARITY = {COPY: 1, QKV: 3, GATE_UP: 2, VOCAB: 1}

# Symbolic HF dims: h hidden, Q = heads*head_dim, K = kv_heads*head_dim, F ffn, V true
# vocab, L classifier labels, d head_dim, E experts, Fe one expert's ffn.
Shape = tuple[str, ...]
SYMBOLS = frozenset({"h", "Q", "K", "F", "V", "L", "d", "E", "Fe"})
_PLACEHOLDER = re.compile(r"\{(\w*)\}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a family's table (see the module docstring for the columns)."""

    megatron: str  # dist-checkpoint name; `{layer}` / `{expert}`: global layer / expert index
    hf: tuple[tuple[str, Shape], ...]  # (HF name with `{layer}`, symbolic shape) in order
    transform: str  # COPY | QKV | GATE_UP | VOCAB
    tp_dim: int | None  # Megatron's partition_dim; None = replicated on every TP rank
    vllm: str = ""  # vLLM's parameter name; "" = the one HF name
    export: bool = True  # False: the HF tensor is written by another rule (tied head)
    expert: int | None = None  # set by `for_expert`: the global expert of an expanded row

    @property
    def vllm_name(self) -> str:
        return self.vllm or self.hf[0][0]

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def per_expert(self) -> bool:
        """One row per expert, not yet expanded (`{expert}` still in its names)."""
        return "{expert}" in self.megatron

    def for_expert(self, expert: int) -> Rule:
        """This `{expert}` row for global expert `expert` (the number in every name)."""

        def sub(name: str) -> str:
            return name.replace("{expert}", str(expert))

        return dataclasses.replace(
            self,
            megatron=sub(self.megatron),
            hf=tuple((sub(name), shape) for name, shape in self.hf),
            vllm=sub(self.vllm),
            expert=expert,
        )


class TableError(ValueError):
    """A malformed family table (a bug in the table, caught at import); one line."""


def _check_rule(family: str, rule: Rule) -> None:
    def fail(why: str) -> None:
        raise TableError(f"family '{family}', rule '{rule.megatron}': {why}")

    names = [rule.megatron, rule.vllm_name, *(name for name, _ in rule.hf)]
    placeholders = {p for name in names for p in _PLACEHOLDER.findall(name)}
    # vLLM's name may drop `{expert}`: its fused-MoE parameter stacks the experts.
    per_expert = [rule.megatron, *(name for name, _ in rule.hf)]
    if "expert" in placeholders and not all("{expert}" in name for name in per_expert):
        fail("`{expert}` rows stacking every expert (fused expert tensors) are not converted yet")
    if placeholders - {"layer", "expert"}:
        fail(f"unknown placeholder(s) {sorted(placeholders - {'layer', 'expert'})}")
    if any(("{layer}" in name) != rule.per_layer for name in names):
        fail("`{layer}` must appear in every name of the row or in none")
    if rule.per_expert and not rule.per_layer:
        fail("an `{expert}` row is a layer's row: it needs `{layer}` too")
    if rule.transform not in _ARITY:
        fail(f"unknown transform '{rule.transform}'")
    if len(rule.hf) != _ARITY[rule.transform]:
        fail(f"{rule.transform} takes {_ARITY[rule.transform]} HF tensor(s), got {len(rule.hf)}")
    if len(rule.hf) > 1 and not rule.vllm:
        fail("a row of several HF tensors needs its vLLM name")
    for name, shape in rule.hf:
        if set(shape) - SYMBOLS:
            fail(f"'{name}' has unknown shape symbols {sorted(set(shape) - SYMBOLS)}")
        if rule.tp_dim is not None and rule.tp_dim >= len(shape):
            fail(f"tp_dim {rule.tp_dim} is not a dim of '{name}' {list(shape)}")


# fmt: off
# The rows every family so far shares outside its layers.
EMBEDDING = Rule("embedding.word_embeddings.weight",
                 (("model.embed_tokens.weight", ("V", "h")),), VOCAB, 0)
FINAL_NORM = Rule("decoder.final_layernorm.weight", (("model.norm.weight", ("h",)),), COPY, None)
LM_HEAD = Rule("output_layer.weight", (("lm_head.weight", ("V", "h")),), VOCAB, 0)
# With tied embeddings HF stores only the embedding; a last pipeline stage that is not also
# the first keeps its own copy of it as `output_layer.weight`.
TIED_LM_HEAD = Rule("output_layer.weight",
                    (("model.embed_tokens.weight", ("V", "h")),), VOCAB, 0, export=False)
# Critic / reward model: *ForSequenceClassification's `score` ([num_labels, h], no bias),
# replicated on every TP rank (`models/builders.ValueHead`).
VALUE_HEAD = Rule("output_layer.weight", (("score.weight", ("L", "h")),), COPY, None)
# fmt: on


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's table: its rows in Megatron's module order, and its flags."""

    model_type: str  # config.json's `model_type`
    architecture: str  # HF class prefix, as in `<architecture>ForCausalLM`
    layers: tuple[Rule, ...]  # the rows of one decoder layer (names hold `{layer}`)
    qkv_bias: bool = False  # q/k/v projections carry a bias (needs a `linear_qkv.bias` row)
    sliding_window: bool = False  # config.json's `sliding_window` is honoured (Mistral)
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE (Qwen3; two rows)
    moe: bool = False  # every layer's MLP is a mixture of experts (`{expert}` rows + a router)
    embedding: Rule = EMBEDDING
    final_norm: Rule = FINAL_NORM
    lm_head: Rule = LM_HEAD  # untied; a tied head is TIED_LM_HEAD, a value head VALUE_HEAD

    def __post_init__(self) -> None:
        for rule in self.rules:
            _check_rule(self.model_type, rule)
        for rule in self.layers:
            if not rule.per_layer:
                raise TableError(
                    f"family '{self.model_type}': layer row '{rule.megatron}' lacks `{{layer}}`"
                )
        has_bias = any(r.megatron.endswith("linear_qkv.bias") for r in self.layers)
        if has_bias != self.qkv_bias:
            raise TableError(
                f"family '{self.model_type}': qkv_bias={self.qkv_bias} but the table "
                f"{'has' if has_bias else 'lacks'} a linear_qkv.bias row"
            )
        norms = {r.megatron.rsplit(".", 2)[-2] for r in self.layers} & _QK_NORMS
        if norms != (_QK_NORMS if self.qk_norm else set()):
            raise TableError(
                f"family '{self.model_type}': qk_norm={self.qk_norm} but the table has "
                f"{sorted(norms) or 'no'} q/k layernorm rows"
            )

        has_experts = any(r.per_expert for r in self.layers)
        if has_experts != self.moe:
            raise TableError(
                f"family '{self.model_type}': moe={self.moe} but the table "
                f"{'has' if has_experts else 'lacks'} `{{expert}}` rows"
            )

    @property
    def rules(self) -> tuple[Rule, ...]:
        """Every row of the causal LM with an untied head, in Megatron's module order."""
        return (self.embedding, *self.layers, self.final_norm, self.lm_head)


def hf_dims(info: HFModelInfo) -> dict[str, int]:
    """Values of the symbolic dims used in the tables' HF shapes."""
    return {
        "h": info.hidden_size,
        "Q": info.num_attention_heads * info.head_dim,
        "K": info.num_key_value_heads * info.head_dim,
        "F": info.ffn_hidden_size,
        "V": info.vocab_size,
        "L": 1,  # scalar value head
        "d": info.head_dim,
        "E": info.num_experts,
        "Fe": info.moe_ffn_hidden_size,
    }


def hf_shape(shape: Shape, info: HFModelInfo) -> tuple[int, ...]:
    """A symbolic HF shape, e.g. ("Q", "h"), in numbers for this model."""
    dims = hf_dims(info)
    return tuple(dims[d] for d in shape)
