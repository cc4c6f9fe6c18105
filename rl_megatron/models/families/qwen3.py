"""Qwen3 dense (`Qwen3ForCausalLM`): Llama's tensors plus QK-norm, without QKV bias.

QK-norm is an RMSNorm over each head's query and key (one `[head_dim]` weight each, shared
by every head), applied after the projection and before RoPE. megatron-core builds it as
`q_layernorm` / `k_layernorm` of `SelfAttention` when `TransformerConfig.qk_layernorm` is
set (`models/specs.py`); the weights are replicated on every TP rank, and megatron-core's
`finalize_model_grads` sums their gradients over TP (each rank sees only its heads). The
small sizes (0.6B–4B) tie the embeddings; `head_dim` is 128 whatever hidden / heads is.
"""

from __future__ import annotations

from rl_megatron.models.families.llama import LAYERS as LLAMA_LAYERS
from rl_megatron.models.families.llama import H, M
from rl_megatron.models.families.table import COPY, Family, Rule

# fmt: off
LAYERS: tuple[Rule, ...] = (
    *LLAMA_LAYERS,
    Rule(M + "self_attention.q_layernorm.weight",
         ((H + "self_attn.q_norm.weight", ("d",)),), COPY, None),
    Rule(M + "self_attention.k_layernorm.weight",
         ((H + "self_attn.k_norm.weight", ("d",)),), COPY, None),
)
# fmt: on

FAMILY = Family(model_type="qwen3", architecture="Qwen3", layers=LAYERS, qk_norm=True)
