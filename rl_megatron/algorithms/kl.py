"""KL divergence to the reference policy: estimators, reward penalty or loss term, controllers.

Responses are sampled from the policy pi, so KL(pi || pi_ref) is estimated per token from
log r = ref_log_prob - log_prob with the estimators of J. Schulman, "Approximating KL
divergence" (2020, http://joschu.net/blog/kl-approx.html):
    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance; its gradient is the KL's gradient
    k3 = (r - 1) - log r         unbiased, low variance, always >= 0; clamped to [-10, 10]
                                 as verl's `low_var_kl` and OpenRLHF's k3 do, so that one
                                 diverged token (r ~ e^20) cannot dominate a batch's KL
    abs = |log r|                a distance, not an estimate of the KL (verl's `abs`)
and, from the two full distributions at each position rather than the sampled token,
    full = sum_v pi(v) (log pi(v) - log pi_ref(v))   exact; `kl_full` (vocabulary-parallel
                                 in `models.vocab_parallel.vocab_parallel_kl`).
The KL can enter as a per-token reward penalty (`apply_kl_penalty`, as in Ziegler et al.
2019 and InstructGPT) or as a loss term (`kl_loss`, as in GRPO, Shao et al. 2024 eq. 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_megatron.algorithms.aggregation import BatchTotals, aggregate

KL_KINDS = ("k1", "k2", "k3", "abs")  # estimators from the sampled token's log-probs
FULL = "full"  # the exact KL from both full distributions (`kl_full`)

# exp(20) ~ 5e8: far beyond any ratio a healthy run sees, yet finite in fp32 and bf16.
_MAX_LOG_RATIO = 20.0
# k3's value bound (verl's low_var_kl clamps it to [-10, 10]; k3 >= 0, so only 10 binds).
_K3_BOUND = 10.0


def kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref); see the module docstring for the estimators.

    log_prob, ref_log_prob: `[batch, response_len]` log-probabilities of the sampled tokens
        under the policy and the reference policy.
    kind: `k1`, `k2`, `k3` or `abs`. For k3 the log-ratio is clamped to +-20 before exp,
        and the estimate to [-10, 10] (no gradient beyond), as verl and OpenRLHF do.
    Returns `[batch, response_len]`, unmasked (aggregate it with the response_mask).
    `full` needs both distributions, not these log-probs: `kl_full`.
    """
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"kl: log_prob {tuple(log_prob.shape)} and ref_log_prob "
            f"{tuple(ref_log_prob.shape)} must have the same shape"
        )
    log_ratio = ref_log_prob - log_prob
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.expm1(log_ratio) - log_ratio  # expm1: exact near r = 1, where k3 ~ 0
        return k3.clamp(-_K3_BOUND, _K3_BOUND)
    if kind == "abs":
        return log_ratio.abs()
    if kind == FULL:
        raise ValueError(
            "kl: the full KL needs both full distributions, not the sampled tokens' "
            "log-probs; use kl_full (or models.vocab_parallel.vocab_parallel_kl)"
        )
    raise ValueError(f"kl: kind must be one of {', '.join(KL_KINDS)}; got {kind!r}")


def kl_full(
    logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Exact KL(pi || pi_ref) at each position, from the whole vocabulary's logits.

    logits: `[..., vocab]` the policy's (with gradient); ref_logits: `[..., vocab]` the
        reference's (no gradient flows into it). Both are divided by `temperature` (the
        sampling policies), then KL = sum_v pi(v) (log pi(v) - log pi_ref(v)).
    Returns `[...]` in the logits' dtype (at least float32). The tensor-parallel version,
    for vocabulary-sharded logits, is `models.vocab_parallel.vocab_parallel_kl`.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(
            f"kl_full: logits {tuple(logits.shape)} and ref_logits "
            f"{tuple(ref_logits.shape)} must have the same shape"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_p = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    log_q = torch.log_softmax(ref_logits.detach().to(dtype) / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    *,
    totals: BatchTotals | None = None,
    norm_len: int | None = None,
    full_kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term; the actor adds `kl_loss_coef * loss`.

    log_prob: `[batch, response_len]` current policy log-probs (with gradient).
    ref_log_prob, response_mask: `[batch, response_len]`.
    kind: estimator (`k3` is GRPO's choice, Shao et al. 2024 eq. 4), or `full`.
    agg_mode, totals, norm_len: see `aggregation.aggregate`.
    full_kl: with kind `full`, the exact per-token KL `[batch, response_len]` (with
        gradient; `models.vocab_parallel.vocab_parallel_kl`).
    Returns (loss, {"actor/kl_loss"}); metrics are detached 0-d tensors.
    """
    if log_prob.shape != response_mask.shape:
        raise ValueError(
            f"kl_loss: log_prob {tuple(log_prob.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [batch, response_len]"
        )
    valid = response_mask.bool()
    # Select before the estimator: padding may hold -inf log-probs, and exp/grad of those
    # would turn into NaN even though the aggregate ignores them.
    per_token = _per_token_kl(
        "kl_loss",
        torch.where(valid, log_prob, 0.0),
        torch.where(valid, ref_log_prob, 0.0),
        kind,
        full_kl,
    )
    loss = aggregate(per_token, response_mask, agg_mode, totals, norm_len)
    return loss, {"actor/kl_loss": loss.detach()}


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
    group: dist.ProcessGroup | None = None,
    *,
    full_kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Subtract `kl_coef * KL` from every valid token's reward (Ziegler et al. 2019).

    token_level_scores: `[batch, response_len]` reward-model/rule scores per token.
    old_log_prob, ref_log_prob, response_mask: `[batch, response_len]`.
    kl_coef: the controller's current value.
    kind: estimator, or `full` with `full_kl` the exact per-token KL `[batch, response_len]`.
    group: the ranks holding the rest of the batch (data parallel); None: this batch only.
    Returns (token_level_rewards, metrics). "actor/reward_kl_penalty" is the mean KL per valid
    token (nats/token) of the whole batch (all ranks of `group`): feed it to the KL
    controller, whose target_kl is in the same unit. Rewards at masked positions are 0.
    """
    for name, t in (("old_log_prob", old_log_prob), ("ref_log_prob", ref_log_prob)):
        if t.shape != token_level_scores.shape or t.shape != response_mask.shape:
            raise ValueError(
                f"apply_kl_penalty: token_level_scores {tuple(token_level_scores.shape)}, "
                f"{name} {tuple(t.shape)} and response_mask {tuple(response_mask.shape)} "
                f"must all be [batch, response_len]"
            )
    valid = response_mask.bool()
    per_token = _per_token_kl(
        "apply_kl_penalty",
        torch.where(valid, old_log_prob, 0.0),
        torch.where(valid, ref_log_prob, 0.0),
        kind,
        full_kl,
    )
    per_token = torch.where(valid, per_token, 0.0)
    rewards = torch.where(valid, token_level_scores - kl_coef * per_token, 0.0)
    # Token sum and count over the group: a mean of per-rank means would weigh a token of
    # a rank with fewer tokens more.
    total = torch.stack([torch.where(valid, per_token, 0.0).sum().double(), valid.sum().double()])
    if group is not None:
        dist.all_reduce(total, group=group)
    metrics = {
        "actor/reward_kl_penalty": (total[0] / total[1].clamp(min=1)).float(),
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return rewards, metrics


def _per_token_kl(
    fn: str,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kind: str,
    full_kl: torch.Tensor | None,
) -> torch.Tensor:
    """The estimator `kind` of the sampled tokens, or the given exact KL for `full`."""
    if kind != FULL:
        return kl(log_prob, ref_log_prob, kind)
    if full_kl is None or full_kl.shape != log_prob.shape:
        got = None if full_kl is None else tuple(full_kl.shape)
        raise ValueError(
            f"{fn}: kind 'full' needs full_kl of shape {tuple(log_prob.shape)} (the exact "
            f"per-token KL from both distributions), got {got}"
        )
    return full_kl


def adaptive_kl_coef(
    kl_coef: float, current_kl: float, target_kl: float, horizon: float, n_steps: int
) -> float:
    """One update of the adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593, §2.2).

    e = clip(current_kl / target_kl - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon).
    The clip bounds the change per update at 20 % of n_steps / horizon, so one noisy KL
    estimate cannot swing the coefficient; `horizon` (in samples) sets how fast beta adapts.
    n_steps: samples (or steps, in the unit of horizon) since the last update.
    """
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


@dataclass
class FixedKLController:
    """Constant KL coefficient; same interface as AdaptiveKLController."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """KL coefficient steered towards `target_kl` nats/token; see `adaptive_kl_coef`."""

    value: float  # current coefficient (starts at the configured kl_coef)
    target_kl: float  # nats per token
    horizon: float  # samples over which an error is corrected (Ziegler et al. use 10000)

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(
                f"adaptive KL controller: target_kl ({self.target_kl}) and horizon "
                f"({self.horizon}) must be positive"
            )

    def update(self, current_kl: float, n_steps: int) -> float:
        self.value = adaptive_kl_coef(
            self.value, float(current_kl), self.target_kl, self.horizon, n_steps
        )
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Controller from config: kind `fixed` or `adaptive` (needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl: 'adaptive' needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive'; got {kind!r}")
