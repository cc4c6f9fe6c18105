"""Rollout correction: importance weights (TIS, IcePop), rejection (MIS), mismatch metrics.

References are per-unit python loops over plain floats (`naive_*`); hand-computed values
and the limiting cases (rollout = training: every weight 1, nothing rejected) come first.
fp64, tolerance 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_megatron.algorithms.rollout_correction import is_weights, mismatch_metrics, rejection_mask

F64 = torch.float64
TOL = 1e-10


def _batch(seed: int, shape=(5, 7), scale: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    log_ratio = scale * torch.randn(shape, generator=gen, dtype=F64)
    lengths = torch.randint(0, shape[1] + 1, (shape[0],), generator=gen)
    lengths[0] = shape[1]
    mask = (torch.arange(shape[1]) < lengths[:, None]).long()
    return log_ratio, mask


def naive_is_weights(log_ratio, mask, level, threshold, normalize):
    """Weights and metrics one unit (token or sequence) at a time."""
    rows, cols = mask.shape
    units = []  # (row, [cols], ratio)
    for i in range(rows):
        valid = [t for t in range(cols) if mask[i, t]]
        if level == "token":
            units += [(i, [t], math.exp(log_ratio[i, t].item())) for t in valid]
        elif valid:
            units.append((i, valid, math.exp(sum(log_ratio[i, t].item() for t in valid))))
    out = torch.zeros(rows, cols, dtype=F64)
    ws, clipped = [], 0
    for i, positions, rho in units:
        if isinstance(threshold, tuple):
            lo, hi = threshold
            w = rho if lo <= rho <= hi else 0.0
            clipped += not lo <= rho <= hi
        else:
            w = min(rho, threshold)
            clipped += rho > threshold
        ws.append(w)
        for t in positions:
            out[i, t] = w
    mean = sum(ws) / len(ws)
    metrics = {
        "rollout_corr/is_weight_mean": mean,
        "rollout_corr/is_weight_max": max(ws),
        "rollout_corr/is_weight_min": min(ws),
        "rollout_corr/is_clipped_frac": clipped / len(ws),
        "rollout_corr/is_ess": sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws)),
    }
    if normalize:
        out = out / mean
    return out, metrics


def test_weights_are_one_when_rollout_equals_training():
    log_ratio, mask = _batch(0)
    zero = torch.zeros_like(log_ratio)
    for level in ("token", "sequence"):
        for threshold in (2.0, 1.0, (0.5, 2.0), (1.0, 1.5)):
            w, m = is_weights(zero, mask, level, threshold, batch_normalize=True)
            torch.testing.assert_close(w, mask.float(), atol=0, rtol=0)
            assert m["rollout_corr/is_clipped_frac"].item() == 0
            assert m["rollout_corr/is_ess"].item() == pytest.approx(1.0)
        kept, m = rejection_mask(zero, mask, level, 0.5, 2.0)
        assert torch.equal(kept, mask)
        assert m["rollout_corr/rejected_token_frac"].item() == 0


def test_token_weights_hand_computed():
    log_ratio = torch.tensor([[math.log(0.5), math.log(1.5), math.log(3.0), 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = is_weights(log_ratio, mask, "token", 2.0)  # TIS: min(r, 2)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 0.0]]), atol=1e-6, rtol=0)
    assert m["rollout_corr/is_weight_mean"].item() == pytest.approx(4.0 / 3)
    assert m["rollout_corr/is_clipped_frac"].item() == pytest.approx(1 / 3)
    assert m["rollout_corr/is_weight_max"].item() == pytest.approx(2.0)
    assert m["rollout_corr/is_weight_min"].item() == pytest.approx(0.5)
    w, m = is_weights(log_ratio, mask, "token", (0.6, 2.0))  # IcePop: 0 outside the band
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.5, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert m["rollout_corr/is_clipped_frac"].item() == pytest.approx(2 / 3)
    w, _ = is_weights(log_ratio, mask, "token", 2.0, batch_normalize=True)
    torch.testing.assert_close(w, torch.tensor([[0.375, 1.125, 1.5, 0.0]]), atol=1e-6, rtol=0)


def test_sequence_weight_is_the_product_of_token_ratios():
    log_ratio = torch.tensor(
        [[math.log(2.0), math.log(0.75), 0.0], [math.log(4.0), 0.0, 0.0]], dtype=F64
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w, m = is_weights(log_ratio, mask, "sequence", 10.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0], [4.0, 0, 0]]), atol=1e-6, rtol=0)
    assert m["rollout_corr/is_weight_mean"].item() == pytest.approx(2.75)  # per sequence
    w, m = is_weights(log_ratio, mask, "sequence", 1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.2, 0], [1.2, 0, 0]]), atol=1e-6, rtol=0)
    assert m["rollout_corr/is_clipped_frac"].item() == 1.0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.3, (0.6, 1.8)])
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_match_naive(seed, level, threshold, normalize):
    log_ratio, mask = _batch(seed)
    w, m = is_weights(log_ratio, mask, level, threshold, normalize)
    want, want_m = naive_is_weights(log_ratio, mask, level, threshold, normalize)
    torch.testing.assert_close(w.double(), want, atol=1e-6, rtol=1e-6)
    for key, value in want_m.items():
        assert m[key].item() == pytest.approx(value, rel=1e-6), key
    assert not w.requires_grad


def test_weights_ignore_padding_and_stay_finite():
    log_ratio, mask = _batch(3)
    dirty = log_ratio.clone()
    dirty[~mask.bool()] = float("nan")
    w, _ = is_weights(dirty, mask, "sequence", 2.0)
    want, _ = is_weights(log_ratio, mask, "sequence", 2.0)
    assert torch.equal(w, want) and (w[~mask.bool()] == 0).all()
    # A long response's product overflows any float; in log space it is only truncated.
    long = torch.full((1, 2000), 0.5, dtype=torch.float32)
    w, m = is_weights(long, torch.ones(1, 2000), "sequence", 2.0)
    assert torch.isfinite(w).all() and (w == 2.0).all()
    w, _ = is_weights(-long, torch.ones(1, 2000), "sequence", (0.5, 2.0))
    assert (w == 0).all()


def test_weight_arguments_refused():
    x, mask = _batch(0)
    with pytest.raises(ValueError, match="level must be one of token, sequence"):
        is_weights(x, mask, "geometric")
    with pytest.raises(ValueError, match="threshold must be > 0"):
        is_weights(x, mask, "token", 0.0)
    with pytest.raises(ValueError, match="0 <= lower < upper"):
        is_weights(x, mask, "token", (2.0, 1.0))
    with pytest.raises(ValueError, match="must both be"):
        is_weights(x[:, :3], mask, "token")


def test_a_band_from_zero_only_cuts_the_upper_tail():
    # lower = 0 is a legal band: no ratio is below it, however small (log 0 is -inf).
    log_ratio = torch.tensor([[-50.0, math.log(0.1), math.log(3.0), 0.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=torch.long)
    w, m = is_weights(log_ratio, mask, "token", (0.0, 2.0))
    torch.testing.assert_close(
        w.double(), torch.tensor([[math.exp(-50.0), 0.1, 0.0, 1.0]], dtype=F64), atol=0, rtol=1e-6
    )
    assert m["rollout_corr/is_clipped_frac"].item() == pytest.approx(1 / 4)
    kept, m = rejection_mask(log_ratio, mask, "token", 0.0, 2.0)
    assert kept.tolist() == [[1, 1, 0, 1]]
    assert m["rollout_corr/rejected_token_frac"].item() == pytest.approx(1 / 4)
    for band in ((1.0, 1.0), (-0.1, 2.0)):
        with pytest.raises(ValueError, match="0 <= lower < upper"):
            is_weights(log_ratio, mask, "token", band)
        with pytest.raises(ValueError, match="0 <= lower < upper"):
            rejection_mask(log_ratio, mask, "token", *band)


def test_weights_of_a_batch_with_every_unit_outside_the_band():
    # All weights 0: normalising by their mean (0) must not divide by it; the metrics say
    # what happened (every unit clipped, mean 0) and stay finite.
    log_ratio = torch.tensor([[math.log(5.0), math.log(0.1)], [math.log(4.0), 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    w, m = is_weights(log_ratio, mask, "token", (0.5, 2.0), batch_normalize=True)
    assert (w == 0).all()
    assert m["rollout_corr/is_clipped_frac"].item() == 1.0
    assert m["rollout_corr/is_weight_mean"].item() == 0.0
    assert m["rollout_corr/is_weight_max"].item() == 0.0
    assert m["rollout_corr/is_ess"].item() == 1.0  # all weights equal (to 0)


def test_weight_metrics_of_an_all_padding_batch_are_zero():
    # No unit at all (a replica whose rows are all padding): the extremes are 0, not the
    # +-float max used as the identity of the max over units and replicas.
    log_ratio, _ = _batch(0)
    for level in ("token", "sequence"):
        w, m = is_weights(log_ratio, torch.zeros_like(log_ratio, dtype=torch.long), level, 2.0)
        assert (w == 0).all()
        for key in ("is_weight_mean", "is_weight_max", "is_weight_min", "is_clipped_frac"):
            assert m[f"rollout_corr/{key}"].item() == 0.0, (level, key)


def test_rejection_hand_computed():
    log_ratio = torch.tensor(
        [[math.log(0.4), 0.0, math.log(3.0)], [math.log(1.5), math.log(1.5), 0.0]], dtype=F64
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kept, m = rejection_mask(log_ratio, mask, "token", 0.5, 2.0)
    assert kept.tolist() == [[0, 1, 0], [1, 1, 0]] and kept.dtype == mask.dtype
    assert m["rollout_corr/rejected_token_frac"].item() == pytest.approx(2 / 5)
    assert m["rollout_corr/rejected_seq_frac"].item() == pytest.approx(1 / 2)
    # Sequence level: row 0's product 1.2 is inside; row 1's 2.25 is not.
    kept, m = rejection_mask(log_ratio, mask, "sequence", 0.5, 2.0)
    assert kept.tolist() == [[1, 1, 1], [0, 0, 0]]
    assert m["rollout_corr/rejected_token_frac"].item() == pytest.approx(2 / 5)
    assert m["rollout_corr/rejected_seq_frac"].item() == pytest.approx(1 / 2)
    with pytest.raises(ValueError, match="0 <= lower < upper"):
        rejection_mask(log_ratio, mask, "token", 2.0, 0.5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rejection_matches_naive(seed, level):
    log_ratio, mask = _batch(seed)
    kept, _ = rejection_mask(log_ratio, mask, level, 0.7, 1.5)
    for i in range(mask.shape[0]):
        seq = math.exp(sum(log_ratio[i, t].item() for t in range(mask.shape[1]) if mask[i, t]))
        for t in range(mask.shape[1]):
            rho = math.exp(log_ratio[i, t].item()) if level == "token" else seq
            assert kept[i, t].item() == int(bool(mask[i, t]) and 0.7 <= rho <= 1.5), (i, t)


def test_mismatch_metrics_hand_computed():
    engine = torch.tensor([[-1.0, -2.0, -50.0]])
    trainer = torch.tensor([[-1.5, -2.0, 0.0]])  # d = log pi - log mu = [-0.5, 0, masked]
    m = mismatch_metrics(engine, trainer, torch.tensor([[1, 1, 0]]))
    assert m["rollout/logprob_diff_mean"].item() == pytest.approx(0.25)
    assert m["rollout/logprob_diff_max"].item() == pytest.approx(0.5)
    assert m["rollout/prob_ratio_mean"].item() == pytest.approx((math.exp(-0.5) + 1) / 2)
    assert m["rollout/mismatch_kl_k1"].item() == pytest.approx(0.25)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert m["rollout/mismatch_kl_k3"].item() == pytest.approx(k3 / 2)
    same = mismatch_metrics(trainer, trainer, torch.ones(1, 3))
    assert all(same[k].item() == 0 for k in same if "ratio" not in k)
    assert same["rollout/prob_ratio_mean"].item() == 1.0
    mask = torch.ones(1, 3)
    for rollout, recomputed in ((engine[:, :2], trainer), (engine, trainer[:, :2])):
        with pytest.raises(ValueError, match="must all be"):
            mismatch_metrics(rollout, recomputed, mask)
