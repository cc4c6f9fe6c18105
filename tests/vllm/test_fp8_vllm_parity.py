"""resharding/fp8.py against vLLM's own online block quantizer, bit for bit.

vLLM with `quantization="fp8_per_block"` quantizes a bf16 checkpoint at load with
`vllm.utils.deep_gemm.per_block_cast_to_fp8`; the sync must leave the engine holding
exactly that (DESIGN.md §3, point 1). Pure torch on both sides, so the CPU build runs it
even though it cannot run an FP8 model (DESIGN.md §7, "FP8 rollout").
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.resharding.fp8 import block_scale_shape, quantize_blockwise_

pytestmark = [pytest.mark.vllm]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (1, 5), (129, 257)])
def test_blockwise_equals_vllm_per_block_cast(shape, dtype):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)
    w[: min(shape[0], 128), : min(shape[1], 128)] = 0  # an all-zero block: vLLM's floor
    ref_q, ref_scale = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(block_scale_shape(shape), dtype=torch.float32)
    quantize_blockwise_(w, out, scale, "w")
    assert ref_scale.dtype == scale.dtype and ref_scale.shape == scale.shape
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert torch.equal(out.view(torch.uint8), ref_q.view(torch.uint8))
