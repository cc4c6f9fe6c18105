"""Layer spec choice: Transformer Engine when it imports, else the local spec with SDPA.

This is the one place Transformer Engine is imported for the model code (CONVENTIONS.md,
habit 10). Both specs checkpoint under the same `dist_checkpointing` keys (megatron-core
maps the local spec's `input_layernorm` / `pre_mlp_layernorm` onto TE's fused names), so a
checkpoint written with one loads with the other. For a mixture of experts the pre-MLP
norm is a module of its own in both (no fused `linear_fc1` to carry it), stored as TE's spec
stores it, `pre_mlp_layernorm.weight`: the local spec's renaming is dropped there.
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


def gpt_layer_spec(
    use_te: bool | None = None,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """Transformer-layer spec for the Llama-family `GPTModel` (RMSNorm, SwiGLU, RoPE, GQA).

    Args:
        use_te: force (True) or forbid (False) Transformer Engine; None picks TE when it
            imports. Asking for TE when it is missing raises a one-line error.
        qk_layernorm: RMSNorm on each head's query and key before RoPE (Qwen3): the
            attention's `q_layernorm` / `k_layernorm` (must match the config's flag).
        num_experts: a mixture of experts (megatron-core's `MoELayer`) in place of the MLP;
            None = dense. From `TransformerConfig.num_moe_experts`.
        moe_grouped_gemm: the experts as one grouped GEMM (TE's `TEGroupedMLP`); else one
            MLP per expert (`SequentialMLP`). From `TransformerConfig.moe_grouped_gemm`.
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

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm
        )
    if moe_grouped_gemm:
        raise RuntimeError("grouped GEMM experts need Transformer Engine; use per-expert MLPs")
    if num_experts:
        _router_without_te()
    return local_sdpa_layer_spec(qk_layernorm, num_experts)


def _router_without_te() -> None:
    """megatron-core 0.16.1's router linear (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, a name its module binds only when TE imports: without TE
    every MoE forward raised NameError. Binding it to None takes the torch.mm path it has
    for exactly that case (a no-op once megatron-core binds it itself)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def local_sdpa_layer_spec(qk_layernorm: bool = False, num_experts: int | None = None) -> ModuleSpec:
    """megatron-core's local layer spec with `SDPAttention` as the core attention, in a
    `SelfAttention` whose inference KV cache holds keys rotated once (`RopeOnceSelfAttention`:
    the same parameters and checkpoint keys, a faster Megatron-engine decode).

    With `qk_layernorm` the attention normalises q and k per head (torch's RMSNorm over
    head_dim) as it splits them from `linear_qkv`, before either subclass sees them: RoPE,
    the KV cache and SDPA get normalised keys, as in transformers' and vLLM's Qwen3."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rl_megatron.models.rope_once_attention import RopeOnceSelfAttention
    from rl_megatron.models.sdpa_attention import SDPAttention

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    # The getter builds a fresh spec on every call, so editing it in place is safe.
    spec.submodules.self_attention.module = RopeOnceSelfAttention
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if num_experts:
        # TE's MoE spec stores the pre-MLP norm under its own name: so does this one.
        keys = spec.submodules.sharded_state_dict_keys_map
        spec.submodules.sharded_state_dict_keys_map = {
            k: v for k, v in keys.items() if k != "pre_mlp_layernorm."
        }
    return spec
