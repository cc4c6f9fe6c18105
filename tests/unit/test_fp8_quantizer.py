"""resharding/fp8.py against a reference quantization written here, block by block.

The reference follows vLLM's online block quantizer (`per_block_cast_to_fp8`): per
128×128 block, `scale = max(amax, 1e-4) / 448` in float32, `q = fp8(w * (1 / scale))`.
It multiplies by the reciprocal, not `w / scale`: for some scales the two round a few
elements in a thousand differently (an fp8 midpoint), and the engine must hold what vLLM
itself would compute; `test_reciprocal_not_division` pins that choice.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_megatron.resharding.fp8 import (
    FP8_DTYPE,
    NonFiniteWeightError,
    block_scale_shape,
    dequantize_blockwise,
    quantize_blockwise_,
    quantize_per_tensor_,
    tensor_amax,
)

SHAPES = [(256, 384), (128, 128), (200, 130), (1, 5), (300, 1), (129, 257)]
DTYPES = [torch.bfloat16, torch.float32]


def reference_blockwise(w: torch.Tensor, bm: int = 128, bn: int = 128):
    """Block by block in plain Python loops: (fp8 weight, float32 scales)."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / bm), math.ceil(cols / bn)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].float()
            s = torch.clamp(blk.abs().max(), min=1e-4) / 448.0
            scales[i, j] = s
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk * (1.0 / s)).to(
                torch.float8_e4m3fn
            )
    return q, scales


def random_weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Blocks of very different magnitudes, so that a scale taken from the wrong block shows.
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])[None, :]
    return w.to(dtype)


def quantized(w: torch.Tensor, **kw):
    out = torch.empty(w.shape, dtype=FP8_DTYPE)
    scale = torch.empty(block_scale_shape(tuple(w.shape)), dtype=torch.float32)
    quantize_blockwise_(w, out, scale, "layers.0.mlp.down_proj.weight", **kw)
    return out, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_blockwise_equals_reference_bitwise(shape, dtype):
    w = random_weight(shape, dtype)
    q, scale = quantized(w)
    ref_q, ref_scale = reference_blockwise(w)
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert scale.dtype == torch.float32
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_chunks_do_not_change_the_result():
    """A chunk of one block-row at a time gives the bits of one chunk for all."""
    w = random_weight((300, 260), torch.bfloat16, seed=3)
    q1, s1 = quantized(w)
    q2, s2 = quantized(w, chunk_bytes=1)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s1, s2)


def test_reciprocal_not_division():
    """The reciprocal recipe is observable: true division gives other bits here.

    Only for some scales (their reciprocal rounded in float32): 146 elements with seed 3.
    """
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    q, scale = quantized(w)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    divided = (w.float() / full).to(torch.float8_e4m3fn)
    assert not torch.equal(q.view(torch.uint8), divided.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_dequantized_within_fp8_error(shape, dtype):
    """|dequant - w| <= scale * max(2^-4 * |w| / scale, 2^-10), per element.

    e4m3fn has 3 mantissa bits: a normal x in [2^e, 2^(e+1)) (e >= -6) lies between
    neighbours 2^(e-3) apart, so round-to-nearest moves it by at most 2^(e-4) <= 2^-4 |x|
    (2^-3 of the step, relative: half a step). Below 2^-6 the subnormals are 2^-9 apart:
    at most 2^-10 absolute. x = w / scale with |x| <= 448 (the top value, exact); the
    float32 product w * (1/scale) adds ~2 ulp (2^-22 relative), the 1e-5 slack below.
    """
    w = random_weight(shape, dtype, seed=2)
    q, scale = quantized(w)
    deq = dequantize_blockwise(q, scale)
    full = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    wf = w.float()
    bound = full * torch.maximum(wf.abs() / full * 2.0**-4, torch.tensor(2.0**-10))
    err = (deq - wf).abs()
    assert bool((err <= bound * (1 + 1e-5)).all()), float((err / bound).max())
    # The bound is tight, not loose: some element uses most of it.
    assert float((err / bound).max()) > 0.5


def test_zero_block_has_a_finite_nonzero_scale():
    w = random_weight((256, 256), torch.bfloat16)
    w[128:, :128] = 0  # one whole block of zeros; a ragged zero tail as well below
    q, scale = quantized(w)
    assert float(scale[1, 0]) == pytest.approx(1e-4 / 448, rel=1e-6)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert not q[128:, :128].float().any()
    # Its neighbours keep their own scales.
    assert float(scale[1, 1]) == float(w[128:, 128:].float().abs().max() / 448)
    w2 = torch.zeros(130, 3, dtype=torch.float32)
    q2, s2 = quantized(w2)
    assert torch.equal(s2, torch.full((2, 1), 1e-4) / 448)
    assert not q2.float().any()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("mode", ["block", "tensor"])
def test_non_finite_input_is_refused_naming_the_tensor(bad, mode):
    w = random_weight((200, 300), torch.bfloat16)
    w[150, 260] = bad
    out = torch.empty(w.shape, dtype=FP8_DTYPE)
    name = "model.layers.3.self_attn.qkv_proj.weight"
    with pytest.raises(NonFiniteWeightError) as err:
        if mode == "block":
            quantize_blockwise_(w, out, torch.empty(2, 3), name)
        else:
            quantize_per_tensor_(w, out, torch.empty(()), name)
    message = str(err.value)
    assert name in message and "\n" not in message
    if mode == "block":
        assert "(1, 2)" in message  # the block that holds it


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_equals_reference_bitwise(dtype):
    w = random_weight((200, 130), dtype, seed=4)
    s_ref = torch.clamp(w.float().abs().max(), min=1e-4) / 448.0
    q_ref = (w.float() * (1.0 / s_ref)).to(torch.float8_e4m3fn)
    # Into a transposed view, as vLLM's per-tensor layer keeps its weight ([in, out]).
    storage = torch.empty(130, 200, dtype=FP8_DTYPE)
    scale = torch.empty(1)
    quantize_per_tensor_(w, storage.t(), scale, "w", chunk_bytes=1000)
    assert torch.equal(scale.view(torch.int32), s_ref.reshape(1).view(torch.int32))
    assert torch.equal(storage.t().view(torch.uint8), q_ref.view(torch.uint8))


def test_per_tensor_takes_the_whole_tensors_amax():
    """A shard quantized with the amax of all shards: the scale of the whole tensor."""
    w = random_weight((64, 256), torch.bfloat16, seed=5)
    shards = w.chunk(2, dim=1)
    amax = torch.maximum(tensor_amax(shards[0]), tensor_amax(shards[1]))
    assert float(amax) == float(w.float().abs().max())
    scale, out = torch.empty(()), torch.empty(64, 128, dtype=FP8_DTYPE)
    quantize_per_tensor_(shards[0].contiguous(), out, scale, "w", amax=amax)
    whole_scale = w.float().abs().max() / 448.0
    assert float(scale) == float(whole_scale)
    q_ref = (w.float() * (1.0 / whole_scale)).to(torch.float8_e4m3fn)[:, :128]
    assert torch.equal(out.view(torch.uint8), q_ref.view(torch.uint8))


def test_wrong_engine_tensors_are_named():
    w = torch.ones(10, 10)
    with pytest.raises(ValueError, match="scale shape"):
        quantize_blockwise_(w, torch.empty(10, 10, dtype=FP8_DTYPE), torch.empty(2, 1), "x")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quantize_blockwise_(w, torch.empty(10, 10), torch.empty(1, 1), "x")


def test_writes_through_strided_engine_tensors():
    """Scales laid out column-major (as DeepGEMM re-lays them out on Hopper) and a weight
    view with a row stride: every value lands at its logical place."""
    w = random_weight((300, 130), torch.bfloat16, seed=6)
    ref_q, ref_scale = reference_blockwise(w)
    scale = torch.zeros(2, 3).t()  # logical (3, 2), column-major storage
    out_storage = torch.zeros(300, 300, dtype=FP8_DTYPE)
    out = out_storage[:, 20:150]  # row stride 300
    quantize_blockwise_(w, out, scale, "w", chunk_bytes=1)
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert torch.equal(out.view(torch.uint8), ref_q.view(torch.uint8))
    assert not out_storage[:, :20].float().any() and not out_storage[:, 150:].float().any()
