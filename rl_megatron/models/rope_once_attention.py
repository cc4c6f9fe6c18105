"""megatron-core's `SelfAttention` with a static KV cache of keys rotated once.

With static batching (the Megatron engine's `StaticInferenceContext`) and no flash decode
(which needs the flash-attn package), megatron-core 0.16 caches each key *before* RoPE and,
at every decode step, rotates the whole cache `[:sequence_end]` again. That costs
O(cached tokens) elementwise passes per layer and step: on one H200 (0.85B Llama, batch
256, 128 + 256 tokens) those passes took ~45 % of the decode's device time
(`benchmarks/results/profile_h200_megatron_decode_b256_run6.txt`).

This subclass rotates each key once, on its way into the cache, with the same embedding
rows and the same `apply_rotary_pos_emb` call megatron-core would apply to it at every
step, and then tells megatron-core's forward that the keys need no rotation (the key half
of `rotary_pos_emb` is None). Queries are rotated as before. The cache therefore holds
the very keys attention saw before, element for element; everything else (cache layout,
allocation, masking) is megatron-core's.

Training and every other path (no inference context, dynamic batching, flash decode,
context parallelism, cos/sin RoPE) go to megatron-core's method unchanged.
"""

from __future__ import annotations

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention


class RopeOnceSelfAttention(SelfAttention):
    """`SelfAttention` whose static-batching KV cache stores rotated keys (module docstring)."""

    def _adjust_key_value_for_inference(
        self,
        inference_context,
        query,
        key,
        value,
        rotary_pos_emb,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        context = inference_context if inference_context is not None else inference_params

        def adjust(key, rotary_pos_emb):  # megatron-core's own method, the other arguments as given
            return super(RopeOnceSelfAttention, self)._adjust_key_value_for_inference(
                context, query, key, value, rotary_pos_emb,
                rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset,
            )  # fmt: skip

        # RoPE from the embedding table (not cos/sin tensors), the key half still to apply.
        rope_by_table = (
            rotary_pos_emb is not None
            and rotary_pos_emb[1] is not None
            and rotary_pos_cos is None
            and rotary_pos_sin is None
            and rotary_pos_cos_sin is None
        )
        if not (rope_by_table and self._static_decode(context)):
            return adjust(key, rotary_pos_emb)
        k_pos_emb = rotary_pos_emb[1]
        start = context.sequence_len_offset
        key = apply_rotary_pos_emb(
            key,
            k_pos_emb[start : start + key.size(0)],
            config=self.config,
            mscale=_yarn_get_concentration_factor_from_config(self.config),
            cp_group=self.pg_collection.cp,
        )
        query, key, value, rotary_pos_emb, mask_type, block_table = adjust(key, rotary_pos_emb)
        # megatron-core's forward rotates the key half of what it gets back over the whole
        # cache; the cached keys already are.
        return query, key, value, (rotary_pos_emb[0], None), mask_type, block_table

    def _static_decode(self, context) -> bool:
        """Static-batching inference that megatron-core does without flash decode or CP."""
        return (
            context is not None
            and not self.training
            and context.is_static_batching()
            and not self.config.flash_decode
            and self.pg_collection.cp.size() == 1
        )
