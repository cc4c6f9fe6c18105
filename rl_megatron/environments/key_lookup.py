"""The multi-turn demo's environment (`environment.function: key_lookup`).

The record's key has a hidden one-digit value (`data.synthetic_task: key_lookup`). A turn
that holds "?" calls the lookup tool: the observation is a tool message with the value. Any
other turn is the answer, scored as `digit_echo` scores a response against the value, and
ends the trajectory. So the value is only known after a tool call, and a policy that
learns the task learns to call the tool first (`env/tool_calls_per_traj` climbs with the
reward). A tiny model over characters can find a one-character action by sampling; a JSON
tool call (`tool_calling`) is for real models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_megatron.environments.base import Environment, Message, Observation
from rl_megatron.rewards.rules import digit_echo

__all__ = ["KeyLookup"]

TOOL_CALL = "?"


class KeyLookup(Environment):
    def start(self, sample: Mapping[str, Any]) -> list[Message]:
        self.value, self.called = str(sample["answer"]), False
        return [{"role": "user", "content": str(sample["prompt"])}]

    def step(self, response: str) -> Observation:
        if TOOL_CALL in response:
            self.called = True
            return Observation(
                messages=[{"role": "tool", "content": self.value}],
                metrics={"tool_calls": 1.0},
            )
        return Observation(
            reward=digit_echo(response, {"answer": self.value}),
            done=True,
            metrics={"tool_calls": 0.0, "answers_after_tool": float(self.called)},
        )
