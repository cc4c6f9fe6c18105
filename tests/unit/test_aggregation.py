"""Loss aggregation modes, and their invariance to how a mini-batch is cut into micro-batches.

References are python loops over the mask. Tolerances: fp64 throughout; 1e-12 for values
computed two ways (only summation order differs), 1e-10 for summed micro-batch gradients.
The DP (2 gloo ranks) version of the split test lives in tests/multirank.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.algorithms.aggregation import (
    AGG_MODES,
    aggregate,
    batch_totals,
)

NORM_LEN = 9


def naive_aggregate(loss_mat, mask, mode, norm_len):
    """Plain loops; all-masked sequences are left out of the sequence count."""
    rows = []
    for loss_row, mask_row in zip(loss_mat, mask):
        vals = [v for v, m in zip(loss_row, mask_row) if m]
        if vals:
            rows.append(vals)
    n_tokens = sum(len(r) for r in rows)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / n_tokens
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * norm_len)


def test_hand_computed_modes():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid tokens: row 0 -> 1, 2; row 1 -> 4
    expected = {
        "token-mean": (1 + 2 + 4) / 3,
        "seq-mean-token-sum": ((1 + 2) + 4) / 2,
        "seq-mean-token-mean": ((1 + 2) / 2 + 4 / 1) / 2,
        "seq-mean-token-sum-norm": (1 + 2 + 4) / (2 * 3),  # norm_len defaults to 3 columns
    }
    for mode, value in expected.items():
        assert aggregate(loss_mat, mask, mode).item() == pytest.approx(value, abs=1e-12), mode
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm", norm_len=7).item() == (
        pytest.approx(7 / (2 * 7), abs=1e-12)
    )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_matches_naive_loops(mode):
    gen = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(6, NORM_LEN, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, NORM_LEN, generator=gen) > 0.4).long()
    mask[2] = 0  # an all-masked sequence
    got = aggregate(loss_mat, mask, mode, norm_len=NORM_LEN)
    want = naive_aggregate(loss_mat.tolist(), mask.tolist(), mode, NORM_LEN)
    assert got.item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_garbage_at_masked_positions_is_ignored(mode):
    loss_mat = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 1]])
    loss = aggregate(loss_mat, mask, mode)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(loss_mat.grad).all()
    assert loss_mat.grad[0, 1] == 0 and loss_mat.grad[1, 0] == 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_batch_gives_zero_not_nan(mode):
    loss_mat = torch.randn(3, 4, requires_grad=True)
    loss = aggregate(loss_mat, torch.zeros(3, 4), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert (loss_mat.grad == 0).all()


def _problem(seed: int):
    """A per-token loss that is a non-linear function of shared parameters w."""
    gen = torch.Generator().manual_seed(seed)
    batch, length, dim = 8, NORM_LEN, 3
    feats = torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    # Uneven lengths, so micro-batches hold different token and sequence counts;
    # sequence 3 is all-masked.
    lengths = torch.tensor([9, 3, 7, 0, 5, 8, 1, 6])
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).long()
    mask[0, 1] = 0  # a hole inside a response
    w = torch.randn(dim, generator=gen, dtype=torch.float64)
    return feats, mask, w


def _loss_mat(feats, w):
    return torch.tanh(feats @ w) ** 2 + feats[..., 0] * w[0]


def _summed_grad(feats, mask, w, mode, n_micro, totals):
    w = w.clone().requires_grad_(True)
    total = 0.0
    for f, m in zip(feats.chunk(n_micro), mask.chunk(n_micro)):
        # Trim trailing padding per micro-batch, as dynamic batching would.
        keep = int(m.any(0).nonzero().max()) + 1 if m.any() else 1
        loss = aggregate(_loss_mat(f[:, :keep], w), m[:, :keep], mode, totals, NORM_LEN)
        loss.backward()
        total += loss.item()
    return total, w.grad


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_split_gives_identical_gradient(mode):
    feats, mask, w = _problem(seed=3)
    totals = batch_totals(mask)  # counted once over the whole mini-batch
    loss1, grad1 = _summed_grad(feats, mask, w, mode, 1, totals)
    for n_micro in (2, 4):
        loss_n, grad_n = _summed_grad(feats, mask, w, mode, n_micro, totals)
        assert loss_n == pytest.approx(loss1, abs=1e-12)
        torch.testing.assert_close(grad_n, grad1, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_local_normalisation_would_differ(mode):
    """Guard on the test above: normalising each micro-batch by its own counts is wrong."""
    feats, mask, w = _problem(seed=3)
    _, grad1 = _summed_grad(feats, mask, w, mode, 1, batch_totals(mask))
    w_local = w.clone().requires_grad_(True)
    for f, m in zip(feats.chunk(4), mask.chunk(4)):
        (aggregate(_loss_mat(f, w_local), m, mode) / 4).backward()  # mean of local means
    assert (w_local.grad - grad1).abs().max() > 1e-3


def test_batch_totals():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    totals = batch_totals(mask)
    assert totals.num_tokens.item() == 4 and totals.num_seqs.item() == 2


def test_bad_input():
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "token-sum")
    with pytest.raises(ValueError, match=r"mask \(2, 4\)"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="response_len"):
        batch_totals(torch.ones(3))
    with pytest.raises(ValueError, match="norm_len must be positive, got 0"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm", norm_len=0)
