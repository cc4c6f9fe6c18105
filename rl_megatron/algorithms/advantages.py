"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline.

All tensors are `[batch, response_len]` unless stated; `response_mask` is 0/1 of that shape;
`scores` is `[batch]` (one outcome reward per sample) and `group_index` is `[batch]` integer
ids of the prompt each sample answers. Every sample of a group must be on the calling rank
(the trainer keeps the `n` responses of a prompt on one DP rank).

Conventions shared by every estimator:
* Positions where `response_mask` is 0 are not time steps. Inside a response (e.g. tool
  output in a multi-turn rollout) the recursions skip them: the next valid token's value and
  advantage carry across, undiscounted. Rewards placed there are ignored; put them on a
  valid token. Outputs are 0 at masked positions.
* NaN or inf in rewards, scores or values at valid positions raises ValueError (one host
  sync per call); garbage at masked positions is ignored.
* A sequence with no valid token gets advantages and returns of 0.
* Whitening statistics are computed over all valid tokens of the batch and, when `group`
  (the data-parallel group) is given, of every rank in it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _check_token_tensor(fn: str, name: str, x: torch.Tensor, response_mask: torch.Tensor) -> None:
    if response_mask.dim() != 2:
        raise ValueError(
            f"{fn}: response_mask must be [batch, response_len], got {tuple(response_mask.shape)}"
        )
    if x.shape != response_mask.shape:
        raise ValueError(
            f"{fn}: {name} has shape {tuple(x.shape)} but response_mask has "
            f"{tuple(response_mask.shape)}; both must be [batch, response_len]"
        )


def _check_finite(fn: str, name: str, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
    bad = ~torch.isfinite(x)
    if valid is not None:
        bad &= valid
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{fn}: {name} holds NaN or inf at index {where} (a valid position); "
            f"check the reward function / critic that produced it"
        )


def _check_outcome_inputs(
    fn: str, scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor
) -> None:
    if response_mask.dim() != 2:
        raise ValueError(
            f"{fn}: response_mask must be [batch, response_len], got {tuple(response_mask.shape)}"
        )
    batch = response_mask.shape[0]
    for name, t in (("scores", scores), ("group_index", group_index)):
        if t.shape != (batch,):
            raise ValueError(
                f"{fn}: {name} must be [batch] = ({batch},) to match response_mask "
                f"{tuple(response_mask.shape)}; got {tuple(t.shape)}"
            )
    if group_index.is_floating_point():
        raise ValueError(f"{fn}: group_index must hold integer prompt ids, got {group_index.dtype}")
    _check_finite(fn, "scores", scores)


def masked_whiten(
    x: torch.Tensor,
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalise `x` to zero mean and unit variance over valid tokens (of all ranks in `group`).

    x, response_mask: `[batch, response_len]`. The variance is the unbiased one (divides by
    N - 1; by 1 when N = 1). shift_mean=False rescales without removing the mean.
    Sums are taken in float64 so that splitting the batch over ranks changes only rounding.
    Raises ValueError when no rank has a valid token. Returns 0 at masked positions.
    """
    _check_token_tensor("masked_whiten", "x", x, response_mask)
    valid = response_mask.bool()
    first = torch.stack(
        [torch.where(valid, x, 0.0).sum(dtype=torch.float64), valid.sum().to(torch.float64)]
    )
    if group is not None:
        dist.all_reduce(first, group=group)
    total, count = first[0], first[1]
    if count.item() == 0:
        raise ValueError("masked_whiten: response_mask has no valid token in the whole batch")
    mean = total / count
    # Second pass over deviations rather than E[x^2] - E[x]^2, which cancels badly.
    sq = torch.where(valid, (x.double() - mean) ** 2, 0.0).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    var = sq / (count - 1).clamp(min=1)
    out = (x.double() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0).to(x.dtype)


def _reverse_scan(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Generalised advantage recursion A_t = delta_t + gamma*lam*A_{t+1}, skipping masked steps.

    With values = 0 and lam = 1 this is the discounted return.
    """
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    out = torch.empty_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # TD error, eq. 11
        adv = delta + gamma * lam * next_adv  # eq. 16 as a backward recursion
        keep = valid[:, t]
        # A masked step is not part of the trajectory: carry the later step's state across it.
        next_adv = torch.where(keep, adv, next_adv)
        next_value = torch.where(keep, values[:, t], next_value)
        out[:, t] = next_adv
    return torch.where(valid, out, 0.0)


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438, eq. 11-16).

    token_rewards: `[batch, response_len]` token_level_rewards (score on the last token, KL
        penalty per token, ...).
    values: `[batch, response_len]` critic values V(s_t) of the rollout policy.
    response_mask: `[batch, response_len]` 0/1.
    gamma, lam: discount and GAE lambda, in [0, 1].
    whiten: normalise advantages over valid tokens (of all ranks of `group` when given).
    The step after the last valid token is terminal (V = 0).

    Returns (advantages, returns), both `[batch, response_len]`; returns = A + V before
    whitening (the lambda-return, the critic's target).
    """
    _check_token_tensor("gae", "token_rewards", token_rewards, response_mask)
    _check_token_tensor("gae", "values", values, response_mask)
    valid = response_mask.bool()
    _check_finite("gae", "token_rewards", token_rewards, valid)
    _check_finite("gae", "values", values, valid)
    rewards = torch.where(valid, token_rewards, 0.0)
    vals = torch.where(valid, values, 0.0).to(rewards.dtype)
    advantages = _reverse_scan(rewards, vals, valid, gamma, lam)
    returns = torch.where(valid, advantages + vals, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, response_mask, group)
    return advantages, returns


def _group_mean_and_count(
    scores: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std (0 for singletons) and group size; float64."""
    unique, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = unique.numel()
    s = scores.double()
    count = s.new_zeros(num_groups).index_add_(0, inverse, torch.ones_like(s))
    mean = s.new_zeros(num_groups).index_add_(0, inverse, s) / count
    dev = s - mean[inverse]
    sq = s.new_zeros(num_groups).index_add_(0, inverse, dev * dev)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.float32


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.where(response_mask.bool(), per_sample.to(dtype).unsqueeze(-1), 0.0)


@torch.no_grad()
def grpo(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, arXiv 2402.03300, §4.1.2).

    A_i = (s_i - mean(group)) / (std(group) + eps) on every valid token of sample i, with the
    unbiased std. norm_by_std=False keeps s_i - mean(group) (Dr. GRPO, Liu et al. 2025).
    A group of one has no baseline to compare with: its advantage is 0.

    scores: `[batch]`; group_index: `[batch]` ints; response_mask: `[batch, response_len]`.
    Returns advantages `[batch, response_len]`.
    """
    _check_outcome_inputs("grpo", scores, group_index, response_mask)
    mean, std, _ = _group_mean_and_count(scores, group_index)
    adv = scores.double() - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return _broadcast(adv, response_mask, _out_dtype(scores))


@torch.no_grad()
def rloo(
    scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, arXiv 2402.14740).

    A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean(group)), for a group of n samples.
    A group of one has no other sample to serve as baseline: its advantage is 0.

    scores: `[batch]`; group_index: `[batch]` ints; response_mask: `[batch, response_len]`.
    Returns advantages `[batch, response_len]`.
    """
    _check_outcome_inputs("rloo", scores, group_index, response_mask)
    mean, _, count = _group_mean_and_count(scores, group_index)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1), 0.0)
    adv = factor * (scores.double() - mean)
    return _broadcast(adv, response_mask, _out_dtype(scores))


@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted return, globally whitened.

    token_rewards: `[batch, response_len]` token_level_rewards, normally the outcome score
        on the last token minus the per-token KL penalty.
    The return G_t = r_t + gamma * G_{t+1} (masked steps skipped) is whitened over all
    valid tokens of the batch, and of every rank of `group` when given (the paper's global
    advantage normalisation, in place of a critic or a per-prompt baseline).

    Returns (advantages, returns), both `[batch, response_len]`.
    """
    _check_token_tensor("reinforce_plus_plus", "token_rewards", token_rewards, response_mask)
    valid = response_mask.bool()
    _check_finite("reinforce_plus_plus", "token_rewards", token_rewards, valid)
    rewards = torch.where(valid, token_rewards, 0.0)
    returns = _reverse_scan(rewards, torch.zeros_like(rewards), valid, gamma, 1.0)
    return masked_whiten(returns, response_mask, group), returns


@torch.no_grad()
def reinforce_plus_plus_baseline(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): group mean subtracted, then whitened.

    A_i = s_i - mean(group) on every valid token, then whitened over all valid tokens of the
    batch (and of every rank of `group` when given). The KL term belongs in the loss
    (`kl_loss`), not in the reward, for this estimator.

    scores: `[batch]`; group_index: `[batch]` ints; response_mask: `[batch, response_len]`.
    Returns advantages `[batch, response_len]`.
    """
    _check_outcome_inputs("reinforce_plus_plus_baseline", scores, group_index, response_mask)
    mean, _, _ = _group_mean_and_count(scores, group_index)
    centred = _broadcast(scores.double() - mean, response_mask, _out_dtype(scores))
    return masked_whiten(centred, response_mask, group)


def compute_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on `algorithm.adv_estimator`; returns (advantages, returns), `[batch, response_len]`.

    Outcome estimators (grpo, rloo, reinforce_plus_plus_baseline) score a sample by the sum
    of its token_level_rewards over valid tokens and return the advantages as `returns` too.
    values is needed by gae only, group_index by the outcome estimators.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator must be one of {', '.join(ADV_ESTIMATORS)}; got {estimator!r}"
        )
    if estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator 'gae' needs critic values; enable the critic")
        return gae(token_level_rewards, values, response_mask, gamma, lam, group=group)
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus(token_level_rewards, response_mask, gamma, group)
    if group_index is None:
        raise ValueError(f"adv_estimator {estimator!r} needs group_index (the prompt ids)")
    _check_token_tensor(estimator, "token_level_rewards", token_level_rewards, response_mask)
    valid = response_mask.bool()
    _check_finite(estimator, "token_level_rewards", token_level_rewards, valid)
    scores = torch.where(valid, token_level_rewards, 0.0).sum(dim=-1)
    if estimator == "grpo":
        adv = grpo(scores, group_index, response_mask, norm_by_std)
    elif estimator == "rloo":
        adv = rloo(scores, group_index, response_mask)
    else:
        adv = reinforce_plus_plus_baseline(scores, group_index, response_mask, group)
    return adv, adv
