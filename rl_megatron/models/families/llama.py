"""Llama 2 / 3 / 3.x (`LlamaForCausalLM`): the dense decoder the other families start from."""

from __future__ import annotations

from rl_megatron.models.families.table import COPY, GATE_UP, QKV, Family, Rule

M = "decoder.layers.{layer}."  # Megatron (dist-checkpoint names)
H = "model.layers.{layer}."  # Hugging Face

# fmt: off
LAYERS: tuple[Rule, ...] = (
    Rule(M + "self_attention.linear_qkv.layer_norm_weight",
         ((H + "input_layernorm.weight", ("h",)),), COPY, None),
    Rule(M + "self_attention.linear_qkv.weight",
         ((H + "self_attn.q_proj.weight", ("Q", "h")),
          (H + "self_attn.k_proj.weight", ("K", "h")),
          (H + "self_attn.v_proj.weight", ("K", "h"))), QKV, 0,
         vllm=H + "self_attn.qkv_proj.weight"),
    Rule(M + "self_attention.linear_proj.weight",
         ((H + "self_attn.o_proj.weight", ("h", "Q")),), COPY, 1),
    Rule(M + "mlp.linear_fc1.layer_norm_weight",
         ((H + "post_attention_layernorm.weight", ("h",)),), COPY, None),
    Rule(M + "mlp.linear_fc1.weight",
         ((H + "mlp.gate_proj.weight", ("F", "h")),
          (H + "mlp.up_proj.weight", ("F", "h"))), GATE_UP, 0,
         vllm=H + "mlp.gate_up_proj.weight"),
    Rule(M + "mlp.linear_fc2.weight", ((H + "mlp.down_proj.weight", ("h", "F")),), COPY, 1),
)
# fmt: on

FAMILY = Family(model_type="llama", architecture="Llama", layers=LAYERS)
