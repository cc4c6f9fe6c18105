"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a mixture of experts in place
of every layer's MLP (top-2 of 8 in the released models), under HF's `block_sparse_moe`.

HF names the expert MLP's weights `w1` (gate), `w3` (up) and `w2` (down); the router is
`block_sparse_moe.gate`. Megatron's side is the same `MoELayer` as Qwen3-MoE's
(`qwen3_moe.py`); its router renormalises the top-k probabilities as Mixtral does.
"""

from __future__ import annotations

from rl_megatron.models.families import llama
from rl_megatron.models.families.llama import H, M
from rl_megatron.models.families.table import COPY, GATE_UP, Family, Rule

X_M = M + "mlp.experts.experts.{expert}."
X_H = H + "block_sparse_moe.experts.{expert}."
# vLLM's fused-MoE parameters (`RoutedExperts`, vLLM 0.32), every local expert stacked.
X_V = H + "block_sparse_moe.experts.routed_experts."

# fmt: off
LAYERS: tuple[Rule, ...] = (
    *(r for r in llama.LAYERS if ".mlp." not in r.megatron),
    Rule(M + "pre_mlp_layernorm.weight",
         ((H + "post_attention_layernorm.weight", ("h",)),), COPY, None),
    Rule(M + "mlp.router.weight",
         ((H + "block_sparse_moe.gate.weight", ("E", "h")),), COPY, None),
    Rule(X_M + "linear_fc1.weight",
         ((X_H + "w1.weight", ("Fe", "h")),
          (X_H + "w3.weight", ("Fe", "h"))), GATE_UP, 0,
         vllm=X_V + "w13_weight"),
    Rule(X_M + "linear_fc2.weight", ((X_H + "w2.weight", ("h", "Fe")),), COPY, 1,
         vllm=X_V + "w2_weight"),
)
# fmt: on

FAMILY = Family(
    model_type="mixtral", architecture="Mixtral", layers=LAYERS, sliding_window=True, moe=True
)
