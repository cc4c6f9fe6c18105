"""Layout conversions against naive reference code: exact (integer-valued tensors, no math)."""

from __future__ import annotations

import pytest
import torch

from rl_megatron.models import conversions as cv

# Small GQA shape: 8 query heads, 2 KV groups, head dim 3, hidden 5.
NQ, NG, D, H = 8, 2, 3, 5


def _qkv():
    q = torch.arange(NQ * D * H).reshape(NQ * D, H)
    k = 1000 + torch.arange(NG * D * H).reshape(NG * D, H)
    v = 2000 + torch.arange(NG * D * H).reshape(NG * D, H)
    return q, k, v


def _naive_interleave(q, k, v, ng):
    """Megatron's layout written out row by row: per group, its query heads, then k, then v."""
    per_group = q.shape[0] // ng
    kv = k.shape[0] // ng
    rows = []
    for g in range(ng):
        rows += [
            q[g * per_group : (g + 1) * per_group],
            k[g * kv : (g + 1) * kv],
            v[g * kv : (g + 1) * kv],
        ]
    return torch.cat(rows)


def test_interleave_matches_naive_and_inverts():
    q, k, v = _qkv()
    fused = cv.interleave_qkv(q, k, v, NG)
    assert torch.equal(fused, _naive_interleave(q, k, v, NG))
    q2, k2, v2 = cv.deinterleave_qkv(fused, NQ, NG)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_qkv_bias_1d():
    q, k, v = (t[:, 0] for t in _qkv())
    fused = cv.interleave_qkv(q, k, v, NG)
    assert fused.shape == ((NQ + 2 * NG) * D,)
    assert all(torch.equal(a, b) for a, b in zip(cv.deinterleave_qkv(fused, NQ, NG), (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_tp_shards_concatenate_to_full(tp):
    """A TP shard is the interleave of q/k/v head slices; the shards concatenate to TP=1."""
    q, k, v = _qkv()
    full = cv.interleave_qkv(q, k, v, NG)
    shards = [
        cv.interleave_qkv(qs, ks, vs, NG // tp)
        for qs, ks, vs in zip(cv.tp_split(q, tp, 0), cv.tp_split(k, tp, 0), cv.tp_split(v, tp, 0))
    ]
    assert torch.equal(cv.tp_merge(shards, 0), full)
    assert all(torch.equal(a, b) for a, b in zip(cv.tp_split(full, tp, 0), shards))


def test_vllm_qkv_round_trip_per_shard():
    q, k, v = _qkv()
    tp = 2
    for qs, ks, vs in zip(cv.tp_split(q, tp, 0), cv.tp_split(k, tp, 0), cv.tp_split(v, tp, 0)):
        meg = cv.interleave_qkv(qs, ks, vs, NG // tp)
        vllm = cv.megatron_qkv_to_vllm(meg, NQ // tp, NG // tp)
        assert torch.equal(vllm, torch.cat([qs, ks, vs]))
        assert torch.equal(cv.vllm_qkv_to_megatron(vllm, NQ // tp, NG // tp), meg)


def test_gate_up_shards():
    gate = torch.arange(8 * H).reshape(8, H)
    up = 500 + torch.arange(8 * H).reshape(8, H)
    full = cv.fuse_gate_up(gate, up)
    shards = cv.split_gated_shards(full, 2)
    # Shard r is [gate_r; up_r], not a plain row slice of the TP=1 tensor.
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    assert not torch.equal(shards[1], full[8:])
    assert torch.equal(cv.merge_gated_shards(shards), full)
    g, u = cv.split_gate_up(shards[0])
    assert torch.equal(g, gate[:4]) and torch.equal(u, up[:4])


def test_vocab_padding():
    assert cv.padded_vocab_size(100, 128, 1) == 128
    assert cv.padded_vocab_size(100, 128, 2) == 256
    assert cv.padded_vocab_size(256, 128, 2) == 256
    emb = torch.randn(100, 4)
    padded = cv.pad_vocab(emb, 128)
    assert padded.shape == (128, 4) and torch.equal(padded[:100], emb)
    assert not padded[100:].any()
    assert torch.equal(cv.unpad_vocab(padded, 100), emb)
    with pytest.raises(ValueError, match="exceeds"):
        cv.pad_vocab(emb, 64)


def test_tp_split_merge_and_errors():
    w = torch.arange(24).reshape(4, 6)
    for dim in (0, 1):
        assert torch.equal(cv.tp_merge(cv.tp_split(w, 2, dim), dim), w)
    assert cv.shard_range(12, 3, 2) == (8, 12)
    with pytest.raises(ValueError, match="not divisible"):
        cv.tp_split(w, 4, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        cv.deinterleave_qkv(torch.zeros(7, 2), 4, 2)
