"""bf16/fp32 weights quantized to FP8 (`torch.float8_e4m3fn`) into an engine's tensors.

The weight sync's last step for an engine that generates with FP8 weights: the trainer's
weights arrive in bf16 (or fp32) and are written, quantized, into the engine's own FP8
weight and its scale tensor (in place, on the tensor's device: no host round trip, no
full-model temporary). Two layouts, the ones vLLM's FP8 linear methods hold:

* **block-wise** (`quantize_blockwise_`): one scale per 128×128 block of the
  `[out, in]` weight, the layout of block-quantized checkpoints (vLLM's
  `weight_scale_inv`, shape `(ceil(out/128), ceil(in/128))`, float32). The recipe is that
  of vLLM's own online block quantizer (`vllm.utils.deep_gemm.per_block_cast_to_fp8`, used
  by `quantization="fp8_per_block"`), so the engine holds what it would had it quantized
  the same weights itself:
  `scale = max(amax(|w_block|), 1e-4) / 448` in float32, `q = fp8(w_block * (1 / scale))`.
  Ragged last blocks (rows or columns not a multiple of 128) take the amax of the
  elements they have, as vLLM's zero padding does. The 1e-4 floor keeps an all-zero
  block's scale finite and non-zero (its elements quantize to 0).
* **per-tensor** (`quantize_per_tensor_`): one scale for the whole tensor, same recipe.
  A tensor split over ranks must use the amax of all its shards (`tensor_amax`, reduced
  by the caller: this module knows no process group).

Dequantization is `fp8.float() * scale` (the scale is the step, not its inverse, whatever
vLLM's tensor name says). Weights that are not finite are refused with one line naming the
tensor: their scale would be inf or NaN and the engine would generate garbage.

Pure torch; no engine import (resharding knows no engine).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# vLLM's per_block_cast_to_fp8 floors each block's amax here before dividing by FP8_MAX.
AMAX_FLOOR = 1e-4
BLOCK = (128, 128)  # vLLM's default `weight_block_size` (rows, columns)
# Temporaries per call: a chunk of whole block-rows, about this many bytes in float32
# (plus its absolute value), at least one block-row. vLLM's online quantizer keeps ~64 MB.
CHUNK_BYTES = 64 * 2**20


class NonFiniteWeightError(ValueError):
    """A weight handed to the quantizer holds inf or NaN."""


def block_scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The scale tensor's shape for a `[rows, cols]` weight: one float32 per block."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def _check_pair(
    weight: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, scale_shape: tuple, name: str
) -> None:
    # Internal misuse (a wrong engine tensor), not a user error: named, with the shapes.
    if weight.dim() != 2 or tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"{name}: fp8 weight {tuple(out.shape)} vs source {tuple(weight.shape)}")
    if out.dtype != FP8_DTYPE or scale.dtype != torch.float32:
        raise ValueError(
            f"{name}: expected {FP8_DTYPE} and float32, got {out.dtype}, {scale.dtype}"
        )
    if tuple(scale.shape) != tuple(scale_shape):
        raise ValueError(f"{name}: scale shape {tuple(scale.shape)}, expected {scale_shape}")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: cannot quantize {weight.dtype}")


def _refuse_non_finite(scale: torch.Tensor, name: str) -> None:
    """One device sync per tensor: amax propagates NaN and inf, so the scales tell."""
    bad = ~torch.isfinite(scale)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise NonFiniteWeightError(
            f"{name}: the weight holds inf or NaN (block {where} of scales "
            f"{tuple(scale.shape)}); refusing to quantize it to fp8"
        )


def quantize_blockwise_(
    weight: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    name: str,
    block: tuple[int, int] = BLOCK,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Quantize `weight` into `out` (fp8) and `scale` (float32, one per block), in place.

    weight: `[rows, cols]` bf16/fp16/fp32, on the device of `out` and `scale`.
    out: `[rows, cols]` float8_e4m3fn, any strides (a view of the engine's parameter).
    scale: `[ceil(rows/bm), ceil(cols/bn)]` float32; dequant = `out.float() * scale` per block.
    name: the parameter's name, for the error on inf/NaN.
    """
    bm, bn = block
    _check_pair(weight, out, scale, block_scale_shape(tuple(weight.shape), block), name)
    rows, cols = weight.shape
    n_col_blocks = scale.shape[1]
    padded_cols = n_col_blocks * bn
    # Whole block-rows per chunk, so that no block straddles two chunks.
    per_block_row = bm * padded_cols * 4
    chunk_rows = max(1, chunk_bytes // per_block_row) * bm
    for r0 in range(0, rows, chunk_rows):
        r1 = min(r0 + chunk_rows, rows)
        n_row_blocks = -(-(r1 - r0) // bm)
        # Zero padding up to whole blocks: zeros never raise a block's amax (vLLM pads too).
        buf = torch.zeros(n_row_blocks * bm, padded_cols, dtype=torch.float32, device=out.device)
        buf[: r1 - r0, :cols].copy_(weight[r0:r1])
        blocks = buf.view(n_row_blocks, bm, n_col_blocks, bn)
        amax = blocks.abs().amax(dim=(1, 3))  # [n_row_blocks, n_col_blocks]
        # Division by the Python float, as vLLM does (a tensor divisor may round differently).
        s = amax.clamp_(min=AMAX_FLOOR) / FP8_MAX
        scale[r0 // bm : r0 // bm + n_row_blocks].copy_(s)
        # Multiply by the reciprocal in float32, as vLLM does: true division rounds a few
        # elements that sit on an fp8 midpoint the other way.
        blocks.mul_((1.0 / s)[:, None, :, None])
        buf.clamp_(-FP8_MAX, FP8_MAX)  # |w|/scale <= 448 up to a float32 rounding
        out[r0:r1].copy_(buf[: r1 - r0, :cols])
    _refuse_non_finite(scale, name)


def tensor_amax(weight: torch.Tensor) -> torch.Tensor:
    """max |weight| as a float32 0-d tensor on its device (no full-size abs temporary)."""
    lo, hi = weight.aminmax()
    return torch.maximum(lo.abs(), hi.abs()).float()


def quantize_per_tensor_(
    weight: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    name: str,
    amax: torch.Tensor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Quantize `weight` into `out` (fp8) with one scale, written into `scale` (1 element).

    weight: `[rows, cols]` bf16/fp16/fp32. out: same shape, float8_e4m3fn, any strides.
    scale: float32 with one element (shape `()` or `(1,)`).
    amax: max |w| over the whole tensor when `weight` is one shard of it (every shard's
    `tensor_amax`, max-reduced by the caller); None: this tensor's own.
    """
    _check_pair(weight, out, scale, tuple(scale.shape), name)
    if scale.numel() != 1:
        raise ValueError(f"{name}: per-tensor scale has {scale.numel()} elements")
    a = tensor_amax(weight) if amax is None else amax.float()
    s = a.clamp(min=AMAX_FLOOR) / FP8_MAX
    _refuse_non_finite(s.reshape(1), name)  # before anything is written
    scale.copy_(s.reshape(scale.shape))
    inv = 1.0 / s
    rows, cols = weight.shape
    chunk_rows = max(1, chunk_bytes // max(1, cols * 4))
    for r0 in range(0, rows, chunk_rows):
        r1 = min(r0 + chunk_rows, rows)
        part = weight[r0:r1].to(torch.float32, copy=True).mul_(inv).clamp_(-FP8_MAX, FP8_MAX)
        out[r0:r1].copy_(part)


def dequantize_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """float32 weights back from fp8 and block scales (tests and the sync's verification)."""
    rows, cols = q.shape
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * full
