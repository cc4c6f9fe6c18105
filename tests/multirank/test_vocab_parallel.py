"""Vocab-parallel log-probs/entropy/KL on TP=2 and TP=4 ranks (gloo, or NCCL on GPUs).

Vocab-parallel: every rank builds the same full logits from one seed, keeps its vocabulary
slice, and compares log-probs, entropy and the gradient of its slice with a single-rank
`log_softmax` over the true (unpadded) vocabulary. Inputs are fp32, as in training;
tolerance 1e-5 absolute on values and gradients (fp32 sums of exp over shards in a
different order). Upstream gradients are N(0, 1), so some exceed 1: enough to expose an
overflow to inf * 0 = NaN at padded entries.

bf16 logits (what a bf16 model emits) are checked too, against the reference on the same
values upcast to fp32 (exact): log-probs and entropy are computed in fp32, so they keep
ATOL; only the gradient is rounded once to bf16 on the way out, so it gets ATOL plus
bf16's relative rounding error, 2^-8 (round-to-nearest is within 2^-9; 2x margin).
In cuda mode the tensors live on the rank's GPU; TP=4 needs 4 GPUs and is skipped on 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.spawn import run_on_ranks, test_device

ATOL = 1e-5
BF16_GRAD_RTOL = 2.0**-8


def _reference(full_logits, labels, temperature, vocab_size):
    log_p = torch.log_softmax(full_logits[..., :vocab_size] / temperature, dim=-1)
    log_prob = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_prob, entropy


def _check_vocab_parallel(rank, world_size, padded_vocab, vocab_size, temperature, seed, dtype):
    from rl_megatron.models.vocab_parallel import (
        vocab_parallel_entropy,
        vocab_parallel_log_probs,
        vocab_parallel_log_probs_and_entropy,
    )

    group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(seed)
    # [seq, batch, vocab], sequence-first like Megatron's output layer; scale 3 so the
    # softmax is far from uniform and the temperature matters.
    full = 3 * torch.randn(5, 3, padded_vocab, generator=gen)
    full[..., vocab_size:] += 10  # padding rows must be excluded even when they dominate
    labels = torch.randint(0, vocab_size, (5, 3), generator=gen)
    labels[0, 0], labels[0, 1] = 0, vocab_size - 1  # first and last real ids
    g_lp, g_ent = torch.randn(2, 5, 3, generator=gen).unbind()  # upstream gradients
    device = test_device()
    # The reference sees the very values the shards hold (bf16 → fp32 is exact).
    full = full.to(dtype).to(device)
    labels, g_lp, g_ent = labels.to(device), g_lp.to(device), g_ent.to(device)
    grad_rtol = 0 if dtype == torch.float32 else BF16_GRAD_RTOL

    ref_logits = full.detach().float().clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_logits, labels, temperature, vocab_size)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()

    part = padded_vocab // world_size
    cols = slice(rank * part, (rank + 1) * part)
    shard = full[..., cols].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(shard, labels, group, temperature, vocab_size)
    torch.testing.assert_close(lp, ref_lp.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=ATOL, rtol=0)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert shard.grad.dtype == dtype
    grad = shard.grad.float()
    torch.testing.assert_close(grad, ref_logits.grad[..., cols], atol=ATOL, rtol=grad_rtol)
    if (rank + 1) * part > vocab_size:
        assert (shard.grad[..., max(vocab_size - rank * part, 0) :] == 0).all()

    # The single-output variants give the same values and gradients.
    shard_a = full[..., cols].clone().requires_grad_(True)
    lp_only = vocab_parallel_log_probs(shard_a, labels, group, temperature, vocab_size)
    (lp_only * g_lp).sum().backward()
    ref_logits.grad = None
    ref_lp, _ = _reference(ref_logits, labels, temperature, vocab_size)
    (ref_lp * g_lp).sum().backward()
    torch.testing.assert_close(lp_only, ref_lp.detach(), atol=ATOL, rtol=0)
    want = ref_logits.grad[..., cols]
    torch.testing.assert_close(shard_a.grad.float(), want, atol=ATOL, rtol=grad_rtol)

    shard_b = full[..., cols].clone().requires_grad_(True)
    ent_only = vocab_parallel_entropy(shard_b, group, temperature, vocab_size)
    (ent_only * g_ent).sum().backward()
    ref_logits.grad = None
    _, ref_ent = _reference(ref_logits, labels, temperature, vocab_size)
    (ref_ent * g_ent).sum().backward()
    torch.testing.assert_close(ent_only, ref_ent.detach(), atol=ATOL, rtol=0)
    want = ref_logits.grad[..., cols]
    torch.testing.assert_close(shard_b.grad.float(), want, atol=ATOL, rtol=grad_rtol)


def _reference_kl(full, full_ref, temperature, vocab_size):
    log_p = torch.log_softmax(full[..., :vocab_size] / temperature, dim=-1)
    log_q = torch.log_softmax(full_ref[..., :vocab_size] / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _check_kl(rank, world_size, padded_vocab, vocab_size, temperature, seed):
    """The exact KL from shards equals the full-vocabulary one, values and gradients."""
    from rl_megatron.models.vocab_parallel import vocab_parallel_kl

    group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(seed + 1)
    full, full_ref = (3 * torch.randn(2, 5, 3, padded_vocab, generator=gen)).unbind()
    full[..., vocab_size:] += 10
    full_ref[..., vocab_size:] -= 10
    g = torch.randn(5, 3, generator=gen)
    device = test_device()
    full, full_ref, g = full.to(device), full_ref.to(device), g.to(device)
    ref_logits = full.clone().requires_grad_(True)
    want = _reference_kl(ref_logits, full_ref, temperature, vocab_size)
    (want * g).sum().backward()
    part = padded_vocab // world_size
    cols = slice(rank * part, (rank + 1) * part)
    shard = full[..., cols].clone().requires_grad_(True)
    kl = vocab_parallel_kl(shard, full_ref[..., cols], group, temperature, vocab_size)
    torch.testing.assert_close(kl, want.detach(), atol=ATOL, rtol=0)
    (kl * g).sum().backward()
    torch.testing.assert_close(shard.grad, ref_logits.grad[..., cols], atol=ATOL, rtol=0)
    assert torch.isfinite(shard.grad).all()


def _vocab_parallel_body(rank, world_size, cases):
    for padded_vocab, vocab_size, temperature in cases:
        for dtype in (torch.float32, torch.bfloat16):
            _check_vocab_parallel(
                rank, world_size, padded_vocab, vocab_size, temperature, seed=0, dtype=dtype
            )
        _check_kl(rank, world_size, padded_vocab, vocab_size, temperature, seed=0)


def test_vocab_parallel_tp2():
    # (padded vocab, true vocab, temperature): no padding at T = 1; 3 padded ids at T = 0.7;
    # rank 1 wholly padding (the TP=4 test's case, for machines with 2 GPUs).
    cases = [(16, 16, 1.0), (16, 13, 0.7), (16, 13, 1.3), (16, 7, 1.0)]
    run_on_ranks(_vocab_parallel_body, world_size=2, cases=cases)


def test_vocab_parallel_tp4():
    # 20 = 4 x 5 ids; with a true vocab of 9, rank 1 is partly and ranks 2-3 wholly padding.
    cases = [(20, 20, 1.0), (20, 17, 0.6), (20, 9, 1.0)]
    run_on_ranks(_vocab_parallel_body, world_size=4, cases=cases)


def test_vocab_parallel_single_rank_and_bad_input():
    import pytest

    from rl_megatron.models.vocab_parallel import vocab_parallel_log_probs_and_entropy

    logits = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 8, (4,))
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, None, 0.8, 8)
    ref_lp, ref_ent = _reference(logits, labels, 0.8, 8)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    check = torch.autograd.gradcheck(
        lambda x: vocab_parallel_log_probs_and_entropy(x, labels, None, 0.8, 8), (logits,)
    )
    assert check
    # Both outputs at once, upstream gradients far from 1 (gradcheck feeds one at a time).
    g_lp, g_ent = (50 * torch.randn(2, 4, dtype=torch.float64)).unbind()
    grad = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), logits)[0]
    ref_grad = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), logits)[0]
    torch.testing.assert_close(grad, ref_grad, atol=1e-10, rtol=0)
    bf16 = logits.detach().bfloat16().requires_grad_(True)
    lp16, _ = vocab_parallel_log_probs_and_entropy(bf16, labels, None, 0.8, 8)
    assert lp16.dtype == torch.float32
    lp16.sum().backward()
    assert bf16.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_log_probs_and_entropy(logits, labels[:2], None)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs_and_entropy(logits, labels, None, 0.0)
    with pytest.raises(ValueError, match="vocab_size 11"):
        vocab_parallel_log_probs_and_entropy(logits, labels, None, 1.0, 11)


def test_vocab_parallel_kl_single_rank_matches_kl_full():
    import pytest

    from rl_megatron.algorithms.kl import kl_full
    from rl_megatron.models.vocab_parallel import vocab_parallel_kl

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    kl = vocab_parallel_kl(logits, ref, None, 0.8)
    want = kl_full(logits, ref, 0.8)
    torch.testing.assert_close(kl, want, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_kl(x, ref, None, 0.8, 8), (logits,))
    # Padding ids (>= vocab_size) are no tokens: the KL of the first 8 ids only.
    torch.testing.assert_close(
        vocab_parallel_kl(logits, ref, None, 0.8, 8),
        kl_full(logits[..., :8], ref[..., :8], 0.8),
        atol=1e-12,
        rtol=0,
    )
    assert vocab_parallel_kl(ref, ref, None).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="ref_logits"):
        vocab_parallel_kl(logits, ref[..., :5], None)


# ----------------------------------------------------------------------------- DP reductions
