"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama's tensors plus a bias on q, k and v."""

from __future__ import annotations

from rl_megatron.models.families.llama import LAYERS as LLAMA_LAYERS
from rl_megatron.models.families.llama import H, M
from rl_megatron.models.families.table import QKV, Family, Rule

# fmt: off
LAYERS: tuple[Rule, ...] = (
    *LLAMA_LAYERS,
    Rule(M + "self_attention.linear_qkv.bias",
         ((H + "self_attn.q_proj.bias", ("Q",)),
          (H + "self_attn.k_proj.bias", ("K",)),
          (H + "self_attn.v_proj.bias", ("K",))), QKV, 0,
         vllm=H + "self_attn.qkv_proj.bias"),
)
# fmt: on

FAMILY = Family(model_type="qwen2", architecture="Qwen2", layers=LAYERS, qkv_bias=True)
