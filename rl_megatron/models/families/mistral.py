"""Mistral (`MistralForCausalLM`): Llama's tensors, plus an optional sliding window."""

from __future__ import annotations

from rl_megatron.models.families import llama
from rl_megatron.models.families.table import Family

FAMILY = Family(
    model_type="mistral", architecture="Mistral", layers=llama.LAYERS, sliding_window=True
)
