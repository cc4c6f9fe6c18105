"""A step's scored groups, with DAPO's dynamic sampling (arXiv 2503.14476, §3.2) when asked.

    collected = collect_groups(next_round, groups_per_rank, n, filter_groups, max_extra_rounds,
                               dp_group, logger)

`next_round(r)` reads the next batch of prompts, generates n responses to each and scores
them (`Round`); every rank of the world runs every round, since the engines and the scorer
are collective. Without filtering, the first round is the step. With it, a group whose n
rewards are all equal (`algorithms.dapo.informative_groups`: no group-relative advantage,
no policy gradient) is dropped, and each data-parallel replica keeps the informative groups
of its rounds until it holds its share of the step, `groups_per_rank`
(data.train_batch_size / dp): replicas train on equal numbers of rows, so the shares are
filled per replica rather than moved between them. Rounds stop when every replica is full
or after `max_extra_rounds` extra rounds; a replica still short then fills its share with
uninformative groups, in the order it saw them, and the step reports it
(`dynamic_sampling/cap_reached`, a warning) instead of generating on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from rl_megatron.algorithms.dapo import informative_groups
from rl_megatron.rollout.batch import RolloutBatch

__all__ = ["Collected", "Round", "collect_groups"]


@dataclass
class Round:
    """One round's rollout and what scoring made of it (this rank's rows)."""

    rollout: RolloutBatch  # num_prompts * n rows, prompt-major
    scores: torch.Tensor  # [rows] sequence rewards the advantages use (shaping included)
    per_row: dict[str, torch.Tensor] = field(default_factory=dict)  # further [rows] values
    reward_errors: float | None = None  # samples whose rule failed; None: a reward model


@dataclass
class Collected:
    """The step's groups: `groups_per_rank * n` rows, group_index 0 … groups - 1."""

    rollout: RolloutBatch
    scores: torch.Tensor  # [rows]
    per_row: dict[str, torch.Tensor]
    reward_errors: float | None  # summed over the rounds (this rank)
    metrics: dict[str, float]  # dynamic_sampling/*: counts over every rank (global)

    def reward_metrics(self) -> dict[str, float]:
        """This rank's `reward/*` of the rows the step trains on (errors: of every round)."""
        out = {
            "reward/mean": self.scores.mean().item(),
            "reward/std": self.scores.std(unbiased=False).item(),
        }
        if self.reward_errors is not None:
            out["reward/errors"] = float(self.reward_errors)
        if "overlong_penalty" in self.per_row:
            out["reward/overlong_penalty_mean"] = self.per_row["overlong_penalty"].mean().item()
        return out


def _rows_of(groups: list[int], n: int) -> torch.Tensor:
    return torch.tensor([g * n + j for g in groups for j in range(n)], dtype=torch.int64)


def _take(r: Round, groups: list[int], n: int) -> Round:
    rows = _rows_of(groups, n)
    return Round(r.rollout[rows], r.scores[rows], {k: v[rows] for k, v in r.per_row.items()}, None)


def collect_groups(
    next_round: Callable[[int], Round],
    groups_per_rank: int,
    n: int,
    filter_groups: bool,
    max_extra_rounds: int,
    dp_group: dist.ProcessGroup | None,
    logger: logging.Logger,
) -> Collected:
    """Rounds of `next_round` until this step holds its groups (module doc). Collective.

    groups_per_rank: the prompts (groups) this replica trains on per step.
    n: samples per prompt (rollout.n).
    filter_groups: drop groups whose rewards are all equal (dynamic sampling); False: one
        round, kept as is.
    max_extra_rounds: rounds after the first that a step may take.
    dp_group: the data-parallel group (counts and the stop decision are agreed over it).
    """
    first = next_round(0)
    errors = first.reward_errors
    if not filter_groups:
        return Collected(first.rollout, first.scores, first.per_row, errors, {})
    kept: list[Round] = []
    spare: list[Round] = []  # uninformative groups, one per entry, to fill a short step
    have = spare_count = 0
    counts = torch.zeros(3, dtype=torch.float64)  # generated, informative, filled
    rounds, current = 0, first
    while True:
        rounds += 1
        informative = informative_groups(current.scores, n).tolist()
        counts[0] += len(informative)
        counts[1] += sum(informative)
        useful = [g for g, ok in enumerate(informative) if ok][: groups_per_rank - have]
        if useful:
            kept.append(_take(current, useful, n))
            have += len(useful)
        idle = [g for g, ok in enumerate(informative) if not ok][: groups_per_rank - spare_count]
        if idle:
            spare.append(_take(current, idle, n))
            spare_count += len(idle)
        # Rounds go on while any replica is short of its share.
        short = torch.tensor([float(have < groups_per_rank)])
        if dp_group is not None:
            short = _all_reduce(short, dp_group, dist.ReduceOp.MAX)
        if short.item() == 0 or rounds > max_extra_rounds:
            break
        current = next_round(rounds)
        if errors is not None:
            errors += current.reward_errors or 0.0
    missing = groups_per_rank - have
    for part in spare:
        if missing <= 0:
            break
        take = min(missing, len(part.scores) // n)
        kept.append(_take(part, list(range(take)), n))
        counts[2] += take
        missing -= take
    if dp_group is not None:
        counts = _all_reduce(counts, dp_group, dist.ReduceOp.SUM)
    generated, found, filled = counts.tolist()
    if filled and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "dynamic sampling: %d informative groups of the %d wanted after %d rounds "
            "(algorithm.dynamic_sampling.max_extra_rounds=%d); the step trains with %d "
            "groups of equal rewards filling the rest",
            int(found),
            groups_per_rank * (1 if dp_group is None else dist.get_world_size(dp_group)),
            rounds,
            max_extra_rounds,
            int(filled),
        )
    rollout = RolloutBatch.cat([k.rollout for k in kept])
    rollout = replace(rollout, group_index=torch.arange(groups_per_rank).repeat_interleave(n))
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/groups_generated": generated,
        "dynamic_sampling/groups_informative": found,
        "dynamic_sampling/groups_filled": filled,
        "dynamic_sampling/cap_reached": float(filled > 0),
    }
    return Collected(
        rollout,
        torch.cat([k.scores for k in kept]),
        {key: torch.cat([k.per_row[key] for k in kept]) for key in first.per_row},
        errors,
        metrics,
    )


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op) -> torch.Tensor:
    """All-reduce a small host tensor over `group` (through the GPU under NCCL)."""
    if dist.get_world_size(group) == 1:
        return x
    on_gpu = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
    y = x.to(torch.device("cuda", torch.cuda.current_device())) if on_gpu else x.clone()
    dist.all_reduce(y, op=op, group=group)
    return y.cpu()
