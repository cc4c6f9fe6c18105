"""The multi-turn demo's environment (`environment.function: key_lookup`).

The record's key has a hidden one-digit value (`data.synthetic_task: key_lookup`). Each
turn of the policy is one of:
* an answer citing the lookup: a turn holding "=" answers with what the last lookup
  returned (reward 1 after a lookup; without one it cites nothing: a wrong answer);
* a direct answer: a turn holding a digit answers with its first digit (reward 1 if it is
  the value: a guess is right one time in ten);
* a lookup (anything else): the tool answers with the value, as a tool message; after
  one lookup, anything else is an empty answer (looking up again would teach nothing).
An answer ends the trajectory; a wrong one still gets 0.1, an answer's credit for ending
its turns cleanly (the engine's stop token), which a random model first has to learn.

So the task can only be solved through the tool: guessing is worth 0.19 on average, a
lookup followed by "=" 1.0, and `env/tool_calls_per_traj` climbs with the reward. The
answer cites the lookup rather than repeating its digit: a 4-layer model does not learn to
copy a digit within a demo's length (digit_echo shows it, DESIGN.md §7), and what this
demo shows is the policy learning to call a tool and use its result, over turns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_megatron.environments.base import Environment, Message, Observation

__all__ = ["KeyLookup", "CITE", "CLEAN_ANSWER_CREDIT"]

CITE = "="
CLEAN_ANSWER_CREDIT = 0.1


class KeyLookup(Environment):
    def start(self, sample: Mapping[str, Any]) -> list[Message]:
        self.value, self.looked_up = str(sample["answer"]), None
        return [{"role": "user", "content": str(sample["prompt"])}]

    def step(self, response: str) -> Observation:
        digits = [c for c in response if c.isdigit()]
        if CITE in response:
            answer = self.looked_up
        elif digits:
            answer = digits[0]
        elif self.looked_up is not None:  # one lookup is enough: this is an empty answer
            answer = None
        else:  # a lookup
            self.looked_up = self.value
            return Observation(
                messages=[{"role": "tool", "content": self.value}],
                metrics={"tool_calls": 1.0},
            )
        right = answer == self.value
        return Observation(
            reward=1.0 if right else CLEAN_ANSWER_CREDIT,
            done=True,
            metrics={
                "tool_calls": 0.0,
                "answers_citing_tool": float(CITE in response and self.looked_up is not None),
                "answers_right": float(right),
            },
        )
