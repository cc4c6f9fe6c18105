"""Apply a reward function to a batch of responses without letting one sample kill the run.

A call that raises (or calls `sys.exit`), or returns something that is not a finite
number, is an *error*: with `on_error="score"` the sample gets `error_score` and is counted
in `reward/errors` (and a summary line is logged); with `on_error="raise"` the batch stops
with a one-line `RewardError` naming the function and the sample. Nothing is skipped
silently; KeyboardInterrupt is not an error of the sample and propagates.

A batch has a time budget (`budget_s`): the ranks that do not score wait for this one in a
collective that fails after `parallel.timeout_s`, so a function that is slow on many
samples (each within its own limit, `user_calls.TimedWorker`) stops the run in one line
before that, whatever `on_error` says.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from rl_megatron.rewards.registry import RewardError, RewardFn

__all__ = ["CallError", "OnError", "as_score", "describe", "score_batch"]

OnError = Literal["score", "raise"]

_HINT = "set reward.on_error=score to score such samples reward.error_score"


class CallError(Exception):
    """A call failed in a way its message already describes (a time-out, a dead worker).

    `hint`: what the user can do, for the one line of `on_error="raise"`.
    """

    def __init__(self, message: str, hint: str = _HINT) -> None:
        super().__init__(message)
        self.hint = hint


def score_batch(
    fn: RewardFn,
    responses: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
    on_error: OnError = "score",
    error_score: float = 0.0,
    names: Sequence[str] | None = None,
    logger: logging.Logger | None = None,
    budget_s: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Score each response against its sample.

    Args:
        fn: `fn(response_text, sample) -> float` (see `registry.get_reward_fn`).
        responses: decoded response texts, `[batch]`.
        samples: the dataset records the responses answer, `[batch]` (repeat a record for
            each of its `n` responses).
        on_error: `score` (use `error_score`, count it) or `raise` (stop on the first error).
        error_score: the score of a failed sample.
        names: optional labels of the samples (e.g. `"train.jsonl:17"`) for messages.
        logger: where the per-batch error summary goes (default: the `rl_megatron` logger).
        budget_s: seconds the whole batch may take; past them (checked after each call)
            RewardError, whatever `on_error` says. None = no budget.

    Returns:
        scores: float32 tensor `[batch]`.
        metrics: this rank's `reward/mean` (over all samples, failed ones included at
            `error_score`; NaN for an empty batch), `reward/std` and `reward/errors` (a
            count; sum it across DP ranks).
    """
    if len(responses) != len(samples):
        raise ValueError(f"{len(responses)} responses but {len(samples)} samples")
    if on_error not in ("score", "raise"):
        raise RewardError(f"reward.on_error: {on_error!r} is not one of score, raise")
    if names is not None and len(names) != len(samples):
        raise ValueError(f"{len(names)} names but {len(samples)} samples")
    fn_name = getattr(fn, "__name__", type(fn).__name__)

    scores: list[float] = []
    errors: list[str] = []
    started = time.monotonic()
    for i, (response, sample) in enumerate(zip(responses, samples)):
        spent = time.monotonic() - started
        if budget_s is not None and spent > budget_s:
            raise RewardError(
                f"reward function {fn_name!r} took {spent:.0f} s for {i} of {len(samples)} "
                f"samples, past the batch's budget of {budget_s:g} s (half of "
                "parallel.timeout_s, which the other ranks wait for the scores at most); "
                f"{len(errors)} failed" + (f", first: {errors[0]}" if errors else "") + "; "
                "make it faster, lower reward.timeout_s or raise parallel.timeout_s"
            )
        try:
            value = as_score(fn(response, sample))
        # Any failure of user code is the sample's error, `sys.exit` included (SystemExit
        # is a BaseException; uncaught it would end this rank alone and leave the others
        # waiting in a collective). KeyboardInterrupt is the user's, not the function's:
        # it still stops the run.
        except (Exception, SystemExit) as exc:
            where = f"sample {i}" + (f" ({names[i]})" if names is not None else "")
            message = f"{where}: {describe(exc)}"
            if on_error == "raise":
                hint = exc.hint if isinstance(exc, CallError) else _HINT
                raise RewardError(
                    f"reward function {fn_name!r} failed on {message} ({hint})"
                ) from exc
            errors.append(message)
            value = float(error_score)
        scores.append(value)

    if errors:
        (logger or logging.getLogger("rl_megatron")).warning(
            "reward: %d of %d samples failed in %r and scored %s; first: %s",
            len(errors),
            len(samples),
            fn_name,
            error_score,
            errors[0],
        )
    tensor = torch.tensor(scores, dtype=torch.float32)
    metrics = {
        "reward/mean": tensor.mean().item() if len(scores) else math.nan,
        "reward/std": tensor.std(unbiased=False).item() if len(scores) else math.nan,
        "reward/errors": float(len(errors)),
    }
    return tensor, metrics


def as_score(value: Any) -> float:
    """`value` as a finite float, or TypeError/ValueError saying why it is not one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"returned a tensor of shape {tuple(value.shape)}, not a number")
        value = value.item()
    # numbers.Real covers bool, int, float and numpy scalars; str, None, lists are refused.
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {_short(repr(value))}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    return score


def describe(exc: BaseException) -> str:
    """What went wrong in a call, in a few words on one line."""
    if isinstance(exc, CallError):
        return _one_line(exc)
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return _short(text, 200) if text else "no message"


def _short(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
