"""Policy loss (clip-higher, dual clip), value loss, entropy bonus and explained variance.

References are per-token python scalar loops; gradients of the reference come from
autograd through those scalar loops. fp64, tolerance 1e-10 (operation order only).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rl_megatron.algorithms.aggregation import batch_totals
from rl_megatron.algorithms.losses import (
    aggregate,
    entropy_bonus,
    explained_variance,
    kl,
    policy_loss,
    value_loss,
)

F64 = torch.float64
TOL = 1e-10


def naive_policy_loss(log_prob, old_log_prob, adv, mask, low, high, c):
    """Token-mean of the per-token PPO loss, written one scalar at a time."""
    terms = []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(log_prob[i, t] - old_log_prob[i, t])
            a = adv[i, t].item()
            surrogate = max(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))
            if c is not None and a < 0:
                surrogate = min(surrogate, torch.tensor(-a * c, dtype=F64))
            terms.append(surrogate)
    return sum(terms) / len(terms)


def _policy_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (5, 6)
    old = torch.randn(shape, generator=gen, dtype=F64) - 2
    # Log-ratios up to +-1.2 so every clipping regime occurs.
    log_prob = old + 1.2 * (2 * torch.rand(shape, generator=gen, dtype=F64) - 1)
    adv = torch.randn(shape, generator=gen, dtype=F64)
    mask = (torch.rand(shape, generator=gen) > 0.25).long()
    return log_prob, old, adv, mask


def test_policy_loss_hand_computed():
    ratios = torch.tensor([[1.5, 0.5, 5.0, 1.1]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=F64)
    old = torch.full((1, 4), -1.0, dtype=F64)
    log_prob = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones(1, 4)
    # low 0.2, high 0.28, c 3:
    # t0: A=+1, r=1.5: max(-1.5, -1.28) = -1.28   upper clip, no gradient
    # t1: A=-1, r=0.5: max(0.5, 0.8)    = 0.8     lower clip, no gradient
    # t2: A=-1, r=5:   max(5, 1.28) = 5 -> min(5, 3) = 3   dual clip, no gradient
    # t3: A=+2, r=1.1: max(-2.2, -2.2)  = -2.2    inside, d/dlogp = -A r = -2.2
    loss, m = policy_loss(log_prob, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 3.0 - 2.2) / 4, abs=TOL)
    loss.backward()
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([[0.0, 0.0, 0.0, -2.2 / 4]], dtype=F64), atol=TOL, rtol=0
    )
    assert m["actor/pg_clipfrac_upper"].item() == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac_dual"].item() == pytest.approx(1 / 4)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert m["actor/pg_loss"].item() == pytest.approx(loss.item())
    # ppo_kl = mean(old - new) = -mean(log r)
    assert m["actor/ppo_kl"].item() == pytest.approx(
        -sum(math.log(r) for r in [1.5, 0.5, 5, 1.1]) / 4
    )


def test_clip_higher_is_asymmetric():
    # r = 1.25 with A > 0 and r = 0.75 with A < 0: symmetric eps 0.2 clips both;
    # clip-higher (low 0.2, high 0.28) clips only the lower one.
    ratios = torch.tensor([[1.25, 0.75]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    old = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2)
    _, sym = policy_loss(ratios.log(), old, adv, mask, 0.2, 0.2)
    assert sym["actor/pg_clipfrac_upper"].item() == 0.5
    assert sym["actor/pg_clipfrac_lower"].item() == 0.5
    loss, asym = policy_loss(ratios.log(), old, adv, mask, 0.2, 0.28)
    assert asym["actor/pg_clipfrac_upper"].item() == 0.0
    assert asym["actor/pg_clipfrac_lower"].item() == 0.5
    # t0 unclipped: -1 * 1.25; t1 clipped at 0.8: -(-1) * 0.8
    assert loss.item() == pytest.approx((-1.25 + 0.8) / 2, abs=TOL)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip_ratio_c", [None, 1.5])
def test_policy_loss_matches_naive_value_and_gradient(seed, clip_ratio_c):
    log_prob, old, adv, mask = _policy_batch(seed)
    lp_a = log_prob.clone().requires_grad_(True)
    lp_b = log_prob.clone().requires_grad_(True)
    loss, m = policy_loss(lp_a, old, adv, mask, 0.2, 0.28, clip_ratio_c)
    want = naive_policy_loss(lp_b, old, adv, mask, 0.2, 0.28, clip_ratio_c)
    assert loss.item() == pytest.approx(want.item(), abs=TOL)
    loss.backward()
    want.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, atol=TOL, rtol=0)
    # Fractions, counted the naive way.
    r = (log_prob - old).exp()
    valid = mask.bool()
    n = valid.sum().item()
    upper = ((adv > 0) & (r > 1.28) & valid).sum().item() / n
    lower = ((adv < 0) & (r < 0.8) & valid).sum().item() / n
    assert m["actor/pg_clipfrac_upper"].item() == pytest.approx(upper)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(lower)
    if clip_ratio_c is not None:
        dual = ((adv < 0) & (r > clip_ratio_c) & valid).sum().item() / n
        assert m["actor/pg_clipfrac_dual"].item() == pytest.approx(dual)
        assert dual > 0  # the batch must exercise the dual clip
    assert upper > 0 and lower > 0


def test_policy_loss_ignores_garbage_at_masked_positions():
    log_prob, old, adv, mask = _policy_batch(0)
    lp_clean = log_prob.clone().requires_grad_(True)
    lp_dirty = log_prob.clone()
    lp_dirty[~mask.bool()] = float("-inf")  # what padding often holds
    lp_dirty.requires_grad_(True)
    old_dirty = old.clone()
    old_dirty[~mask.bool()] = float("nan")
    clean, _ = policy_loss(lp_clean, old, adv, mask, 0.2, 0.2, 3.0)
    dirty, _ = policy_loss(lp_dirty, old_dirty, adv, mask, 0.2, 0.2, 3.0)
    clean.backward()
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item(), abs=TOL)
    torch.testing.assert_close(lp_dirty.grad, lp_clean.grad)
    assert (lp_dirty.grad[~mask.bool()] == 0).all()


def test_policy_loss_all_masked_is_zero_with_zero_grad():
    log_prob, old, adv, _ = _policy_batch(1)
    log_prob.requires_grad_(True)
    loss, m = policy_loss(log_prob, old, adv, torch.zeros(5, 6), 0.2, 0.2)
    loss.backward()
    assert loss.item() == 0.0 and (log_prob.grad == 0).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_tokens_without_advantage_are_never_counted_as_clipped():
    # A = 0 makes both surrogates 0: no clip is active, whatever the ratio (the fractions
    # count where the clip changes the loss, as PPO's and verl's pg_clipfrac do).
    ratios = torch.tensor([[2.0, 0.25, 5.0, 1.0]], dtype=F64)
    adv = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64)
    old = torch.zeros(1, 4, dtype=F64)
    _, m = policy_loss(ratios.log(), old, adv, torch.ones(1, 4), 0.2, 0.28, clip_ratio_c=3.0)
    for key in ("pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "pg_clipfrac_dual"):
        assert m[f"actor/{key}"].item() == 0.0, key


def test_clip_ratios_of_zero_are_accepted():
    # eps = 0 pins the clipped ratio at 1 (a legal, if odd, setting); only negatives are refused.
    log_prob, old, adv, mask = _policy_batch(0)
    loss, _ = policy_loss(log_prob, old, adv, mask, 0.0, 0.0)
    want = naive_policy_loss(log_prob, old, adv, mask, 0.0, 0.0, None)
    assert loss.item() == pytest.approx(want.item(), abs=TOL)
    with pytest.raises(ValueError, match=">= 0"):
        policy_loss(log_prob, old, adv, mask, 0.2, -1e-9)


def test_policy_loss_bad_input():
    log_prob, old, adv, mask = _policy_batch(0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(log_prob, old, adv, mask, 0.2, 0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(log_prob, old, adv[:, :-1], mask, 0.2, 0.2)
    with pytest.raises(ValueError, match="response_mask must be"):
        policy_loss(log_prob, old, adv, mask[0], 0.2, 0.2)
    with pytest.raises(ValueError, match=">= 0"):
        policy_loss(log_prob, old, adv, mask, -0.1, 0.2)


def test_policy_loss_other_agg_mode_and_totals_pass_through():
    log_prob, old, adv, mask = _policy_batch(2)
    loss, _ = policy_loss(log_prob, old, adv, mask, 0.2, 0.2, agg_mode="seq-mean-token-sum")
    r = (log_prob - old).exp()
    per_token = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    assert loss.item() == pytest.approx(aggregate(per_token, mask, "seq-mean-token-sum").item())


# ------------------------------------------------- GSPO, CISPO and rollout IS weights


def naive_gspo_sequence_loss(log_prob, old_log_prob, adv, mask, low, high):
    """GSPO's sequence objective (arXiv 2507.18071, eq. 5-7) with seq-mean-token-mean, one
    sequence at a time and without any stop-gradient: s_i = exp(mean_t log r_t) is a
    function of every token's log-prob, and the sequence's loss is max(-A s, -A clip(s))."""
    terms = []
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not valid:
            continue
        s = torch.exp(sum(log_prob[i, t] - old_log_prob[i, t] for t in valid) / len(valid))
        a = adv[i, valid[0]].item()  # GRPO's advantage: one per sequence
        terms.append(max(-a * s, -a * torch.clamp(s, 1 - low, 1 + high)))
    return sum(terms) / len(terms)


def _sequence_advantages(seed, shape=(5, 6)):
    log_prob, old, adv, mask = _policy_batch(seed)
    adv = adv[:, :1].expand(shape).clone()  # one advantage per sequence, as GRPO's
    mask[:, 0] = 1
    return log_prob, old, adv, mask


@pytest.mark.parametrize("seed", range(4))
def test_gspo_matches_the_sequence_objective(seed):
    # GSPO-token with its stop-gradients equals the paper's sequence objective in value and
    # gradient when the advantage is per sequence (eq. 13-14 vs eq. 5-7).
    log_prob, old, adv, mask = _sequence_advantages(seed)
    old = log_prob + 0.05 * (old - log_prob)  # sequence ratios near 1, some clipped
    lp_a = log_prob.clone().requires_grad_(True)
    lp_b = log_prob.clone().requires_grad_(True)
    loss, m = policy_loss(
        lp_a, old, adv, mask, 3e-3, 4e-3, 3.0, "seq-mean-token-mean", loss_mode="gspo"
    )  # the paper's clip range (§5.1)
    want = naive_gspo_sequence_loss(lp_b, old, adv, mask, 3e-3, 4e-3)
    assert loss.item() == pytest.approx(want.item(), abs=TOL)
    loss.backward()
    want.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, atol=TOL, rtol=0)
    assert 0 < m["actor/pg_clipfrac"].item() < 1  # both regimes occur
    assert m["actor/pg_clipfrac_dual"].item() == 0  # GSPO has no dual clip


def test_gspo_equals_vanilla_when_token_ratios_are_equal():
    log_prob, old, adv, mask = _sequence_advantages(5)
    # Every token of row i has the same log-ratio c_i: s_i = r_i,t, so the losses agree.
    c = torch.tensor([0.3, -0.5, 0.05, 0.1, -0.02], dtype=F64)[:, None]
    old = log_prob - c
    grads = []
    losses = []
    for mode in ("vanilla", "gspo"):
        lp = log_prob.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, None, loss_mode=mode)
        loss.backward()
        losses.append(loss.item())
        grads.append(lp.grad)
    assert losses[0] == pytest.approx(losses[1], abs=TOL)
    torch.testing.assert_close(grads[0], grads[1], atol=TOL, rtol=0)


def test_gspo_clamps_the_sequence_log_ratio_at_10():
    log_prob = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    old = torch.full((1, 3), -30.0, dtype=F64)  # mean log-ratio 30
    adv = torch.full((1, 3), -1.0, dtype=F64)
    loss, _ = policy_loss(log_prob, old, adv, torch.ones(1, 3), 0.2, 0.2, loss_mode="gspo")
    assert loss.item() == pytest.approx(math.exp(10.0))  # -A exp(10), finite
    loss.backward()
    assert (log_prob.grad == 0).all()  # beyond the clamp: no gradient


@pytest.mark.parametrize("seed", range(4))
def test_cispo_gradient_flows_only_through_log_prob(seed):
    log_prob, old, adv, mask = _policy_batch(seed)
    lp = log_prob.clone().requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask, 0.2, 0.28, 3.0, loss_mode="cispo")
    loss.backward()
    valid = mask.bool()
    n = valid.sum().item()
    # L = -sum sg(clip(r)) A log pi / N: d L / d log pi = -clip(r) A / N, with r a constant.
    weight = (log_prob - old).exp().clamp(0.8, 1.28)
    want_grad = torch.where(valid, -weight * adv / n, 0.0)
    torch.testing.assert_close(lp.grad, want_grad, atol=TOL, rtol=0)
    want = sum(
        (-weight[i, t] * adv[i, t] * log_prob[i, t]).item()
        for i in range(5)
        for t in range(6)
        if mask[i, t]
    )
    assert loss.item() == pytest.approx(want / n, abs=TOL)
    # Tokens PPO's clip would silence keep their (bounded) gradient here.
    r = (log_prob - old).exp()
    silenced = valid & (adv > 0) & (r > 1.28)
    assert silenced.any() and (lp.grad[silenced] != 0).all()
    upper = (valid & (r > 1.28)).sum().item() / n
    lower = (valid & (r < 0.8)).sum().item() / n
    assert upper > 0 and lower > 0  # both of the weight's clips engage in this batch
    assert m["actor/pg_clipfrac_upper"].item() == pytest.approx(upper)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(lower)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(upper + lower)


def test_cispo_gradient_equals_ppo_at_the_start_of_a_step():
    # At log_prob = old_log_prob (the first mini-batch), r = 1: both are REINFORCE's -A grad.
    log_prob, _, adv, mask = _policy_batch(6)
    grads = []
    for mode in ("vanilla", "cispo"):
        lp = log_prob.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, log_prob, adv, mask, 0.2, 0.2, loss_mode=mode)
        loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=TOL, rtol=0)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_rollout_is_weights_scale_each_rows_loss(mode):
    # One weight per row: the weighted loss is the weighted sum of the rows' own losses
    # (each a share of the whole batch's token count), in value and gradient.
    log_prob, old, adv, mask = _sequence_advantages(7)
    totals = batch_totals(mask)
    row_w = torch.tensor([0.5, 1.5, 0.0, 2.0, 1.0], dtype=F64)
    weights = row_w[:, None].expand(5, 6).clone()
    weights[~mask.bool()] = float("nan")  # padding is ignored
    weights.requires_grad_(True)  # and nothing flows into the weights
    lp_a = log_prob.clone().requires_grad_(True)
    loss, _ = policy_loss(
        lp_a, old, adv, mask, 0.2, 0.28, 3.0, loss_mode=mode, rollout_is_weights=weights
    )
    lp_b = log_prob.clone().requires_grad_(True)
    want = 0.0
    for i in range(5):
        only = torch.zeros_like(mask)
        only[i] = mask[i]
        part, _ = policy_loss(lp_b, old, adv, only, 0.2, 0.28, 3.0, totals=totals, loss_mode=mode)
        want = want + row_w[i] * part
    assert loss.item() == pytest.approx(want.item(), abs=TOL)
    loss.backward()
    want.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, atol=TOL, rtol=0)
    assert weights.grad is None
    # Weights of 1 change nothing.
    plain, _ = policy_loss(log_prob, old, adv, mask, 0.2, 0.28, 3.0, loss_mode=mode)
    ones, _ = policy_loss(
        log_prob,
        old,
        adv,
        mask,
        0.2,
        0.28,
        3.0,
        loss_mode=mode,
        rollout_is_weights=torch.ones(5, 6, dtype=F64),
    )
    assert ones.item() == plain.item()


@pytest.mark.parametrize("mode", ["vanilla", "cispo"])
def test_rollout_is_weights_match_naive(mode):
    log_prob, old, adv, mask = _policy_batch(8)
    w = 0.5 + torch.rand(5, 6, generator=torch.Generator().manual_seed(2), dtype=F64)
    lp_a = log_prob.clone().requires_grad_(True)
    loss, _ = policy_loss(
        lp_a, old, adv, mask, 0.2, 0.28, None, loss_mode=mode, rollout_is_weights=w
    )
    lp_b = log_prob.clone().requires_grad_(True)
    terms = []
    for i in range(5):
        for t in range(6):
            if not mask[i, t]:
                continue
            r = torch.exp(lp_b[i, t] - old[i, t])
            a = adv[i, t].item()
            if mode == "vanilla":
                term = max(-a * r, -a * torch.clamp(r, 0.8, 1.28))
            else:
                term = -torch.clamp(r.detach(), 0.8, 1.28) * a * lp_b[i, t]
            terms.append(w[i, t].item() * term)
    want = sum(terms) / len(terms)
    assert loss.item() == pytest.approx(want.item(), abs=TOL)
    loss.backward()
    want.backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, atol=TOL, rtol=0)


def test_policy_loss_refuses_an_unknown_mode_and_misshapen_weights():
    log_prob, old, adv, mask = _policy_batch(0)
    with pytest.raises(ValueError, match="loss_mode must be one of vanilla, gspo, cispo"):
        policy_loss(log_prob, old, adv, mask, 0.2, 0.2, loss_mode="grpo")
    with pytest.raises(ValueError, match="rollout_is_weights has shape"):
        policy_loss(log_prob, old, adv, mask, 0.2, 0.2, rollout_is_weights=adv[:, :2])


# ----------------------------------------------------------------------------- value loss


def test_value_loss_hand_computed():
    values = torch.tensor([[1.5, 1.1, 0.5]], dtype=F64, requires_grad=True)
    old = torch.ones(1, 3, dtype=F64)
    returns = torch.tensor([[2.0, 0.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 3)
    # cliprange 0.2:
    # t0: v_clip = 1.2; (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> 0.64, clipped, no gradient
    # t1: v_clip = 1.1 = v; (1.1-0)^2 = 1.21 both          -> 1.21
    # t2: v_clip = 0.8; (0.5-2)^2 = 2.25 > (0.8-2)^2 = 1.44 -> 2.25, unclipped
    loss, m = value_loss(values, old, returns, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21 + 2.25) / 3, abs=TOL)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dv 0.5 * (v - R)^2 / 3 = (v - R) / 3
    want = torch.tensor([[0.0, 1.1 / 3, -1.5 / 3]], dtype=F64)
    torch.testing.assert_close(values.grad, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cliprange", [None, 0.1])
def test_value_loss_matches_naive(seed, cliprange):
    gen = torch.Generator().manual_seed(seed)
    values, old, returns = torch.randn(3, 4, 5, generator=gen, dtype=F64).unbind()
    mask = (torch.rand(4, 5, generator=gen) > 0.3).long()
    va = values.clone().requires_grad_(True)
    vb = values.clone().requires_grad_(True)
    loss, m = value_loss(va, old, returns, mask, cliprange)
    terms, clipped = [], 0
    for i in range(4):
        for t in range(5):
            if mask[i, t]:
                err = (vb[i, t] - returns[i, t]) ** 2
                if cliprange is not None:
                    v_clip = old[i, t] + torch.clamp(vb[i, t] - old[i, t], -cliprange, cliprange)
                    err_clip = (v_clip - returns[i, t]) ** 2
                    clipped += int(err_clip > err)
                    err = max(err, err_clip)
                terms.append(err)
    want = 0.5 * sum(terms) / len(terms)
    assert loss.item() == pytest.approx(want.item(), abs=TOL)
    loss.backward()
    want.backward()
    torch.testing.assert_close(va.grad, vb.grad, atol=TOL, rtol=0)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(clipped / len(terms))
    if cliprange is not None:
        assert clipped > 0
    vpred = [values[i, t].item() for i in range(4) for t in range(5) if mask[i, t]]
    assert m["critic/vpred_mean"].item() == pytest.approx(statistics.fmean(vpred), abs=TOL)


def test_value_clip_counts_where_v_left_the_range_around_old_values():
    # V = -1 with old values 1 has left the range by 2 (V + old would be 0: inside);
    # R = -1 makes the clipped error the larger one: clipped, and no gradient.
    values = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    loss, m = value_loss(
        values, torch.ones(1, 1, dtype=F64), -torch.ones(1, 1, dtype=F64), torch.ones(1, 1), 0.2
    )
    assert loss.item() == pytest.approx(0.5 * 1.8**2, abs=TOL)  # V_clip = 0.8
    assert m["critic/vf_clipfrac"].item() == 1.0
    loss.backward()
    assert values.grad.item() == 0.0


def test_value_clip_fraction_is_zero_inside_the_range_despite_rounding():
    # V inside the range around old values near 0 (signs and magnitudes differ): V - old is
    # then inexact, old + (V - old) rounds away from V and the clipped error can exceed the
    # plain one by an ulp. The value is unchanged, so that is not a clip.
    gen = torch.Generator().manual_seed(0)
    old = (torch.rand(64, 32, generator=gen) - 0.5) * 0.1  # |V - old| <= 0.2 everywhere
    values = (torch.rand(64, 32, generator=gen) - 0.5) * 0.3
    returns = torch.randn(64, 32, generator=gen)
    v_clipped = old + (values - old).clamp(-0.2, 0.2)
    assert ((v_clipped - returns).square() > (values - returns).square()).any()  # rounding occurs
    _, m = value_loss(values, old, returns, torch.ones(64, 32), 0.2)
    assert m["critic/vf_clipfrac"].item() == 0.0


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=F64)
    values = torch.tensor([[1.5, 2.0, 2.0], [4.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    ret, res = [1.0, 2.0, 3.0, 4.0], [-0.5, 0.0, 1.0, 0.0]
    want = 1 - statistics.pvariance(res) / statistics.pvariance(ret)
    assert explained_variance(values, returns, mask).item() == pytest.approx(want, abs=1e-6)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    const = torch.full((2, 3), 0.7, dtype=F64)
    assert explained_variance(values, const, mask).item() == 0.0  # no variance: 0, not NaN


# ----------------------------------------------------------------------------- entropy


def test_entropy_bonus_is_masked_mean():
    entropy = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    bonus, m = entropy_bonus(entropy, mask)
    assert bonus.item() == pytest.approx((1 + 2 + 3 + 5) / 4)
    assert m["actor/entropy"].item() == pytest.approx(bonus.item())
    bonus.backward()
    assert torch.equal(entropy.grad, mask / 4.0)
    with pytest.raises(ValueError, match="entropy has shape"):
        entropy_bonus(entropy[:, :2], mask)


def test_kl_is_reexported():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert kl(lp, ref, "k1").item() == pytest.approx(1.0)
