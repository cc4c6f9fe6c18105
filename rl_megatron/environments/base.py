"""What a user implements to put the policy in a multi-turn environment.

    # my_env.py, named in the config as  environment.function: my_env.py:Lookup
    class Lookup(Environment):
        def start(self, sample):                 # the data record
            return [{"role": "user", "content": sample["question"]}]

        def step(self, response):                # the policy's turn, as text
            if "<answer>" in response:
                return Observation(reward=float(sample_answer in response), done=True)
            return Observation(messages=[{"role": "tool", "content": lookup(response)}])

One instance per trajectory, made by calling the named class with no arguments (or with
`environment.kwargs`), so it may keep whatever state the trajectory needs. The trainer
calls `start` once, then `step` after every turn of the policy until an observation says
`done` or a budget ends the trajectory (`rollout.multi_turn`), then `close`.

The environment sees text: the policy's turn decoded for it to read. What the policy is
trained on never goes through that text: the trajectory keeps the sampled tokens as the
engine produced them, and an observation's messages become tokens through the model's
chat template (`rollout/trajectory.py`), never by re-tokenizing the policy's words.

Calls run in a worker process with a time limit per call (`environment.timeout_s`,
`environments/workers.py`); a call that raises, hangs past the limit, kills its process or
returns something that is not an `Observation` ends that trajectory only, with finish
reason `environment_error`, counted in the step's metrics.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Environment", "Observation", "Message"]

Message = dict[str, Any]  # a chat message: {"role": ..., "content": ...} (+ tool fields)


@dataclass
class Observation:
    """What the environment answers to one turn of the policy.

    messages: chat messages appended to the conversation after the policy's turn (a tool
        result: role "tool"; a user's reply: role "user"); rendered into tokens by the
        model's chat template. Empty with `done`.
    reward: this turn's contribution; a trajectory's reward is the sum over its turns
        (plus the rule reward of `reward.function`, when one is set).
    done: the trajectory ends after this turn.
    metrics: counts this turn adds to the step's metrics under `env/<name>` (summed over
        the step's trajectories), e.g. {"tool_calls": 1, "tool_errors": 0}.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(abc.ABC):
    """One trajectory's environment (see the module docstring)."""

    # Tool schemas (JSON-schema dicts, as `transformers`' `apply_chat_template(tools=...)`
    # takes them) the chat template renders into the prompt; None: no tools.
    tools: list[dict[str, Any]] | None = None

    @abc.abstractmethod
    def start(self, sample: Mapping[str, Any]) -> list[Message]:
        """The conversation's first messages for data record `sample` (a system prompt and
        the user's question, typically); the policy writes the next turn."""

    @abc.abstractmethod
    def step(self, response: str) -> Observation:
        """The policy's turn (decoded text, its end-of-turn token left out) → the next
        observation."""

    def close(self) -> None:  # noqa: B027  (optional: most environments hold nothing)
        """The trajectory ended (any way); release what `start` acquired."""
