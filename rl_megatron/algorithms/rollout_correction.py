"""Off-policy correction for the rollout engine's mismatch: importance weights and rejection.

The engine (vLLM in bf16 with its own kernels, or another process's weights) samples a
response from a behaviour policy mu that is never exactly the policy pi_old the trainer
scores. PPO's ratio pi_theta / pi_old is then taken on samples that pi_old did not draw. With
`log_ratio = log pi_old - log mu` per sampled token (training log-prob minus rollout
log-prob), the trainer corrects the policy loss in one of three ways:

* Truncated importance sampling (TIS; F. Yao, L. Liu et al., "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", 2025, https://fengyao.notion.site/off-policy-rl):
  each token's loss is multiplied by w = min(pi_old / mu, C).
* IcePop (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model", arXiv 2510.18855, §3 "IcePop"): w = pi_old / mu inside a band
  [lower, upper], 0 outside it (the token stays in the loss's normaliser).
* Masked importance sampling / rejection (MIS; J. Liu, Y. Li et al., "When Speed Kills
  Stability: Demystifying RL Collapse from the Training-Inference Mismatch", 2025,
  https://richardli.xyz/rl-collapse): tokens, or whole sequences, whose ratio leaves a band
  leave the loss altogether, normaliser included (`rejection_mask`).

At the sequence level the ratio is the product of the token ratios, exp(sum of log ratios),
the exact importance weight of the whole response. Everything here is computed in log space
(a 1000-token response's product overflows any float) and without gradient: the weights are
constants of the loss.

Statistics are over the whole batch: with `group` (data parallel) they are reduced over its
ranks, as `masked_whiten` does, so they do not depend on how the batch is split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["LEVELS", "is_weights", "mismatch_metrics", "rejection_mask"]

LEVELS = ("token", "sequence")

# exp(20) ~ 5e8: the probability ratio of the mismatch metric, finite in every float type.
_MAX_LOG_RATIO = 20.0


def _check(fn: str, log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> None:
    if response_mask.dim() != 2 or log_ratio.shape != response_mask.shape:
        raise ValueError(
            f"{fn}: log_ratio {tuple(log_ratio.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [batch, response_len]"
        )
    if level not in LEVELS:
        raise ValueError(f"{fn}: level must be one of {', '.join(LEVELS)}; got {level!r}")


def _unit_log_ratio(
    log_ratio: torch.Tensor, valid: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log importance ratio of each unit and the units' mask, in float64.

    token: `[batch, response_len]`, each valid token's own log ratio; sequence: `[batch, 1]`,
    the sum over the response (the sequences with a valid token are the units). Both
    broadcast against `[batch, response_len]`.
    """
    lr = torch.where(valid, log_ratio.double(), 0.0)
    if level == "token":
        return lr, valid
    return lr.sum(dim=-1, keepdim=True), valid.any(dim=-1, keepdim=True)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _sum_over(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def _max_over(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


@torch.no_grad()
def is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    threshold: float | tuple[float, float] = 2.0,
    batch_normalize: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_old / mu of the rollout's tokens, truncated (TIS) or banded (IcePop).

    log_ratio: `[batch, response_len]` training log-prob minus rollout log-prob of each
        sampled token (log pi_old - log mu). Padding may hold anything.
    response_mask: `[batch, response_len]` 0/1.
    level: `token` (each token its own ratio) or `sequence` (the product of the response's
        token ratios, the same weight on each of its tokens).
    threshold: a number C > 0: w = min(ratio, C) (TIS). A pair (lower, upper) with
        0 <= lower < upper: w = ratio where lower <= ratio <= upper, else 0 (IcePop).
    batch_normalize: divide the weights by their mean over the batch's units (valid tokens,
        or sequences at the sequence level), so that they average 1 (of all ranks of `group`).
    group: the data-parallel group holding the rest of the batch; None: this batch only.

    Returns (weights, metrics). weights: `[batch, response_len]` float32 without gradient,
    0 on padding. Metrics (0-d tensors, over the batch's units, before normalisation):
        rollout_corr/is_weight_mean, _max, _min; rollout_corr/is_clipped_frac: units whose
        weight is not their ratio (truncated, or zeroed outside the band);
        rollout_corr/is_ess: the effective sample size over the units, (sum w)^2 /
        (N sum w^2), in (0, 1] (1: all weights equal).
    """
    _check("is_weights", log_ratio, response_mask, level)
    if isinstance(threshold, (tuple, list)):
        lower, upper = (float(x) for x in threshold)
        if not 0 <= lower < upper:
            raise ValueError(
                f"is_weights: threshold band must satisfy 0 <= lower < upper, got {threshold}"
            )
    else:
        lower, upper = None, float(threshold)
        if not upper > 0:
            raise ValueError(f"is_weights: threshold must be > 0, got {threshold}")
    valid = response_mask.bool()
    log_rho, units = _unit_log_ratio(log_ratio, valid, level)
    log_upper = _log(upper)
    if lower is None:
        clipped = log_rho > log_upper
        w = torch.exp(log_rho.clamp(max=log_upper))
    else:
        clipped = (log_rho < _log(lower)) | (log_rho > log_upper)
        w = torch.where(clipped, 0.0, torch.exp(log_rho.clamp(max=log_upper)))
    w = torch.where(units, w, 0.0)  # each unit's weight: [batch, len] or [batch, 1]

    u = w
    sums = _sum_over(
        torch.stack(
            [units.sum().double(), u.sum(), u.square().sum(), (clipped & units).sum().double()]
        ),
        group,
    )
    big = torch.finfo(torch.float64).max
    extremes = _max_over(
        torch.stack([torch.where(units, w, -big).max(), torch.where(units, -w, -big).max()])
        if units.numel()
        else torch.full((2,), -big, dtype=torch.float64, device=w.device),
        group,
    )
    count = sums[0].clamp(min=1)
    mean = sums[1] / count
    any_unit = sums[0] > 0
    metrics = {
        "rollout_corr/is_weight_mean": mean.float(),
        "rollout_corr/is_weight_max": torch.where(any_unit, extremes[0], 0.0).float(),
        "rollout_corr/is_weight_min": torch.where(any_unit, -extremes[1], 0.0).float(),
        "rollout_corr/is_clipped_frac": (sums[3] / count).float(),
        "rollout_corr/is_ess": torch.where(
            sums[2] > 0, sums[1].square() / (count * sums[2].clamp(min=1e-300)), 1.0
        ).float(),
    }
    if batch_normalize:
        w = w / torch.where(mean > 0, mean, 1.0)
    return torch.where(valid, w, 0.0).float(), metrics


@torch.no_grad()
def rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    lower: float,
    upper: float,
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The response mask without the tokens (or sequences) whose ratio leaves [lower, upper].

    Masked importance sampling (MIS, module doc): a rejected token, or every token of a
    rejected sequence, leaves the policy loss and its normaliser, as padding does.

    log_ratio: `[batch, response_len]` log pi_old - log mu of each sampled token.
    response_mask: `[batch, response_len]` 0/1.
    level: `token` (each token's ratio) or `sequence` (the product of the response's ratios).
    lower, upper: the accepted band of the ratio, 0 <= lower < upper.
    group: the data-parallel group holding the rest of the batch; None: this batch only.

    Returns (mask, metrics). mask: `[batch, response_len]`, response_mask's dtype, 1 where
    response_mask is 1 and the unit is accepted. Metrics (0-d tensors, whole batch):
        rollout_corr/rejected_token_frac: valid tokens rejected / valid tokens;
        rollout_corr/rejected_seq_frac: sequences that lost a token / sequences with one.
    """
    _check("rejection_mask", log_ratio, response_mask, level)
    if not 0 <= lower < upper:
        raise ValueError(
            f"rejection_mask: the band must satisfy 0 <= lower < upper, got ({lower}, {upper})"
        )
    valid = response_mask.bool()
    log_rho, _ = _unit_log_ratio(log_ratio, valid, level)
    rejected = valid & ((log_rho < _log(lower)) | (log_rho > _log(upper)))  # broadcast
    mask = torch.where(rejected, 0, response_mask).to(response_mask.dtype)
    has_token = valid.any(dim=-1)
    sums = _sum_over(
        torch.stack(
            [
                valid.sum().double(),
                rejected.sum().double(),
                has_token.sum().double(),
                rejected.any(dim=-1).sum().double(),
            ]
        ),
        group,
    )
    metrics = {
        "rollout_corr/rejected_token_frac": (sums[1] / sums[0].clamp(min=1)).float(),
        "rollout_corr/rejected_seq_frac": (sums[3] / sums[2].clamp(min=1)).float(),
    }
    return mask, metrics


@torch.no_grad()
def mismatch_metrics(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """How far the rollout's policy mu is from the trainer's pi, over the batch's valid tokens.

    rollout_log_prob: `[batch, response_len]` the engine's log-probs of the sampled tokens.
    log_prob: `[batch, response_len]` the trainer's (old_log_prob: pi_old).
    response_mask: `[batch, response_len]` 0/1.
    group: the data-parallel group holding the rest of the batch; None: this batch only.

    Returns 0-d tensors, token statistics of the whole batch (sums over `group`, the max a
    max over it). With d = log pi - log mu:
        rollout/logprob_diff_mean, rollout/logprob_diff_max: mean and max of |d|;
        rollout/prob_ratio_mean: mean of pi / mu (1 when the two agree; d clamped at +-20);
        rollout/mismatch_kl_k1, rollout/mismatch_kl_k3: KL(mu || pi) per token, estimated
            from mu's samples with -d (k1) and (e^d - 1) - d (k3) (J. Schulman,
            "Approximating KL divergence", 2020).
    """
    if rollout_log_prob.shape != response_mask.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"mismatch_metrics: rollout_log_prob {tuple(rollout_log_prob.shape)}, log_prob "
            f"{tuple(log_prob.shape)} and response_mask {tuple(response_mask.shape)} must all "
            "be [batch, response_len]"
        )
    valid = response_mask.bool()
    d = torch.where(valid, log_prob.double() - rollout_log_prob.double(), 0.0)
    dc = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    per_token = torch.stack([d.abs(), torch.exp(dc), -d, torch.expm1(dc) - dc])
    sums = torch.cat([valid.sum().double()[None], torch.where(valid, per_token, 0.0).sum((1, 2))])
    sums = _sum_over(sums, group)
    largest = _max_over(d.abs().max() if d.numel() else d.new_zeros(()), group)
    count = sums[0].clamp(min=1)
    return {
        "rollout/logprob_diff_mean": (sums[1] / count).float(),
        "rollout/logprob_diff_max": largest.float(),
        "rollout/prob_ratio_mean": (sums[2] / count).float(),
        "rollout/mismatch_kl_k1": (sums[3] / count).float(),
        "rollout/mismatch_kl_k3": (sums[4] / count).float(),
    }
