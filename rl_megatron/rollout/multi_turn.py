"""The engine-agnostic multi-turn driver: every trajectory advances on its own.

    trajectories, metrics = run_trajectories(samples, n, pool, increments, generator, budget)

A trajectory alternates generation (the `TurnGenerator`: an engine that takes token ids
and returns sampled token ids) and its environment (`environments.workers.EnvironmentPool`).
Its next turn is submitted as soon as its observation is ready, while the others are still
generating or waiting for their environments: no lock-step, so one slow tool call or one
long turn holds only its own trajectory. The loop polls the two sources in turn, each
with a short wait when the other has work in flight.

Budgets and finish reasons: `trajectory.py`. An environment error ends its trajectory
("environment_error", the one line in `Trajectory.error`), counted in the metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rl_megatron.environments.base import Observation
from rl_megatron.environments.workers import EnvironmentCallError, EnvironmentPool
from rl_megatron.rollout.trajectory import ChatIncrements, IncrementError, Trajectory

__all__ = ["MultiTurnSession", "Turn", "TurnBudget", "TurnGenerator", "run_trajectories"]


@dataclass
class Turn:
    """One generated turn: the engine's sampled ids, stop token included (vLLM keeps a stop
    token id in `token_ids`), and their log-probs. The driver reads a turn's end from its
    last token (`ChatIncrements.stop_token_ids`), not from `finish_reason` ("stop" or
    "length", for the engine's own records): a turn stopped by a stop *string* has no
    end-of-turn token to train on and is treated as cut. `request_id` is the one given to
    `submit`: "<trajectory index>-<turn index>"."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str


class TurnGenerator(Protocol):
    """What an engine offers the driver: submit requests, collect finished ones."""

    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Start generating one turn after `prompt_token_ids` (the whole trajectory so far)."""

    def finished(self, timeout_s: float) -> list[Turn]:
        """Turns finished since the last call, waiting at most `timeout_s` for the first."""


def turn_seed(seed: int | None, trajectory: int, turn: int, max_turns: int) -> int | None:
    """The seed of `trajectory`'s (index: record * n + sample) `turn`-th turn: a function of
    these alone, so a turn draws the same tokens whatever is generated beside it. The
    trainer spaces its calls' seeds by n * max_turns per record (`PPOTrainer._sampling`)."""
    return None if seed is None else seed + trajectory * max_turns + turn


@dataclass(frozen=True)
class TurnBudget:
    """`rollout.multi_turn` and the context the config allows."""

    max_turns: int  # rollout.multi_turn.max_turns
    max_turn_tokens: int  # rollout.multi_turn.max_turn_tokens (resolved)
    max_total_tokens: int  # rollout.max_prompt_length + rollout.max_response_length

    @classmethod
    def from_config(cls, rollout: Any) -> TurnBudget:
        mt = rollout.multi_turn
        return cls(
            max_turns=mt.max_turns,
            max_turn_tokens=mt.max_turn_tokens or rollout.max_response_length,
            max_total_tokens=rollout.max_prompt_length + rollout.max_response_length,
        )


class MultiTurnSession:
    """What an engine's `generate_trajectories` needs besides the records: the environment
    (its worker pool, made on first use, on the ranks that drive), the chat template's
    increments and the budgets. Built once by the trainer (`trainer/multi_turn.py`)."""

    def __init__(
        self,
        environment: Callable[..., Any],
        name: str,
        increments: ChatIncrements,
        budget: TurnBudget,
        *,
        timeout_s: float,
        max_concurrent: int,
        kwargs: Mapping[str, Any] | None = None,
        max_observation_chars: int = 16384,
    ) -> None:
        """
        Args:
            environment: the class `environments.loader.load_environment` returned.
            name: `environment.function` as the user wrote it (for messages).
            timeout_s, max_concurrent, kwargs, max_observation_chars: `environment.*`.
        """
        self.environment, self.name = environment, name
        self.increments, self.budget = increments, budget
        self._pool_args = dict(
            timeout_s=timeout_s,
            max_concurrent=max_concurrent,
            kwargs=dict(kwargs or {}),
            max_observation_chars=max_observation_chars,
        )
        self._pool: EnvironmentPool | None = None

    @property
    def pool(self) -> EnvironmentPool:
        """The environment workers (forked on first use: only driving ranks have them)."""
        if self._pool is None:
            self._pool = EnvironmentPool(self.environment, self.name, **self._pool_args)
        return self._pool

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end an assistant turn: the engine stops each turn at them."""
        return tuple(sorted(self.increments.stop_token_ids))

    def run(
        self,
        samples: Sequence[Mapping[str, Any]],
        n: int,
        generator: TurnGenerator,
        groups: Sequence[int] | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """`run_trajectories` with this session's pool, increments and budget."""
        return run_trajectories(
            samples, n, self.pool, self.increments, generator, self.budget, groups
        )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def run_trajectories(
    samples: Sequence[Mapping[str, Any]],
    n: int,
    pool: EnvironmentPool,
    increments: ChatIncrements,
    generator: TurnGenerator,
    budget: TurnBudget,
    groups: Sequence[int] | None = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Run `n` trajectories per data record to their ends, concurrently.

    Args:
        samples: the step's data records `[records]`.
        n: trajectories per record (`rollout.n`).
        groups: each record's group index (default: its position); GRPO groups by it.

    Returns:
        trajectories ordered by record, then by n (`[records * n]`), and the metrics.
    """
    groups = list(range(len(samples))) if groups is None else list(groups)
    if len(groups) != len(samples):
        raise ValueError(f"{len(groups)} group indices but {len(samples)} samples")
    trajs = [Trajectory(group=groups[i], sample=j) for i in range(len(samples)) for j in range(n)]
    turn_count = [0] * len(trajs)
    env_metrics: dict[str, float] = {}
    live = set(range(len(trajs)))
    generating: dict[str, int] = {}  # request id → trajectory index

    def end(t: int, reason: str, error: str | None = None) -> None:
        trajs[t].finish(reason, error)
        live.discard(t)
        pool.close(t)

    def submit(t: int) -> None:
        traj = trajs[t]
        room = budget.max_total_tokens - len(traj.token_ids)
        request_id = f"{t}-{turn_count[t]}"
        generating[request_id] = t
        generator.submit(request_id, list(traj.token_ids), min(budget.max_turn_tokens, room))

    def on_environment(t: int, result: Any) -> None:
        traj = trajs[t]
        if isinstance(result, EnvironmentCallError):
            return end(t, "environment_error", str(result))
        if isinstance(result, list):  # start: the initial messages
            traj.texts.extend(result)
            prompt = increments.prompt(result)
            traj.set_prompt(prompt)
            if len(prompt) >= budget.max_total_tokens:  # no room for a single token
                return end(t, "context_length")
            return submit(t)
        assert isinstance(result, Observation)
        traj.reward += result.reward
        for key, value in result.metrics.items():
            env_metrics[key] = env_metrics.get(key, 0.0) + value
            traj.metrics[key] = traj.metrics.get(key, 0.0) + value
        if result.done:
            return end(t, "done")
        if turn_count[t] >= budget.max_turns:
            return end(t, "max_turns")
        try:
            added = increments.tail + increments.increment(result.messages)
        except IncrementError as exc:
            return end(t, "environment_error", str(exc))
        # At least one token of the next turn must fit after the observation.
        if len(traj.token_ids) + len(added) >= budget.max_total_tokens:
            return end(t, "context_length")
        traj.texts.extend(result.messages)
        traj.add_observation(added)
        submit(t)

    def on_turn(turn: Turn) -> None:
        t = generating.pop(turn.request_id)
        traj = trajs[t]
        turn_count[t] += 1
        traj.add_turn(turn.token_ids, turn.logprobs)
        text = increments.turn_text(turn.token_ids)
        traj.texts.append({"role": "assistant", "content": text})
        stopped = bool(turn.token_ids) and turn.token_ids[-1] in increments.stop_token_ids
        if not stopped:  # cut at a budget: no stop token, so no clean end of turn
            at_total = len(traj.token_ids) >= budget.max_total_tokens
            return end(t, "context_length" if at_total else "turn_length")
        pool.step(t, text)

    started, timeouts_before, waited_before = time.monotonic(), pool.timeouts, pool.waited
    forks_before = pool.forks
    engine_idle_s = 0.0  # waiting on environments with no turn generating
    pool.seconds.clear()  # per trajectory index, of this call
    for t, sample in enumerate(s for s in samples for _ in range(n)):
        pool.start(t, sample)
    try:
        while live:
            env_busy, gen_busy = pool.pending > 0, bool(generating)
            if env_busy:  # no wait while the engine has work: its step is the pause
                waiting_from = time.monotonic()
                results = pool.ready(0.0 if gen_busy else 1.0)
                if not gen_busy:
                    engine_idle_s += time.monotonic() - waiting_from
                for t, result in results:
                    if t in live:
                        on_environment(t, result)
            if gen_busy:
                for turn in generator.finished(0.0 if env_busy else 1.0):
                    on_turn(turn)
            if not env_busy and not gen_busy and live:
                raise RuntimeError(f"trajectories {sorted(live)[:8]} wait on nothing")
    finally:
        for t in list(live):
            pool.close(t)
        pool.wait_for_closes()  # so the next call's starts reuse these workers
    timeouts = pool.timeouts - timeouts_before
    wall_s = time.monotonic() - started
    for t, traj in enumerate(trajs):
        traj.env_seconds = float(pool.seconds.get(t, 0.0))
    metrics = _metrics(trajs, turn_count, pool.seconds, timeouts, env_metrics, wall_s)
    metrics["multi_turn/waited_for_worker"] = float(pool.waited - waited_before)
    metrics["multi_turn/env_workers_forked"] = float(pool.forks - forks_before)
    metrics["multi_turn/engine_idle_s"] = engine_idle_s
    return trajs, metrics


def _metrics(
    trajs: list[Trajectory],
    turn_count: list[int],
    env_seconds: Mapping[Hashable, float],
    timeouts: int,
    env_metrics: dict[str, float],
    wall_s: float,
) -> dict[str, float]:
    count = max(len(trajs), 1)
    observation_tokens = [sum(e - s for s, e in t.observations) for t in trajs]
    out = {
        "multi_turn/turns_mean": sum(turn_count) / count,
        "multi_turn/turns_max": float(max(turn_count, default=0)),
        "multi_turn/observation_tokens_mean": sum(observation_tokens) / count,
        "multi_turn/length_mean": sum(len(t.token_ids) for t in trajs) / count,
        "multi_turn/length_max": float(max((len(t.token_ids) for t in trajs), default=0)),
        "multi_turn/env_time_s": float(sum(env_seconds.values())),
        "multi_turn/env_errors": float(sum(t.finish_reason == "environment_error" for t in trajs)),
        "multi_turn/env_timeouts": float(timeouts),
        "timing_s/multi_turn": wall_s,
    }
    for reason in ("done", "max_turns", "turn_length", "context_length", "environment_error"):
        out[f"multi_turn/finish_{reason}"] = float(sum(t.finish_reason == reason for t in trajs))
    for key, value in env_metrics.items():
        out[f"env/{key}"] = value if math.isfinite(value) else math.nan
    return out
