"""Multi-turn rollouts on an engine that generates in batches: each wave of ready turns is
one `generate` call.

The default `RolloutEngine.generate_trajectories` (the Megatron engine's): the driver
(`multi_turn.run_trajectories`) runs on the group's first rank; whenever it asks for
finished turns, every turn submitted since the last wave is generated in one batch
(`n = 1`; one call per distinct turn budget in the wave, since a call's prompt limit is
the context minus its budget). Each turn draws with its own seed (`turn_seed`: its
trajectory's and turn's), so which turns share a wave, a matter of the environments'
timing, does not change what is sampled. Trajectories whose environments are slow do not
hold the others past the current wave, but a wave waits for its longest turn: the vLLM
engine, which takes each turn as it comes, overrides this (`rollout/vllm/`).

The other ranks of the group replay each wave's `generate` (it is collective) from the
leader's messages (`turn_channel.LeaderChannel`): ("wave", prompts, params), then
("done", result) or ("error", message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from rl_megatron.rollout.multi_turn import MultiTurnSession, Turn, turn_seed
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.trajectory import Trajectory
from rl_megatron.rollout.turn_channel import LeaderChannel

__all__ = ["generate_in_waves", "turn_sampling"]


def turn_sampling(sampling: SamplingParams, session: MultiTurnSession) -> SamplingParams:
    """One request per turn (n = 1), stopped by the template's end-of-turn tokens. The
    driver keeps every request within the context (`TurnBudget`): nothing to truncate."""
    return replace(
        sampling,
        n=1,
        stop_token_ids=session.stop_token_ids,
        prompt_overflow="reject",
        max_prompt_len=None,
    )


def group_leader(group: dist.ProcessGroup | None) -> int:
    """The global rank that drives `group` (its lowest); this rank alone without one."""
    if group is None:
        return dist.get_rank() if dist.is_initialized() else 0
    return min(dist.get_process_group_ranks(group))


class _Waves:
    """The leader's `TurnGenerator`: queues submissions, generates them as one wave."""

    def __init__(
        self, engine: Any, sampling: SamplingParams, channel: LeaderChannel, max_turns: int
    ) -> None:
        self.engine, self.sampling, self.channel = engine, sampling, channel
        self.max_turns = max_turns
        self.pending: list[tuple[str, list[int], int]] = []
        self.waves = 0
        self.calls = 0  # generate calls: one per distinct turn budget in a wave

    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.pending.append((request_id, list(prompt_token_ids), int(max_tokens)))

    def finished(self, timeout_s: float) -> list[Turn]:
        if not self.pending:
            return []
        wave, self.pending = self.pending, []
        # One call per turn budget: a call's prompt limit is the context minus its
        # max_new_tokens, so a long trajectory (a small budget, its room left) and a
        # short one (the full turn budget) in one call would reject the long one.
        turns = []
        for budget in sorted({m for _, _, m in wave}):
            turns += self._generate([w for w in wave if w[2] == budget], budget)
        self.waves += 1
        return turns

    def _generate(self, requests: list[tuple[str, list[int], int]], budget: int) -> list[Turn]:
        params = replace(self.sampling, max_new_tokens=budget)
        if self.sampling.seed is not None:  # request "<trajectory>-<turn>"
            ids = [tuple(int(x) for x in r.split("-")) for r, _, _ in requests]
            seeds = [turn_seed(self.sampling.seed, t, k, self.max_turns) for t, k in ids]
            params = replace(params, seed=None, prompt_seeds=tuple(seeds))
        prompts = [p for _, p, _ in requests]
        self.channel.send(("wave", prompts, params))
        batch = self.engine.generate(prompts, params, output_layout="full")
        turns = []
        for row, (request_id, _, _) in enumerate(requests):
            _, tokens = batch.row_tokens(row)
            reason = batch.finish_reasons[row]
            if reason in ("rejected", "abort"):  # the driver keeps every request in budget
                raise RuntimeError(
                    f"multi-turn: the engine returned {reason!r} for turn {request_id} "
                    f"({len(prompts[row])} tokens so far, {budget} new at most)"
                )
            logprobs = None
            if batch.rollout_log_probs is not None:
                logprobs = batch.rollout_log_probs[row, : len(tokens)].tolist()
            turns.append(Turn(request_id, tokens, logprobs, reason))
        self.calls += 1
        return turns


def generate_in_waves(
    engine: Any,
    samples: Sequence[Mapping[str, Any]],
    sampling: SamplingParams,
    session: MultiTurnSession,
    group: dist.ProcessGroup | None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """`RolloutEngine.generate_trajectories` for a batch-generating engine (module doc)."""
    channel = LeaderChannel(group, group_leader(group))
    params = turn_sampling(sampling, session)
    if not channel.is_leader:
        while True:
            message = channel.receive()
            if message[0] == "wave":
                engine.generate(message[1], message[2], output_layout="full")
            elif message[0] == "done":
                return message[1]
            else:
                raise RuntimeError(f"multi-turn rollout failed on the leading rank: {message[1]}")
    waves = _Waves(engine, params, channel, session.budget.max_turns)
    try:
        trajectories, metrics = session.run(samples, sampling.n, waves)
    except BaseException as exc:
        if channel.size > 1:
            channel.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        raise
    metrics["multi_turn/waves"] = float(waves.waves)
    metrics["multi_turn/generate_calls"] = float(waves.calls)
    channel.send(("done", (trajectories, metrics)))
    return trajectories, metrics
