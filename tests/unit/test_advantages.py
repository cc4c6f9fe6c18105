"""Advantage estimators against hand-computed cases and naive python-loop references.

All in fp64; tolerance 1e-10 where only the order of floating-point operations differs.
Property checks run over several seeds instead of `hypothesis` (not installed).
Whitening across 2 DP ranks is tested in tests/multirank.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rl_megatron.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    gae,
    grpo,
    masked_whiten,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)

F64 = torch.float64
TOL = 1e-10
SEEDS = range(5)


# ----------------------------------------------------------------------------- references


def naive_gae(rewards, values, mask, gamma, lam):
    """GAE on the trajectory made of the valid tokens only, one row at a time."""
    adv = [[0.0] * len(r) for r in rewards]
    for i in range(len(rewards)):
        steps = [t for t in range(len(rewards[i])) if mask[i][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i][t]
            adv[i][t] = next_adv
    ret = [
        [a + v if m else 0.0 for a, v, m in zip(ra, rv, rm)]
        for ra, rv, rm in zip(adv, values, mask)
    ]
    return adv, ret


def naive_whiten(x, mask, eps=1e-8):
    vals = [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m]
    mean = statistics.fmean(vals)
    std = math.sqrt(statistics.variance(vals) + eps)  # unbiased
    return [
        [(v - mean) / std if m else 0.0 for v, m in zip(row, mrow)] for row, mrow in zip(x, mask)
    ]


def groups_of(group_index):
    groups = {}
    for i, g in enumerate(group_index):
        groups.setdefault(g, []).append(i)
    return groups


def random_batch(seed, batch=6, length=7):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=F64)
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).long()
    mask[0] = torch.tensor([1, 0, 0, 1, 1, 0, 1])  # holes inside a response
    mask[1] = 0  # an all-masked sequence
    return rewards, values, mask


def to_list(t):
    return t.tolist()


# ----------------------------------------------------------------------------- GAE


def test_gae_hand_computed_with_a_masked_hole():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 5.0, 1.0]], dtype=F64)  # the 5.0 sits on a masked token
    values = torch.tensor([[0.5, 0.2, 0.4]], dtype=F64)
    mask = torch.tensor([[1, 0, 1]])
    # Valid steps are t=0 and t=2; t=1 is skipped, so t=0 bootstraps from V_2.
    delta2 = 1.0 + gamma * 0.0 - 0.4  # terminal after t=2: 0.6
    a2 = delta2  # 0.6
    delta0 = 0.0 + gamma * 0.4 - 0.5  # -0.14
    a0 = delta0 + gamma * lam * a2  # -0.14 + 0.72 * 0.6 = 0.292
    adv, ret = gae(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[a0, 0.0, a2]], dtype=F64), atol=TOL, rtol=0)
    torch.testing.assert_close(
        ret, torch.tensor([[a0 + 0.5, 0.0, 1.0]], dtype=F64), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_naive(seed):
    rewards, values, mask = random_batch(seed)
    gamma, lam = 0.7 + 0.05 * seed, 0.9 - 0.1 * seed
    adv, ret = gae(rewards, values, mask, gamma, lam, whiten=False)
    want_adv, want_ret = naive_gae(to_list(rewards), to_list(values), to_list(mask), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=F64), atol=TOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=F64), atol=TOL, rtol=0)
    assert (adv[1] == 0).all() and (ret[1] == 0).all()  # the all-masked sequence


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_gamma_lam_one_is_return_minus_value(seed):
    rewards, values, mask = random_batch(seed)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0, whiten=False)
    for i in range(rewards.shape[0]):
        for t in range(rewards.shape[1]):
            if mask[i, t]:
                future = sum(rewards[i, k].item() for k in range(t, rewards.shape[1]) if mask[i, k])
                assert adv[i, t].item() == pytest.approx(future - values[i, t].item(), abs=TOL)
                assert ret[i, t].item() == pytest.approx(future, abs=TOL)


def test_gae_whitened_matches_naive_whitening():
    rewards, values, mask = random_batch(7)
    raw, _ = gae(rewards, values, mask, 0.95, 0.9, whiten=False)
    white, _ = gae(rewards, values, mask, 0.95, 0.9)
    want = naive_whiten(to_list(raw), to_list(mask))
    torch.testing.assert_close(white, torch.tensor(want, dtype=F64), atol=TOL, rtol=0)


def test_gae_bad_input():
    rewards, values, mask = random_batch(0)
    with pytest.raises(ValueError, match="response_mask"):
        gae(rewards, values, mask[:, :-1], 1.0, 1.0)
    with pytest.raises(ValueError, match="values has shape"):
        gae(rewards, values[:-1], mask, 1.0, 1.0)
    bad = rewards.clone()
    bad[0, 0] = float("nan")  # mask[0, 0] = 1
    with pytest.raises(ValueError, match="token_rewards holds NaN"):
        gae(bad, values, mask, 1.0, 1.0)
    # NaN on a masked token is ignored: same result as a 0 there.
    bad = rewards.clone()
    bad[0, 1] = float("nan")  # mask[0, 1] = 0
    torch.testing.assert_close(
        gae(bad, values, mask, 0.9, 0.9)[0], gae(rewards, values, mask, 0.9, 0.9)[0]
    )
    with pytest.raises(ValueError, match="no valid token"):
        gae(rewards, values, torch.zeros_like(mask), 1.0, 1.0)  # nothing to whiten
    adv, ret = gae(rewards, values, torch.zeros_like(mask), 1.0, 1.0, whiten=False)
    assert (adv == 0).all() and (ret == 0).all()


# ----------------------------------------------------------------------------- GRPO / RLOO


def test_grpo_hand_computed():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=F64)
    group_index = torch.tensor([7, 7, 7, 3])  # sample 3 is a group of one
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    # group 7: mean 2/3; unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3
    std = math.sqrt(1 / 3)
    a_one, a_zero = (1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6)
    want = torch.tensor([[a_one, a_one], [a_zero, 0.0], [a_one, a_one], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grpo(scores, group_index, mask), want, atol=TOL, rtol=0)
    want_nostd = torch.tensor([[1 / 3] * 2, [-2 / 3, 0], [1 / 3] * 2, [0, 0]], dtype=F64)
    torch.testing.assert_close(grpo(scores, group_index, mask, norm_by_std=False), want_nostd)


def _random_groups(seed, batch=12):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, generator=gen, dtype=F64)
    # Non-contiguous ids, uneven group sizes, one singleton group (id 99).
    group_index = torch.tensor([5, 2, 5, 9, 2, 5, 9, 2, 99, 9, 5, 2])[:batch]
    mask = (torch.rand(batch, 4, generator=gen) > 0.2).long()
    mask[:, 0] = 1
    return scores, group_index, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_naive_and_has_zero_group_mean(seed, norm_by_std):
    scores, group_index, mask = _random_groups(seed)
    adv = grpo(scores, group_index, mask, norm_by_std=norm_by_std, eps=1e-6)
    for members in groups_of(group_index.tolist()).values():
        s = [scores[i].item() for i in members]
        mean = statistics.fmean(s)
        std = statistics.stdev(s) if len(s) > 1 else 1.0
        for i in members:
            want = (
                (scores[i].item() - mean) / (std + 1e-6) if norm_by_std else scores[i].item() - mean
            )
            want = want if len(s) > 1 else 0.0
            assert adv[i, 0].item() == pytest.approx(want, abs=TOL)
            assert torch.allclose(adv[i], want * mask[i].to(F64), atol=TOL)
        assert abs(sum(adv[i, 0].item() for i in members)) < TOL  # zero mean per group


def test_grpo_equal_scores_in_group_give_zero_not_nan():
    adv = grpo(torch.ones(4, dtype=F64), torch.zeros(4, dtype=torch.long), torch.ones(4, 3))
    assert (adv == 0).all()


def test_rloo_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
    group_index = torch.tensor([0, 0, 0, 1])
    mask = torch.ones(4, 1)
    # baseline of sample 0 = mean of the others = (0 + 0.5) / 2 = 0.25
    want = torch.tensor([[1 - 0.25], [0 - 0.75], [0.5 - 0.5], [0.0]], dtype=F64)
    torch.testing.assert_close(rloo(scores, group_index, mask), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_leave_one_out_and_closed_form(seed):
    scores, group_index, mask = _random_groups(seed)
    adv = rloo(scores, group_index, mask)
    for members in groups_of(group_index.tolist()).values():
        n = len(members)
        mean = statistics.fmean(scores[i].item() for i in members)
        for i in members:
            others = [scores[j].item() for j in members if j != i]
            loo = scores[i].item() - statistics.fmean(others) if others else 0.0
            closed = n / (n - 1) * (scores[i].item() - mean) if n > 1 else 0.0
            assert adv[i, 0].item() == pytest.approx(loo, abs=TOL)
            assert adv[i, 0].item() == pytest.approx(closed, abs=TOL)
            assert torch.allclose(adv[i], loo * mask[i].to(F64), atol=TOL)


def test_outcome_estimators_bad_input():
    scores, group_index, mask = _random_groups(0)
    for fn in (grpo, rloo, reinforce_plus_plus_baseline):
        with pytest.raises(ValueError, match="scores must be"):
            fn(scores[:-1], group_index, mask)
        with pytest.raises(ValueError, match="group_index must be"):
            fn(scores, group_index[:-1], mask)
        with pytest.raises(ValueError, match="integer prompt ids"):
            fn(scores, group_index.double(), mask)
        with pytest.raises(ValueError, match="response_mask must be"):
            fn(scores, group_index, mask[0])
        bad = scores.clone()
        bad[3] = float("nan")
        with pytest.raises(ValueError, match="scores holds NaN"):
            fn(bad, group_index, mask)
    # An all-masked sample gets zeros, the others are unchanged.
    mask2 = mask.clone()
    mask2[4] = 0
    a, b = grpo(scores, group_index, mask), grpo(scores, group_index, mask2)
    assert (b[4] == 0).all()
    torch.testing.assert_close(a[torch.arange(12) != 4], b[torch.arange(12) != 4])


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_hand_computed_returns():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma = 0.5: row 0 -> [0.25, 0.5, 1]; row 1 -> [1, 2, (masked) 0]
    adv, ret = reinforce_plus_plus(rewards, mask, 0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], dtype=F64))
    vals = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean, std = statistics.fmean(vals), math.sqrt(statistics.variance(vals) + 1e-8)
    want = [[(v - mean) / std for v in vals[:3]], [(v - mean) / std for v in vals[3:]] + [0.0]]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=F64), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_matches_naive(seed):
    rewards, _, mask = random_batch(seed)
    gamma = 0.9
    adv, ret = reinforce_plus_plus(rewards, mask, gamma)
    want_ret = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for i in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:  # masked steps are skipped, not discounted
                g = rewards[i, t].item() + gamma * g
                want_ret[i][t] = g
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=F64), atol=TOL, rtol=0)
    want_adv = naive_whiten(want_ret, to_list(mask))
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=F64), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_naive(seed):
    scores, group_index, mask = _random_groups(seed)
    adv = reinforce_plus_plus_baseline(scores, group_index, mask)
    groups = groups_of(group_index.tolist())
    centred = []
    for i in range(len(scores)):
        members = next(m for m in groups.values() if i in m)
        mean = statistics.fmean(scores[j].item() for j in members)
        centred.append([scores[i].item() - mean] * mask.shape[1])
    want = naive_whiten(centred, to_list(mask))
    torch.testing.assert_close(adv, torch.tensor(want, dtype=F64), atol=TOL, rtol=0)


def test_masked_whiten_without_shift_keeps_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    vals = [1.0, 2.0, 4.0]
    mean, std = statistics.fmean(vals), math.sqrt(statistics.variance(vals) + 1e-8)
    got = masked_whiten(x, mask, shift_mean=False)
    want = [[(1 - mean) / std + mean, (2 - mean) / std + mean, 0], [(4 - mean) / std + mean, 0, 0]]
    torch.testing.assert_close(got, torch.tensor(want, dtype=F64), atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- dispatch


def test_compute_advantages_dispatch():
    _, values, mask = random_batch(2, batch=12, length=7)
    mask[1] = 1
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 7, generator=gen, dtype=F64)
    group_index = _random_groups(0)[1]
    scores = torch.where(mask.bool(), rewards, 0.0).sum(-1)
    expected = {
        "gae": gae(rewards, values, mask, 0.9, 0.8),
        "grpo": (grpo(scores, group_index, mask),) * 2,
        "rloo": (rloo(scores, group_index, mask),) * 2,
        "reinforce_plus_plus": reinforce_plus_plus(rewards, mask, 0.9),
        "reinforce_plus_plus_baseline": (reinforce_plus_plus_baseline(scores, group_index, mask),)
        * 2,
    }
    assert set(expected) == set(ADV_ESTIMATORS)
    for name, (want_adv, want_ret) in expected.items():
        adv, ret = compute_advantages(name, rewards, mask, values, group_index, gamma=0.9, lam=0.8)
        torch.testing.assert_close(adv, want_adv, atol=TOL, rtol=0)
        torch.testing.assert_close(ret, want_ret, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="adv_estimator must be one of"):
        compute_advantages("ppo", rewards, mask)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", rewards, mask)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", rewards, mask)
