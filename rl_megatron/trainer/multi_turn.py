"""Multi-turn rollouts in the loop (`environment.function` set; DESIGN.md §2).

    session = build_session(config, tokenizer, log)          # None: single-turn
    rollout, per_row = trajectory_round(trajectories, ...)     # a round's rows
    metrics = step_metrics(per_row, dp_group)                  # the step's multi_turn/*, env/*

A round's trajectories become a `RolloutBatch` whose response is everything after the
initial messages and whose `response_mask` is the loss mask (`rollout/trajectory.py`), so
old/reference log-probs, advantages, entropy, KL and the losses all read only the sampled
tokens. Their per-row facts (turns, environment reward, each environment metric, finish
reason, ...) ride along as `Round.per_row` values, so that dynamic sampling keeps them
with their rows and the step's metrics describe the rows it trains on.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from rl_megatron.config import Config
from rl_megatron.config_io import ConfigError
from rl_megatron.environments.loader import load_environment
from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.multi_turn import MultiTurnSession, TurnBudget
from rl_megatron.rollout.trajectory import (
    ChatIncrements,
    IncrementError,
    Trajectory,
    trajectory_batch,
)

__all__ = ["build_session", "trajectory_round", "step_metrics", "FINISH_REASONS"]

FINISH_REASONS = ("done", "max_turns", "turn_length", "context_length", "environment_error")
_PREFIX = "mt/"  # per-row keys in Round.per_row (trajectory facts, not rewards)


def build_session(config: Config, tokenizer, log: logging.Logger) -> MultiTurnSession | None:
    """The run's environment session, or None when `environment.function` is not set.

    The environment class is imported here, on every rank (a bad name fails everywhere in
    one line); its workers are forked only on the ranks that drive generation.
    """
    env = config.environment
    if env.function is None:
        return None
    factory = load_environment(env.function)
    # PromptTokenizer wraps the HF one; the synthetic tasks' tokenizer has a template aside.
    chat = getattr(tokenizer, "chat_tokenizer", None) or getattr(tokenizer, "tokenizer", tokenizer)
    tools = getattr(factory, "tools", None)
    try:
        increments = ChatIncrements(chat, tools=tools)
    except IncrementError as exc:
        raise ConfigError(f"environment.function: {env.function!r}: {exc}") from None
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"environment.function: the tokenizer cannot render chat turns for multi-turn "
            f"rollouts ({type(exc).__name__}: {exc}); use a tokenizer with a chat template"
        ) from None
    log.info(
        "multi-turn rollouts: %s, up to %d turns, stop tokens %s, end-of-turn tail %s",
        env.function,
        config.rollout.multi_turn.max_turns,
        sorted(increments.stop_token_ids),
        increments.tail,
    )
    return MultiTurnSession(
        factory,
        env.function,
        increments,
        TurnBudget.from_config(config.rollout),
        timeout_s=env.timeout_s,
        max_concurrent=env.max_concurrent,
        kwargs=env.kwargs,
        max_observation_chars=env.max_observation_chars,
    )


def trajectory_round(
    trajectories: list[Trajectory],
    *,
    with_log_probs: bool,
    pad_token_id: int,
    weight_version: int | None,
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """A round's trajectories as rollout rows, and their per-row facts (`[rows]` each,
    keyed `mt/<name>`; `mt/env_reward` is the environment's reward)."""
    rollout = trajectory_batch(
        trajectories,
        with_log_probs=with_log_probs,
        pad_token_id=pad_token_id,
        weight_version=weight_version,
    )
    rows: dict[str, list[float]] = {
        "env_reward": [t.reward for t in trajectories],
        "turns": [float(len(t.turns)) for t in trajectories],
        "observation_tokens": [float(sum(e - s for s, e in t.observations)) for t in trajectories],
        "sampled_tokens": [float(sum(t.loss_mask)) for t in trajectories],
        "length": [float(len(t.token_ids)) for t in trajectories],
        "env_time_s": [t.env_seconds for t in trajectories],
    }
    for reason in FINISH_REASONS:
        rows[f"finish_{reason}"] = [float(t.finish_reason == reason) for t in trajectories]
    for key in sorted({k for t in trajectories for k in t.metrics}):
        rows[f"env/{key}"] = [float(t.metrics.get(key, 0.0)) for t in trajectories]
    return rollout, {_PREFIX + k: torch.tensor(v, dtype=torch.float64) for k, v in rows.items()}


def step_metrics(per_row: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, float]:
    """The step's `multi_turn/*` (means per trajectory, maxima, finish counts) and `env/*`
    (each environment metric summed over the step's trajectories, and its mean per
    trajectory as `env/<name>_per_traj`), over every replica of `group`.

    Replicas may have seen different environment metric names (a tool never called on
    one): the names are agreed first, a missing one counting 0.
    """
    local = {k[len(_PREFIX) :]: v for k, v in per_row.items() if k.startswith(_PREFIX)}
    names = sorted(local)
    if dist.get_world_size(group) > 1:
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(gathered, names, group=group)
        names = sorted({n for part in gathered for n in part})
    rows = next(iter(local.values())).numel() if local else 0
    sums = torch.tensor(
        [float(local[n].sum()) if n in local else 0.0 for n in names] + [float(rows)],
        dtype=torch.float64,
    )
    maxima = torch.tensor(
        [float(local[n].max()) if n in local and rows else 0.0 for n in names], dtype=torch.float64
    )
    if dist.get_world_size(group) > 1:
        device = _device(group)
        sums, maxima = sums.to(device), maxima.to(device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        sums, maxima = sums.cpu(), maxima.cpu()
    count = max(float(sums[-1]), 1.0)
    total = dict(zip(names, sums.tolist()))
    peak = dict(zip(names, maxima.tolist()))
    out: dict[str, float] = {"multi_turn/trajectories": float(sums[-1])}
    for name in ("turns", "observation_tokens", "sampled_tokens", "length", "env_reward"):
        out[f"multi_turn/{name}_mean"] = total[name] / count
    out["multi_turn/turns_max"] = peak["turns"]
    out["multi_turn/length_max"] = peak["length"]
    out["multi_turn/env_time_s"] = total["env_time_s"]
    for reason in FINISH_REASONS:
        out[f"multi_turn/finish_{reason}"] = total[f"finish_{reason}"]
    for name in names:
        if name.startswith("env/"):
            out[name] = total[name]
            out[f"{name}_per_traj"] = total[name] / count
    return out


def _device(group: dist.ProcessGroup) -> torch.device | str:
    if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"
