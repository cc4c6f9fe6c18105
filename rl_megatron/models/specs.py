"""Layer spec choice: Transformer Engine when it imports, else the local spec with SDPA.

This is the one place Transformer Engine is imported for the model code (CONVENTIONS.md,
habit 10). Both specs checkpoint under the same `dist_checkpointing` keys (megatron-core
maps the local spec's `input_layernorm` / `pre_mlp_layernorm` onto TE's fused names), so a
checkpoint written with one loads with the other.
"""

from __future__ import annotations

import functools

from megatron.core.transformer.spec_utils import ModuleSpec


@functools.cache
def have_transformer_engine() -> bool:
    """Whether `transformer_engine` imports (cached; the import is slow when it fails)."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def gpt_layer_spec(use_te: bool | None = None) -> ModuleSpec:
    """Transformer-layer spec for the Llama-family `GPTModel` (RMSNorm, SwiGLU, RoPE, GQA).

    Args:
        use_te: force (True) or forbid (False) Transformer Engine; None picks TE when it
            imports. Asking for TE when it is missing raises a one-line error.
    """
    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        if not have_transformer_engine():
            raise RuntimeError(
                "Transformer Engine was requested but `transformer_engine` "
                "does not import; install it or use the local spec"
            )
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec()
    return local_sdpa_layer_spec()


def local_sdpa_layer_spec() -> ModuleSpec:
    """megatron-core's local layer spec with `SDPAttention` as the core attention, in a
    `SelfAttention` whose inference KV cache holds keys rotated once (`RopeOnceSelfAttention`:
    the same parameters and checkpoint keys, a faster Megatron-engine decode)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rl_megatron.models.rope_once_attention import RopeOnceSelfAttention
    from rl_megatron.models.sdpa_attention import SDPAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # The getter builds a fresh spec on every call, so editing it in place is safe.
    spec.submodules.self_attention.module = RopeOnceSelfAttention
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
