"""SDPAttention equals megatron-core's stock DotProductAttention on CPU.

One single-rank spawn (megatron needs its parallel state and the CPU shim) runs every case:
causal GQA forward and backward, padding masks (left and right), sliding window, packed
sequences (with and without padded boundaries), single-query decoding (GQA with a padding
mask: query heads folded, no K/V copy), bf16, and a whole
GPTModel built with the stock local spec vs with `local_sdpa_layer_spec`.

Tolerances: fp32 results may differ only by summation order (SDPA's kernel vs
baddbmm + softmax + bmm): 1e-5 absolute on O(1) outputs. bf16: both paths against the
fp32 result, 2e-2 (bf16 keeps 8 mantissa bits, 2^-8 ≈ 4e-3 per rounding, a few roundings).
"""

from __future__ import annotations

import torch

from tests.spawn import run_on_ranks

S, B, NQ, NG, D = 12, 3, 4, 2, 8
FP32_TOL, BF16_TOL = 1e-5, 2e-2


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=NQ * D,
        num_attention_heads=NQ,
        num_query_groups=NG,
        kv_channels=D,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        attention_softmax_in_fp32=True,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _pair(**kw):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from rl_megatron.models.sdpa_attention import SDPAttention

    cfg = _config(**kw)
    args = dict(
        config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    return DotProductAttention(**args), SDPAttention(**args)


def _qkv(s=S, b=B, dtype=torch.float32, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, NQ, D, generator=gen).to(dtype)
    k = torch.randn(s, b, NG, D, generator=gen).to(dtype)
    v = torch.randn(s, b, NG, D, generator=gen).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _close(a, b, tol, what):
    err = (a.float() - b.float()).abs().max().item()
    assert err < tol, f"{what}: max abs error {err:.2e} >= {tol}"


def _causal_and_grads():
    stock, sdpa = _pair()
    q, k, v = _qkv(requires_grad=True)
    ref = stock(q, k, v, None)
    ref.square().sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = sdpa(q, k, v, None)
    out.square().sum().backward()
    assert out.shape == (S, B, NQ * D)
    _close(out, ref, FP32_TOL, "causal forward")
    for name, t, g in zip("qkv", (q, k, v), ref_grads):
        _close(t.grad, g, FP32_TOL, f"causal d{name}")


def _padding():
    from rl_megatron.models.sdpa_attention import causal_padding_mask

    stock, sdpa = _pair()
    q, k, v = _qkv()
    keep = torch.ones(B, S, dtype=torch.long)
    keep[0, :4] = 0  # left padding: those query rows see no key at all
    keep[1, -5:] = 0  # right padding
    mask = causal_padding_mask(keep)
    ref, out = stock(q, k, v, mask), sdpa(q, k, v, mask)
    assert torch.isfinite(out).all()
    real = keep.bool().t()  # [s, b]: compare where the query is a real token
    _close(out[real], ref[real], FP32_TOL, "padding mask")


def _window():
    stock, sdpa = _pair(window_size=(3, 0))
    q, k, v = _qkv()
    _close(sdpa(q, k, v, None), stock(q, k, v, None), FP32_TOL, "sliding window")


def _packed():
    from megatron.core.packed_seq_params import PackedSeqParams

    stock, sdpa = _pair()
    lengths = [5, 4, 3]
    q, k, v = (t[:, 0] for t in _qkv(s=sum(lengths), b=1))  # [t, heads, d]
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    ref = torch.cat(
        [
            stock(q[a:b, None], k[a:b, None], v[a:b, None], None)[:, 0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
    )
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5
    )
    _close(sdpa(q, k, v, None, packed_seq_params=params), ref, FP32_TOL, "packed")
    # Padded boundaries: sequence 0 padded from 5 to 6 tokens, so real tokens keep their
    # outputs and the pad token only sees its own sequence.
    q2, k2, v2 = (torch.cat([t[:5], t[:1], t[5:]]) for t in (q, k, v))
    padded = torch.tensor([0, 6, 10, 13], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
    )
    out = sdpa(q2, k2, v2, None, packed_seq_params=params)
    _close(torch.cat([out[:5], out[6:]]), ref, FP32_TOL, "packed with padded boundaries")


def _decode_and_bf16():
    stock, sdpa = _pair()
    q, k, v = _qkv()
    _close(sdpa(q[-1:], k, v, None), stock(q[-1:], k, v, None), FP32_TOL, "one-query decode")
    ref32 = stock(q, k, v, None)
    stock16, sdpa16 = _pair(bf16=True, params_dtype=torch.bfloat16)
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    _close(stock16(q16, k16, v16, None), ref32, BF16_TOL, "stock bf16 vs fp32")
    out16 = sdpa16(q16, k16, v16, None)
    assert out16.dtype == torch.bfloat16
    _close(out16, ref32, BF16_TOL, "sdpa bf16 vs fp32")


def _gqa_decode_with_mask():
    """KV-cache decoding with a padding mask (the engine's path): query heads folded into
    the query dim must equal an explicit K/V expansion (the previous implementation), and
    the stock module where it takes the mask (it drops a given mask under a window), for a
    mask shared by all heads and a per-head one, with and without a sliding window."""
    import torch.nn.functional as F

    q, k, v = _qkv()
    q1 = q[-1:]  # one query per row against S cached keys
    keys = torch.ones(B, S, dtype=torch.bool)
    keys[0, :4] = False  # left padding
    keys[2, 7] = False
    shared = ~keys[:, None, None, :]  # [b, 1, 1, sk], True = masked out
    per_head = shared.expand(B, NQ, 1, S).clone()
    for h in range(NQ):
        per_head[:, h, 0, S - 2 - h] = True  # each head hides a different key
    rep = NQ // NG
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q1, k, v))
    for window in (None, (5, 0)):
        stock, sdpa = _pair(window_size=window)
        in_window = torch.ones(S, dtype=torch.bool)
        if window is not None:
            in_window[: S - 1 - window[0]] = False
        for name, mask in (("shared", shared), ("per-head", per_head)):
            expanded = F.scaled_dot_product_attention(
                qb,
                kb.repeat_interleave(rep, 1),
                vb.repeat_interleave(rep, 1),
                attn_mask=~mask & in_window,
            ).permute(2, 0, 1, 3)
            out = sdpa(q1, k, v, mask)
            what = f"gqa decode, {name} mask, window {window}"
            _close(out, expanded.reshape(1, B, NQ * D), FP32_TOL, what + " vs expanded K/V")
            if window is None:
                _close(out, stock(q1, k, v, mask), FP32_TOL, what + " vs stock")


def _whole_model():
    """GPTModel with the stock local spec and with the SDPA spec: same weights, same logits."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rl_megatron.models.specs import gpt_layer_spec, have_transformer_engine

    assert not have_transformer_engine()  # the CPU machines have no TE: SDPA is the default
    cfg = _config(
        num_layers=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        ffn_hidden_size=48,
    )
    kw = dict(config=cfg, vocab_size=64, max_sequence_length=S, position_embedding_type="rope")
    torch.manual_seed(3)
    stock = GPTModel(transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), **kw)
    sdpa = GPTModel(transformer_layer_spec=gpt_layer_spec(), **kw)
    assert type(sdpa.decoder.layers[0].self_attention.core_attention).__name__ == "SDPAttention"
    sdpa.load_state_dict(stock.state_dict())
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        _close(sdpa(ids, pos, None), stock(ids, pos, None), FP32_TOL, "GPTModel logits")


def _body(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    _causal_and_grads()
    _padding()
    _window()
    _packed()
    _decode_and_bf16()
    _gqa_decode_with_mask()
    _whole_model()


def test_sdpa_matches_stock_attention():
    run_on_ranks(_body, world_size=1)
