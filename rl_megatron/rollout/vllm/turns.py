"""Multi-turn rollouts on vLLM: each turn joins the running batch as soon as it is ready.

`VllmEngine.generate_trajectories` drives its replica's share of the records through
`multi_turn.run_trajectories` with `CoreTurns` as the `TurnGenerator`: `submit` adds the
turn's request to the engine core at once, `finished` runs one engine step and returns
the turns that ended in it. A trajectory's next turn therefore decodes alongside the
others' current ones (continuous batching across turns), where the default path
(`turn_waves.py`) waits for a wave's longest turn.

With rollout TP > 1 every rank of the replica runs its own engine core, and those must
see the same requests before the same step. The replica's first rank drives (the
environments run there); before each engine step it sends the others the requests it
added since the last step (`LeaderChannel` over a gloo group of the replica's ranks):
first ("turns", the vLLM params every turn shares), then ("step", [(request id, prompt,
seed, max tokens), ...]) per step, then ("done", result) or ("error", message). The
followers replay the adds (`CoreLoop.add_turn`, as the leader) and the step.

Each turn's seed is a function of its trajectory and turn only (`turn_seed`), so a
trajectory samples the same whatever else runs beside it or which replica runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rl_megatron.rollout.multi_turn import MultiTurnSession, Turn, turn_seed
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.trajectory import Trajectory
from rl_megatron.rollout.turn_channel import LeaderChannel
from rl_megatron.rollout.turn_waves import turn_sampling
from rl_megatron.rollout.vllm.core_loop import CoreLoop
from rl_megatron.rollout.vllm.io import convert_sample, to_vllm_sampling_params

__all__ = ["CoreTurns", "drive_turns"]


class CoreTurns:
    """The driving rank's `TurnGenerator` on a `CoreLoop` (module docstring).

    first_trajectory: the global index of this replica's trajectory 0 (its share's first
    record × n), so that request "<t>-<turn>" seeds as trajectory first + t.
    """

    def __init__(
        self,
        loop: CoreLoop,
        sampling: SamplingParams,
        stop_token_ids: Sequence[int],
        channel: LeaderChannel,
        *,
        max_turns: int,
        first_trajectory: int = 0,
        calculate_log_probs: bool = True,
    ) -> None:
        self.loop, self.sampling, self.channel = loop, sampling, channel
        self.stop_token_ids = list(stop_token_ids)
        self.max_turns, self.first = max_turns, first_trajectory
        self.with_lp = calculate_log_probs
        # Every turn's vLLM params but its seed and cap (`CoreLoop.add_turn`).
        self.like = to_vllm_sampling_params(
            sampling, self.stop_token_ids, None, calculate_log_probs=calculate_log_probs
        )
        self._added: list[tuple[str, list[int], int | None, int]] = []  # since the last step
        self.steps = 0

    def submit(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        t, turn = (int(x) for x in request_id.split("-"))
        seed = turn_seed(self.sampling.seed, self.first + t, turn, self.max_turns)
        prompt = list(prompt_token_ids)
        self.loop.add_turn(request_id, prompt, self.like, seed, int(max_tokens))
        self._added.append((request_id, prompt, seed, int(max_tokens)))

    def finished(self, timeout_s: float) -> list[Turn]:
        """One engine step (it takes as long as it takes: `timeout_s` is not needed)."""
        if not self.loop.running:
            return []
        added, self._added = self._added, []
        self.channel.send(("step", added))
        self.steps += 1
        turns = []
        for request_id, sample in self.loop.step():
            tokens, logprobs, reason = convert_sample(0, sample, calculate_log_probs=self.with_lp)
            if reason.name in ("REJECTED", "ABORT"):  # the driver keeps requests in budget
                raise RuntimeError(
                    f"multi-turn: vLLM returned {reason.name.lower()!r} for turn {request_id}"
                )
            turns.append(Turn(request_id, tokens, logprobs, reason.name.lower()))
        return turns


def follow_turns(loop: CoreLoop, channel: LeaderChannel) -> tuple[list[Trajectory], dict]:
    """A follower rank of the replica: replay the leader's adds and steps until its end."""
    like = None
    try:
        while True:
            message = channel.receive()
            if message[0] == "turns":
                like = message[1]
            elif message[0] == "step":
                for request_id, prompt, seed, max_tokens in message[1]:
                    loop.add_turn(request_id, prompt, like, seed, max_tokens)
                loop.step()
            elif message[0] == "done":
                return message[1]
            else:
                raise RuntimeError(f"multi-turn rollout failed on the leading rank: {message[1]}")
    finally:
        loop.abort()  # nothing runs after "done"; after an error, the engine is clean


def drive_turns(
    loop: CoreLoop,
    channel: LeaderChannel,
    samples: Sequence[Mapping[str, Any]],
    groups: Sequence[int],
    sampling: SamplingParams,
    session: MultiTurnSession,
    *,
    first_trajectory: int,
    calculate_log_probs: bool,
    eos_token_ids: Sequence[int] = (),
) -> tuple[list[Trajectory], dict[str, float]]:
    """One replica's records to their trajectories (every rank of the replica returns
    them): the leader runs the session on `CoreTurns`, the others follow."""
    if not channel.is_leader:
        return follow_turns(loop, channel)
    params = turn_sampling(sampling, session)
    generator = CoreTurns(
        loop,
        params,
        params.resolved_stop_token_ids(eos_token_ids),  # as `generate` resolves them
        channel,
        max_turns=session.budget.max_turns,
        first_trajectory=first_trajectory,
        calculate_log_probs=calculate_log_probs,
    )
    try:
        channel.send(("turns", generator.like))  # the followers' `like` for every turn
        trajectories, metrics = session.run(samples, sampling.n, generator, groups)
    except BaseException as exc:
        loop.abort()
        if channel.size > 1:
            channel.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        raise
    metrics["multi_turn/engine_steps"] = float(generator.steps)
    channel.send(("done", (trajectories, metrics)))
    return trajectories, metrics
