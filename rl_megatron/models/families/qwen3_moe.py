"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (QK-norm) with a mixture of experts
in place of every layer's MLP.

The MoE block is megatron-core's `MoELayer` (`models/specs.py`): a router (`mlp.router`,
HF's `mlp.gate`, `[E, h]`, replicated) picking `num_experts_per_tok` of `num_experts` experts
per token, and one SwiGLU MLP per expert (`mlp.experts.{e}`: gate/up fused into `linear_fc1`,
`down_proj` as `linear_fc2`, `moe_intermediate_size` wide), no shared experts. The pre-MLP
norm is its own module there (no fused `linear_fc1` to carry it): `pre_mlp_layernorm`.
Configs mixing dense layers in (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused
by `models/hf_config.py`.
"""

from __future__ import annotations

from rl_megatron.models.families.llama import H, M
from rl_megatron.models.families.qwen3 import LAYERS as QWEN3_LAYERS
from rl_megatron.models.families.table import COPY, GATE_UP, Family, Rule

X_M = M + "mlp.experts.experts.{expert}."  # Megatron: one expert (global index)
X_H = H + "mlp.experts.{expert}."  # Hugging Face
# vLLM's fused-MoE parameters (`RoutedExperts`, vLLM 0.32), every local expert stacked.
X_V = H + "mlp.experts.routed_experts."

# fmt: off
# The pre-MLP norm and the router, ahead of the experts (megatron-core's module order).
ROUTER_LAYERS: tuple[Rule, ...] = (
    Rule(M + "pre_mlp_layernorm.weight",
         ((H + "post_attention_layernorm.weight", ("h",)),), COPY, None),
    Rule(M + "mlp.router.weight", ((H + "mlp.gate.weight", ("E", "h")),), COPY, None),
)
EXPERT_LAYERS: tuple[Rule, ...] = (
    Rule(X_M + "linear_fc1.weight",
         ((X_H + "gate_proj.weight", ("Fe", "h")),
          (X_H + "up_proj.weight", ("Fe", "h"))), GATE_UP, 0,
         vllm=X_V + "w13_weight"),
    Rule(X_M + "linear_fc2.weight", ((X_H + "down_proj.weight", ("h", "Fe")),), COPY, 1,
         vllm=X_V + "w2_weight"),
)
# fmt: on

# Qwen3's rows up to the dense MLP (norms, QKV, projection), then QK-norm, then the MoE.
_ATTENTION = tuple(r for r in QWEN3_LAYERS if ".mlp." not in r.megatron)
LAYERS: tuple[Rule, ...] = (*_ATTENTION, *ROUTER_LAYERS, *EXPERT_LAYERS)

FAMILY = Family(
    model_type="qwen3_moe", architecture="Qwen3Moe", layers=LAYERS, qk_norm=True, moe=True
)
