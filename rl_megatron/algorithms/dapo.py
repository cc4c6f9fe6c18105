"""DAPO's sample-level pieces (Yu et al. 2025, arXiv 2503.14476): overlong reward shaping and
the group filter of dynamic sampling.

DAPO's other two pieces live with the loss: clip-higher (`losses.policy_loss`'s separate
`clip_ratio_low/high`) and token-level aggregation (`aggregation.aggregate`'s `token-mean`).
"""

from __future__ import annotations

import torch

__all__ = ["informative_groups", "overlong_penalty"]


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_length: int, factor: float
) -> torch.Tensor:
    """Soft overlong punishment (DAPO, arXiv 2503.14476, §3.4, eq. 13), times `factor`.

    With L_max = max_response_length and L_cache = buffer_length, a response of |y| tokens gets
        0                                    |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        -1                                   |y| > L_max
    added to its reward: a linear penalty over the last L_cache tokens before the limit,
    so that a truncated response is not scored like a finished one without a cliff at the
    limit. (Responses are cut at L_max, so the last case is there for completeness.)

    response_lengths: `[batch]` generated tokens per response.
    max_response_length: L_max, tokens (`rollout.max_response_length`).
    buffer_length: L_cache, 0 < L_cache <= L_max (`reward.overlong_buffer.length`).
    factor: scale of the penalty (`reward.overlong_buffer.penalty_factor`; DAPO uses 1).
    Returns `[batch]` float32 penalties in [-factor, 0].
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong_penalty: buffer_length must be in (0, max_response_length="
            f"{max_response_length}], got {buffer_length}"
        )
    expected = max_response_length - buffer_length
    over = (response_lengths.float() - expected).clamp(min=0)
    return -factor * torch.clamp(over / buffer_length, max=1.0)


def informative_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Which groups of `n` consecutive samples have rewards that are not all equal.

    Dynamic sampling (DAPO, arXiv 2503.14476, §3.2, eq. 11): a group whose samples all get
    the same reward has zero group-relative advantage, so it adds no policy gradient and
    only dilutes the batch; DAPO drops such groups and samples more prompts instead.

    scores: `[num_groups * n]` sequence rewards, the n samples of a prompt consecutive
        (the engines' prompt-major layout).
    Returns `[num_groups]` bool: True where max != min inside the group (exact equality, as
    DAPO's std = 0 test: equal scores from a rule are equal floats).
    """
    if scores.dim() != 1 or n < 1 or scores.numel() % n:
        raise ValueError(
            f"informative_groups: scores {tuple(scores.shape)} must be [num_groups * n] "
            f"with n = {n}"
        )
    groups = scores.view(-1, n)
    return groups.amax(dim=-1) != groups.amin(dim=-1)
