"""Rollout output → the batch the roles train on, and the small tensor chores of a PPO step.

Pure functions (plus one DP reduction), so the loop in `ppo_trainer.py` stays readable and
each piece is unit-tested on its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rl_megatron.algorithms.rollout_correction import is_weights, rejection_mask
from rl_megatron.config import RolloutCorrectionConfig
from rl_megatron.rollout.batch import RolloutBatch

__all__ = [
    "dp_mean",
    "mini_batch_rows",
    "rollout_correction",
    "sequence_scores_at_last_token",
    "token_level_scores",
    "training_batch",
]


def training_batch(rollout: RolloutBatch) -> dict[str, torch.Tensor]:
    """The dict layout `MegatronRole` reads (see `trainer/roles.py`), from a rollout.

    `rollout_log_prob` is there only when the engine computed it (`rollout.calculate_log_probs`),
    `routed_experts` `[b, P + R, L, k]` only when it recorded the routing (routing replay).
    """
    batch = {
        "prompts": rollout.prompts,
        "responses": rollout.responses,
        "attention_mask": rollout.attention_mask,
        "position_ids": rollout.position_ids,
        "response_mask": rollout.response_mask.long(),
    }
    if rollout.rollout_log_probs is not None:
        batch["rollout_log_prob"] = rollout.rollout_log_probs.float()
    if rollout.routed_experts is not None:
        batch["routed_experts"] = rollout.routed_experts
    return batch


def last_masked_index(response_mask: torch.Tensor) -> torch.Tensor:
    """`[b]` column of each row's last 1 in `response_mask` (-1 for a row without one).

    Not the count of 1s minus one: a multi-turn row's mask has 0s between its turns (the
    observations), so its last sampled token sits past its count of them."""
    cols = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return torch.where(response_mask.bool(), cols, -1).amax(dim=-1)


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's score on its last sampled token (zeros elsewhere).

    scores: `[b]`; response_mask: `[b, R]`. A row without response tokens (a rejected
    prompt) keeps no reward: it has no token to carry it and takes no part in the loss.
    """
    last = last_masked_index(response_mask)
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = scores[rows].float()
    return out


def sequence_scores_at_last_token(
    values: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """A reward model's `[b, R]` per-token outputs → the score at each sequence's last
    sampled token."""
    last = last_masked_index(response_mask)
    index = last.clamp(min=0).unsqueeze(-1)
    return torch.where(last >= 0, values.gather(-1, index).squeeze(-1), 0.0)


def rollout_correction(
    batch: dict[str, torch.Tensor],
    config: RolloutCorrectionConfig,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The actor's batch with `algorithm.rollout_correction` applied (DESIGN.md §7).

    From log r = old_log_prob - rollout_log_prob (pi_old / mu): rejection (MIS) first, which
    zeroes the rejected tokens (or sequences) in the actor's `response_mask`, then the
    importance weights of what is left (`rollout_is_weights`, TIS or IcePop). The batch
    itself is not changed: the critic, advantages and metrics keep every token.
    group: the data-parallel group (batch statistics, batch normalisation).
    Returns (actor batch, rollout_corr/* metrics of the whole batch); with the correction
    off, the batch itself and no metrics.
    """
    if config.level is None:
        return batch, {}
    log_ratio = batch["old_log_prob"] - batch["rollout_log_prob"]
    actor = dict(batch)
    metrics: dict[str, torch.Tensor] = {}
    if config.rejection is not None:
        lower, upper = config.rejection
        actor["response_mask"], m = rejection_mask(
            log_ratio, batch["response_mask"], config.level, lower, upper, group=group
        )
        metrics.update(m)
    if config.threshold is not None:
        threshold = config.threshold
        actor["rollout_is_weights"], m = is_weights(
            log_ratio,
            actor["response_mask"],
            config.level,
            tuple(threshold) if isinstance(threshold, list) else threshold,
            config.batch_normalize,
            group=group,
        )
        metrics.update(m)
    return actor, {k: float(v) for k, v in metrics.items()}


def mini_batch_rows(num_rows: int, rows_per_mini_batch: int, generator: torch.Generator):
    """This rank's rows, shuffled, cut into mini-batches (one list of row ids each).

    The generator must be seeded identically on every rank of a data-parallel replica
    (TP/PP ranks must agree on the rows); replicas may differ.
    """
    if num_rows % rows_per_mini_batch:
        raise ValueError(f"{num_rows} rows do not split into mini-batches of {rows_per_mini_batch}")
    order = torch.randperm(num_rows, generator=generator).tolist()
    return [
        order[start : start + rows_per_mini_batch]
        for start in range(0, num_rows, rows_per_mini_batch)
    ]


def dp_mean(
    metrics: Mapping[str, float], group: dist.ProcessGroup, sums: tuple[str, ...] = ()
) -> dict[str, float]:
    """Average per-rank metrics over the data-parallel group (keys in `sums` are summed).

    Every rank must pass the same keys in the same order (sorted here to be safe).
    """
    keys = sorted(metrics)
    if not keys:
        return {}
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    size = dist.get_world_size(group)
    if size > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else "cpu"
        values = values.to(device)
        dist.all_reduce(values, group=group)
        values = values.cpu()
    return {k: v if k in sums else v / size for k, v in zip(keys, values.tolist())}


def _nccl(group: dist.ProcessGroup) -> bool:
    return torch.cuda.is_available() and dist.get_backend(group) == "nccl"
