"""KL estimators k1/k2/k3, KL loss and reward penalty, fixed and adaptive controllers.

Estimator identities are checked exactly by summing over every outcome of small categorical
distributions (no sampling, so no statistical tolerance): E_pi[k1] = E_pi[k3] = KL(pi||ref).
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_megatron.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    adaptive_kl_coef,
    apply_kl_penalty,
    build_kl_controller,
    kl,
    kl_full,
    kl_loss,
)

F64 = torch.float64


def test_estimators_hand_computed():
    # pi(token) = 0.5, ref(token) = 0.25: log r = log(ref / pi) = log 0.5
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    log_r = math.log(0.5)  # -0.6931
    assert kl(lp, ref, "k1").item() == pytest.approx(-log_r)  # 0.6931
    assert kl(lp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)  # 0.2402
    assert kl(lp, ref, "k3").item() == pytest.approx((0.5 - 1) - log_r)  # 0.1931


def _distributions(seed, n=7):
    gen = torch.Generator().manual_seed(seed)
    pi = torch.softmax(torch.randn(n, generator=gen, dtype=F64), -1)
    ref = torch.softmax(torch.randn(n, generator=gen, dtype=F64), -1)
    return pi, ref


@pytest.mark.parametrize("seed", range(5))
def test_k1_and_k3_are_unbiased_and_k3_nonnegative(seed):
    pi, ref = _distributions(seed)
    true_kl = (pi * (pi.log() - ref.log())).sum()
    lp, rlp = pi.log().unsqueeze(0), ref.log().unsqueeze(0)  # every outcome as one token
    for kind in ("k1", "k3"):
        expectation = (pi * kl(lp, rlp, kind)[0]).sum()
        assert expectation.item() == pytest.approx(true_kl.item(), abs=1e-12), kind
    assert (kl(lp, rlp, "k3") >= 0).all()
    assert (kl(lp, rlp, "k1") < 0).any()  # k1 per sample can be negative; k3 never


def test_k2_is_second_order_accurate():
    # For pi close to ref, E[k2] = KL + O(delta^3): shrinking delta 10x shrinks the gap ~1000x.
    pi, ref = _distributions(0)
    gaps = []
    for delta in (0.1, 0.01):
        near = torch.softmax(ref.log() + delta * (pi.log() - ref.log()), -1)
        true_kl = (near * (near.log() - ref.log())).sum()
        e_k2 = (near * kl(near.log(), ref.log(), "k2")).sum()
        gaps.append(abs(e_k2 - true_kl).item())
    assert gaps[1] < gaps[0] / 300


def test_k3_is_finite_for_extreme_ratios():
    lp = torch.tensor([[0.0, -100.0]])
    ref = torch.tensor([[-100.0, 0.0]])
    out = kl(lp, ref, "k3")
    assert torch.isfinite(out).all() and (out > 0).all()


def test_k3_is_clamped_to_10_as_reference_implementations_do():
    # verl's low_var_kl and OpenRLHF's k3 clamp the estimate to [-10, 10]: a token whose
    # reference probability is e^12 times the policy's counts 10, with no gradient.
    lp = torch.tensor([[-13.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]], dtype=F64)
    out = kl(lp, ref, "k3")
    assert out[0, 0].item() == 10.0
    assert out[0, 1].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)  # unclamped
    out.sum().backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() != 0.0


def test_abs_estimator():
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.25]], dtype=F64)
    assert kl(lp, ref, "abs").tolist() == [[0.5, 0.75]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_full_is_the_exact_kl_of_the_two_distributions(temperature):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=F64).requires_grad_(True)
    ref_logits = torch.randn(2, 3, 11, generator=gen, dtype=F64)
    out = kl_full(logits, ref_logits, temperature)
    assert out.shape == (2, 3)
    for i in range(2):
        for t in range(3):
            p = torch.softmax(logits[i, t].detach() / temperature, -1)
            q = torch.softmax(ref_logits[i, t] / temperature, -1)
            want = sum(p[v] * math.log(p[v] / q[v]) for v in range(11))
            assert out[i, t].item() == pytest.approx(want.item(), abs=1e-12)
    # Its gradient is p_j (log p_j - log q_j - KL) / temperature (zero at p = q).
    out.sum().backward()
    log_p = torch.log_softmax(logits.detach() / temperature, -1)
    log_q = torch.log_softmax(ref_logits / temperature, -1)
    want_grad = log_p.exp() * (log_p - log_q - out.detach()[..., None]) / temperature
    torch.testing.assert_close(logits.grad, want_grad, atol=1e-12, rtol=0)
    same = kl_full(ref_logits, ref_logits.clone(), temperature)
    assert same.abs().max().item() < 1e-12


def test_kl_bad_input():
    with pytest.raises(ValueError, match="kind must be one of k1, k2, k3, abs"):
        kl(torch.zeros(1, 2), torch.zeros(1, 2), "low_var")
    with pytest.raises(ValueError, match="needs both full distributions"):
        kl(torch.zeros(1, 2), torch.zeros(1, 2), "full")
    with pytest.raises(ValueError, match="same shape"):
        kl(torch.zeros(1, 2), torch.zeros(2, 1), "k1")
    assert KL_KINDS == ("k1", "k2", "k3", "abs")


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_loss_is_token_mean_and_ignores_padding(kind):
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=gen, dtype=F64) - 1
    ref = torch.randn(3, 4, generator=gen, dtype=F64) - 1
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    dirty = lp.clone()
    dirty[~mask.bool()] = float("-inf")
    dirty.requires_grad_(True)
    loss, m = kl_loss(dirty, ref, mask, kind)
    per_token = kl(lp, ref, kind)
    want = sum(per_token[i, t].item() for i in range(3) for t in range(4) if mask[i, t]) / 6
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert m["actor/kl_loss"].item() == pytest.approx(want, abs=1e-12)
    loss.backward()
    assert torch.isfinite(dirty.grad).all() and (dirty.grad[~mask.bool()] == 0).all()


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, float("nan")]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # k1 = old - ref: [[0.5, -1, 0], [1, 0, masked]]; beta = 0.1
    rewards, m = apply_kl_penalty(scores, old, ref, mask, 0.1, "k1")
    want = torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(rewards, want, atol=1e-12, rtol=0)
    assert m["actor/reward_kl_penalty"].item() == pytest.approx((0.5 - 1 + 0 + 1 + 0) / 5)
    assert m["actor/reward_kl_penalty_coeff"].item() == pytest.approx(0.1)
    for args in ((old[:, :2], ref, mask), (old, ref[:, :2], mask), (old, ref, mask[:, :2])):
        with pytest.raises(ValueError, match="must all be"):
            apply_kl_penalty(scores, *args, 0.1)
    for full_kl in (None, torch.zeros(2, 2, dtype=F64)):
        with pytest.raises(ValueError, match="kind 'full' needs full_kl of shape"):
            apply_kl_penalty(scores, old, ref, mask, 0.1, "full", full_kl=full_kl)


def test_adaptive_controller_update_rule():
    # beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)
    assert adaptive_kl_coef(0.1, 1.5, 1.0, 100, 10) == pytest.approx(
        0.1 * (1 + 0.2 * 0.1)
    )  # clipped
    assert adaptive_kl_coef(0.1, 1.1, 1.0, 100, 10) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert adaptive_kl_coef(0.1, 0.9, 1.0, 100, 10) == pytest.approx(0.1 * (1 - 0.1 * 0.1))
    assert adaptive_kl_coef(0.1, 0.0, 1.0, 100, 10) == pytest.approx(0.1 * (1 - 0.2 * 0.1))
    ctrl = AdaptiveKLController(0.2, target_kl=0.05, horizon=1000)
    beta = 0.2
    for kl_value in (0.1, 0.06, 0.01, 0.05, 0.3):
        err = min(max(kl_value / 0.05 - 1, -0.2), 0.2)
        beta *= 1 + err * 64 / 1000
        assert ctrl.update(kl_value, n_steps=64) == pytest.approx(beta, rel=1e-12)
    assert ctrl.value == pytest.approx(beta, rel=1e-12)
    restored = AdaptiveKLController(0.2, 0.05, 1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_controller_and_builder():
    ctrl = build_kl_controller("fixed", 0.3)
    assert isinstance(ctrl, FixedKLController)
    assert ctrl.update(10.0, 64) == 0.3 and ctrl.value == 0.3
    assert isinstance(build_kl_controller("adaptive", 0.3, 0.1, 100), AdaptiveKLController)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        build_kl_controller("adaptive", 0.3)
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        build_kl_controller("pid", 0.3)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        build_kl_controller("adaptive", 0.3, target_kl=0.1)
    with pytest.raises(ValueError, match="must be positive"):
        AdaptiveKLController(0.3, target_kl=0.0, horizon=100)
    with pytest.raises(ValueError, match="must be positive"):
        AdaptiveKLController(0.3, target_kl=0.1, horizon=0)
