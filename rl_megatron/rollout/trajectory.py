"""Token in, token out: a multi-turn trajectory is one token sequence, never re-tokenized.

    prompt | turn 1 (sampled) | tail + observation 1 | turn 2 (sampled) | tail + obs 2 | ...
    mask 0 | 1 1 1 ... 1 <eot> | 0 0 0 0 0 0 0 0 0 0 | 1 1 1 ... 1 <eot> | 0 0 0 0 0 0 |

The sampled tokens are kept exactly as the engine produced them; decoding them to text and
tokenizing the text again is no bijection (a different split of the same words; Qwen3's
template even drops earlier turns' <think> content when it renders a history), and the
log-prob ratio of a token the policy never sampled is silently wrong. What the template
would put around the sampled tokens is computed once from the tokenizer (`ChatIncrements`):

* the prompt: the initial messages with the tools and the generation prompt;
* the tail: what the template writes after the assistant's stop token (Qwen's "\\n"
  after <|im_end|>; nothing after Llama-3's <|eot_id|>), appended after a turn that
  stopped, so the separator is never dropped (verl #6921);
* an observation's increment: the appended messages as the template renders them after an
  assistant turn, ending with the next generation prompt.

Budgets (`rollout.multi_turn`) end a trajectory cleanly, its reason in `finish_reason`:
"done" (the environment said so), "max_turns", "turn_length" (a turn cut at its token
budget, without its stop token), "context_length" (the total would pass
max_prompt_length + max_response_length: the observation that would not fit is not
appended), "environment_error". Tokens, mask and log-probs always have one length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_megatron.rollout.batch import FinishReason, RolloutBatch

__all__ = ["ChatIncrements", "IncrementError", "Trajectory", "trajectory_batch"]

# A fixed conversation the increments are measured after: the assistant's content is a
# sentinel word the rendering is searched for (templates differ around it).
_BASE_USER = "ping"
_BASE_ASSISTANT = "pong"


class IncrementError(ValueError):
    """The chat template does not render turns as increments; the message is one line."""


class ChatIncrements:
    """The chat template's tokens around sampled turns, computed once per tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> None:
        """
        Args:
            tokenizer: a Hugging Face tokenizer with a chat template.
            tools: tool schemas passed to the template (`Environment.tools`).
            stop_token_ids: the ids that end an assistant turn (the engine's stop tokens);
                default: the tokenizer's eos_token_id.
        """
        self.tokenizer, self.tools = tokenizer, tools
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id
            stop_token_ids = eos if isinstance(eos, list) else [eos]
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids if t is not None)
        if not self.stop_token_ids:
            raise IncrementError("chat template: no stop token id (the tokenizer has no eos)")
        self.tail = self._measure_tail()

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        """The template's tokens for `messages` (text first, then tokens without extras:
        the template writes its own BOS)."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The initial messages with the tools and the generation prompt."""
        return self.render(messages, generation_prompt=True)

    def increment(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens `messages` add after a finished assistant turn (tail excluded),
        ending with the generation prompt of the next turn."""
        base = [
            {"role": "user", "content": _BASE_USER},
            {"role": "assistant", "content": _BASE_ASSISTANT},
        ]
        full = self.render(base + list(messages), generation_prompt=True)
        end = self._assistant_end(full, "the base conversation followed by an observation")
        if full[end : end + len(self.tail)] != self.tail:
            raise IncrementError(
                "chat template: the assistant's end-of-turn tail differs when an observation "
                f"follows ({full[end : end + len(self.tail)]} vs {self.tail}); it cannot be "
                "rendered as increments"
            )
        return full[end + len(self.tail) :]

    def turn_text(self, token_ids: Sequence[int]) -> str:
        """A sampled turn as text for the environment (its stop token left out)."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _measure_tail(self) -> list[int]:
        base = [
            {"role": "user", "content": _BASE_USER},
            {"role": "assistant", "content": _BASE_ASSISTANT},
        ]
        prompt = self.render(base[:1], generation_prompt=True)
        full = self.render(base, generation_prompt=False)
        # The base's prompt must be a prefix of its rendering with the answer: what the
        # engine is given, then what it writes, then the tail.
        if full[: len(prompt)] != prompt:
            raise IncrementError(
                "chat template: the prompt with the generation prompt is not a prefix of the "
                "conversation with the assistant's answer; it cannot be rendered as increments"
            )
        return full[self._assistant_end(full, "the base conversation") :]

    def _assistant_end(self, ids: list[int], what: str) -> int:
        """Index after the stop token that ends the sentinel assistant message in `ids`."""
        sentinel = self.tokenizer.encode(_BASE_ASSISTANT, add_special_tokens=False)
        for start in range(len(ids) - len(sentinel) + 1):
            if ids[start : start + len(sentinel)] == sentinel:
                break
        else:
            raise IncrementError(f"chat template: {what} does not contain the assistant's text")
        for i in range(start + len(sentinel), len(ids)):
            if ids[i] in self.stop_token_ids:
                return i + 1
        raise IncrementError(
            f"chat template: no stop token {sorted(self.stop_token_ids)} after the assistant's "
            f"text in {what}; pass the engine's stop token ids"
        )


@dataclass
class Trajectory:
    """One sampled conversation as tokens. Spans are [start, end) indices of `token_ids`.

    group: the data record's index (GRPO groups are per record); sample: its `n`-th
    response. `logprobs` are the engine's, aligned with `token_ids`, 0 where `loss_mask`
    is 0. `reward`: the sum of the observations' rewards.
    """

    group: int
    sample: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    turns: list[tuple[int, int]] = field(default_factory=list)  # sampled spans
    observations: list[tuple[int, int]] = field(default_factory=list)  # tail + increment
    texts: list[dict[str, Any]] = field(default_factory=list)  # the conversation, for dumps
    reward: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # its observations' metrics, summed
    env_seconds: float = 0.0  # time its environment's calls took

    def set_prompt(self, token_ids: Sequence[int]) -> None:
        self._extend(token_ids, None, 0)
        self.prompt_length = len(self.token_ids)

    def add_turn(self, token_ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """The engine's sampled tokens, kept as they are (mask 1)."""
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} log-probs")
        start = len(self.token_ids)
        self._extend(token_ids, logprobs, 1)
        self.turns.append((start, len(self.token_ids)))

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """The tail and an observation's increment (mask 0: attended to, not trained on)."""
        start = len(self.token_ids)
        self._extend(token_ids, None, 0)
        self.observations.append((start, len(self.token_ids)))

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error

    @property
    def final_answer(self) -> str:
        for message in reversed(self.texts):
            if message.get("role") == "assistant":
                return str(message.get("content", ""))
        return ""

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    def _extend(self, token_ids: Sequence[int], logprobs: Sequence[float] | None, mask: int):
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([mask] * len(token_ids))
        if logprobs is None:
            self.logprobs.extend([0.0] * len(token_ids))
        else:
            self.logprobs.extend(float(x) for x in logprobs)


# Trajectory finish reasons → the batch's `FinishReason`: an environment's end or the turn
# budget is a stop; a cut at a token budget is a length; an environment error aborted it.
_BATCH_REASON = {
    "done": FinishReason.STOP,
    "max_turns": FinishReason.STOP,
    "turn_length": FinishReason.LENGTH,
    "context_length": FinishReason.LENGTH,
    "environment_error": FinishReason.ABORT,
}


def trajectory_batch(
    trajectories: Sequence[Trajectory],
    *,
    with_log_probs: bool,
    pad_token_id: int,
    weight_version: int | None = None,
) -> RolloutBatch:
    """Trajectories as a `RolloutBatch`: the prompt is the initial messages' tokens, the
    response everything after them (turns and observations), `response_mask` the loss mask
    (1 on sampled tokens only), `group_index` the trajectory's record (GRPO groups)."""
    for i, t in enumerate(trajectories):
        if t.finish_reason is None:
            raise ValueError(f"trajectory {i} (record {t.group}) has not finished")
    return RolloutBatch.from_sequences(
        prompts=[t.token_ids[: t.prompt_length] for t in trajectories],
        responses=[t.token_ids[t.prompt_length :] for t in trajectories],
        log_probs=[t.logprobs[t.prompt_length :] for t in trajectories] if with_log_probs else None,
        finish_reasons=[_BATCH_REASON[t.finish_reason] for t in trajectories],
        group_index=[t.group for t in trajectories],
        pad_token_id=pad_token_id,
        weight_version=weight_version,
        response_masks=[t.loss_mask[t.prompt_length :] for t in trajectories],
    )
