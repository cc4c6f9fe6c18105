"""Policy losses (PPO's clip with clip-higher and dual clip, GSPO, CISPO), the clipped
value loss and the entropy bonus.

Every loss takes `[batch, response_len]` tensors and a 0/1 `response_mask`, reduces with
`aggregate` (see aggregation.py for the global-batch normalisation; pass `totals`) and
returns `(loss, metrics)`. Metrics are detached 0-d tensors (no host sync here), and each is
the call's *share* of the mini-batch's value, as the loss is: a loss metric is the loss
itself, a per-token fraction or mean is the sum over this micro-batch's valid tokens
divided by the mini-batch's token count (`totals.num_tokens`). Summing a metric over the
micro-batches of all DP ranks therefore gives the mini-batch's value whatever the split;
without `totals` the call is its own mini-batch and the shares are plain means.

Positions where the mask is 0 are selected away before any arithmetic: padding may hold
-inf or NaN log-probs, and they reach neither the loss nor the gradient.

`aggregate` and `kl` are re-exported so that the trainer finds every loss piece here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_megatron.algorithms.aggregation import BatchTotals, aggregate
from rl_megatron.algorithms.kl import kl, kl_loss

__all__ = [
    "LOSS_MODES",
    "aggregate",
    "entropy_bonus",
    "explained_variance",
    "kl",
    "kl_loss",
    "policy_loss",
    "value_loss",
]

LOSS_MODES = ("vanilla", "gspo", "cispo")

# exp(20) ~ 5e8: a finite bound on the importance ratio, far outside any clip range.
_MAX_LOG_RATIO = 20.0
# GSPO's sequence log-ratio is clamped from above at 10 (exp(10) ~ 2.2e4), as the
# reference implementations do: a long response's mean can still be far off at the start.
_GSPO_MAX_LOG_RATIO = 10.0
_POLICY_MEANS = (
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_upper",
    "actor/pg_clipfrac_lower",
    "actor/pg_clipfrac_dual",
    "actor/ppo_kl",
)


def _check_shapes(fn: str, response_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if response_mask.dim() != 2:
        raise ValueError(
            f"{fn}: response_mask must be [batch, response_len], got {tuple(response_mask.shape)}"
        )
    for name, t in tensors.items():
        if t.shape != response_mask.shape:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(t.shape)} but response_mask has "
                f"{tuple(response_mask.shape)}; both must be [batch, response_len]"
            )


def _token_count(valid: torch.Tensor, totals: BatchTotals | None) -> torch.Tensor:
    """The denominator of a per-token metric's share: the mini-batch's valid tokens."""
    count = valid.sum() if totals is None else totals.num_tokens
    return torch.as_tensor(count, device=valid.device).clamp(min=1).float()


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    *,
    totals: BatchTotals | None = None,
    norm_len: int | None = None,
    loss_mode: str = "vanilla",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss of `loss_mode`, negated for minimisation.

    `vanilla`: PPO's clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7).

    Per token, with r = exp(log_prob - old_log_prob) and A the advantage:
        L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)).
    Separate low/high bounds are DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476):
    a larger upper bound lets low-probability tokens gain mass, against entropy
    collapse. With clip_ratio_c (> 1), dual clip (Ye et al. 2020, arXiv 1912.09729)
    also bounds the loss of negative-advantage tokens by -A c, so a huge ratio on a bad
    token cannot dominate the update: L = min(L, -A c) where A < 0.

    `gspo`: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071, eq. 5-7,
    and GSPO-token, eq. 13-14): the ratio is the sequence's,
        s_i = exp(mean over the response of log r_t) = (pi(y_i) / pi_old(y_i))^(1/|y_i|),
    put on every token with the paper's stop-gradient construction
        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]    (value s_i, gradient s_i * grad log pi(y_t))
    and clipped as above: L = max(-A s, -A clip(s, 1 - low, 1 + high)). The log of s is
    clamped at 10 from above. With `seq-mean-token-mean` aggregation this is the paper's
    objective; no dual clip (the paper has none).

    `cispo`: Clipped IS-weight Policy Optimization (MiniMax 2025, arXiv 2506.13585, eq. 4-5):
        L = -sg(clip(r, 1 - low, 1 + high)) * A * log pi,
    REINFORCE with a clipped, constant importance weight: every token keeps a gradient
    (no token is dropped by the clip), bounded by the clip. No dual clip.

    rollout_is_weights multiplies each token's loss before aggregation (rollout correction,
    `rollout_correction.is_weights`: the behaviour policy's importance weight pi_old / mu,
    a constant); the ratio r above is always pi / pi_old (decoupled PPO, DESIGN.md §7).

    log_prob: `[batch, response_len]` current policy log-probs (with gradient).
    old_log_prob: `[batch, response_len]` log-probs of pi_old (the proximal policy: the
        policy at the start of the step, recomputed by the trainer).
    advantages, response_mask: `[batch, response_len]`.
    agg_mode, totals, norm_len: see `aggregation.aggregate`.
    loss_mode: `vanilla`, `gspo` or `cispo`.
    rollout_is_weights: `[batch, response_len]` or None; no gradient flows into it.

    Returns (loss, metrics) with metrics (fractions of valid tokens, as shares; module doc):
        actor/pg_loss; actor/pg_clipfrac: the clip is active (vanilla, gspo: the clipped
        term is the one taken; cispo: the weight was clipped); actor/pg_clipfrac_upper:
        r > 1 + high (vanilla, gspo: and A > 0); actor/pg_clipfrac_lower: r < 1 - low
        (vanilla, gspo: and A < 0); actor/pg_clipfrac_dual: the dual clip is active;
        actor/ppo_kl: mean of old_log_prob - log_prob (k1 estimate of KL(old || new)).
        For gspo, r is the sequence ratio s.
    """
    _check_shapes(
        "policy_loss",
        response_mask,
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        **({} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}),
    )
    if loss_mode not in LOSS_MODES:
        raise ValueError(
            f"policy_loss: loss_mode must be one of {', '.join(LOSS_MODES)}; got {loss_mode!r}"
        )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"policy_loss: clip_ratio_low ({clip_ratio_low}) and clip_ratio_high "
            f"({clip_ratio_high}) must be >= 0"
        )
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"policy_loss: clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    valid = response_mask.bool()
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0.0)
    adv = torch.where(valid, advantages, 0.0).to(log_ratio.dtype)
    if loss_mode == "cispo":
        loss_mat, upper, lower = _cispo(
            log_prob, log_ratio, adv, valid, clip_ratio_low, clip_ratio_high
        )
        dual = torch.zeros_like(valid)
    else:
        if loss_mode == "gspo":
            ratio = _gspo_ratio(log_prob, log_ratio, valid)
        else:
            ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        loss_mat, upper, lower, dual = _clipped_surrogate(
            ratio,
            adv,
            clip_ratio_low,
            clip_ratio_high,
            clip_ratio_c if loss_mode == "vanilla" else None,
        )
    if rollout_is_weights is not None:
        # A constant per token: the behaviour policy's correction, never differentiated.
        loss_mat = loss_mat * torch.where(valid, rollout_is_weights.detach(), 0.0).to(
            loss_mat.dtype
        )
    loss = aggregate(loss_mat, response_mask, agg_mode, totals, norm_len)
    with torch.no_grad():
        # One masked mean over the stacked per-token values, not five: this runs once per
        # micro-batch on small tensors, where each kernel launch costs more than its work.
        per_token = torch.stack(
            [(upper | lower).float(), upper.float(), lower.float(), dual.float(), -log_ratio]
        )
        shares = torch.where(valid, per_token, 0.0).sum(dim=(1, 2)) / _token_count(valid, totals)
        metrics = {"actor/pg_loss": loss.detach()}
        metrics.update(zip(_POLICY_MEANS, shares.unbind()))
    return loss, metrics


def _clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r)) per token, with the dual clip when clip_ratio_c is given;
    and where the upper, lower and dual clips are active."""
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    with torch.no_grad():
        upper = (adv > 0) & (ratio > 1.0 + clip_ratio_high)
        lower = (adv < 0) & (ratio < 1.0 - clip_ratio_low)
        dual = torch.zeros_like(upper)
    if clip_ratio_c is not None:
        loss_dual = -adv * clip_ratio_c
        with torch.no_grad():
            dual = (adv < 0) & (loss_mat > loss_dual)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, loss_dual), loss_mat)
    return loss_mat, upper, lower, dual


def _gspo_ratio(
    log_prob: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] (arXiv 2507.18071, eq. 13-14).

    Its value is the sequence ratio s_i = exp(mean of log r over the response's valid
    tokens); its gradient is s_i * grad log pi(y_t).
    """
    lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / lengths
    # where, not multiply: padding may hold -inf log-probs (and -inf - -inf is NaN).
    lp = torch.where(valid, log_prob, 0.0)
    log_s = seq_log_ratio.detach() + lp - lp.detach()
    return torch.exp(log_s.clamp(max=_GSPO_MAX_LOG_RATIO))


def _cispo(
    log_prob: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO's -sg(clip(r)) A log pi per token (arXiv 2506.13585, eq. 4); and where the
    weight's upper and lower clips are active."""
    with torch.no_grad():
        ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        upper = ratio > 1.0 + clip_ratio_high
        lower = ratio < 1.0 - clip_ratio_low
    lp = torch.where(valid, log_prob, 0.0)
    return -adv * weight * lp, upper, lower


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    agg_mode: str = "token-mean",
    *,
    totals: BatchTotals | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, 0.5 * max((V - R)^2, (V_clip - R)^2) per token.

    V_clip = old_values + clip(V - old_values, -cliprange_value, cliprange_value) keeps the
    critic near the values that produced the advantages, as PPO's reference implementation
    does (Schulman et al. 2017; ablated in Engstrom et al. 2020, arXiv 2005.12729).
    cliprange_value None disables the clip (plain squared error).

    values: `[batch, response_len]` current critic values (with gradient).
    old_values: `[batch, response_len]` critic values at rollout time.
    returns, response_mask: `[batch, response_len]`.
    agg_mode, totals, norm_len: see `aggregation.aggregate`.

    Returns (loss, metrics), shares as in the module doc: critic/vf_loss, critic/vf_clipfrac
    (clipped term active), critic/vpred_mean. The explained variance is a statistic of the
    whole batch, not a sum of shares: `explained_variance`.
    """
    _check_shapes(
        "value_loss", response_mask, values=values, old_values=old_values, returns=returns
    )
    valid = response_mask.bool()
    v = torch.where(valid, values, 0.0)
    ret = torch.where(valid, returns, 0.0).to(v.dtype)
    err = (v - ret).square()
    if cliprange_value is None:
        loss_mat = err
        clipped = torch.zeros_like(valid)
    else:
        old = torch.where(valid, old_values, 0.0).to(v.dtype)
        v_clipped = old + (v - old).clamp(-cliprange_value, cliprange_value)
        err_clipped = (v_clipped - ret).square()
        loss_mat = torch.maximum(err, err_clipped)
        # Inside the clip range the two errors are equal up to rounding: count a token only
        # where V left the range, else the fraction would be rounding noise at the first
        # mini-batch (V = old values up to float error).
        clipped = ((err_clipped > err) & ((v - old).abs() > cliprange_value)).detach()
    loss = 0.5 * aggregate(loss_mat, response_mask, agg_mode, totals, norm_len)
    with torch.no_grad():
        count = _token_count(valid, totals)
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": torch.where(valid, clipped.float(), 0.0).sum() / count,
            "critic/vpred_mean": torch.where(valid, v.detach(), 0.0).sum() / count,
        }
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    agg_mode: str = "token-mean",
    *,
    totals: BatchTotals | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated policy entropy; the actor loss subtracts `entropy_coeff * bonus`.

    entropy: `[batch, response_len]` per-token entropy of the policy (with gradient), e.g.
        from `models.vocab_parallel.vocab_parallel_log_probs_and_entropy`.
    Returns (bonus, {"actor/entropy"}).
    """
    _check_shapes("entropy_bonus", response_mask, entropy=entropy)
    bonus = aggregate(entropy, response_mask, agg_mode, totals, norm_len)
    return bonus, {"actor/entropy": bonus.detach()}


@torch.no_grad()
def explained_variance(
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over valid tokens (of all ranks in `group`).

    values, returns, response_mask: `[batch, response_len]`. 1 is a perfect critic, 0 no
    better than a constant. Returns 0 (not NaN) when the returns have no variance.
    """
    _check_shapes("explained_variance", response_mask, values=values, returns=returns)
    valid = response_mask.bool()
    ret = torch.where(valid, returns, 0.0).double()
    res = torch.where(valid, returns - values, 0.0).double()
    first = torch.stack([valid.sum().double(), ret.sum(), res.sum()])
    if group is not None:
        dist.all_reduce(first, group=group)
    n = first[0].clamp(min=1)
    # Two passes (sum of squared deviations): constant returns give exactly 0 variance.
    second = torch.stack(
        [
            torch.where(valid, ret - first[1] / n, 0.0).square().sum(),
            torch.where(valid, res - first[2] / n, 0.0).square().sum(),
        ]
    )
    if group is not None:
        dist.all_reduce(second, group=group)
    var_ret, var_res = second[0], second[1]
    return torch.where(var_ret > 0, 1.0 - var_res / var_ret.clamp(min=1e-300), 0.0).float()
