"""`reward.function` → a callable `fn(response_text, sample) -> float`.

A name is either a built-in rule (`gsm8k`, `boxed_math`, `exact_match`; see `rules.py`) or a
user function `"package.module:function"` (or `"path/to/file.py:function"`). User modules
are imported once per process and cached; every failure to get a usable function is one
line naming the setting, the module and what went wrong.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rl_megatron.rewards.rules import RULES
from rl_megatron.utils.user_imports import (
    import_named_module,
)

if TYPE_CHECKING:
    from rl_megatron.config import Config

__all__ = ["RewardError", "RewardFn", "get_reward_fn", "reward_fn_from_config"]

RewardFn = Callable[[str, Mapping[str, Any]], float]

# "spec" → the imported function: a user module is imported once, however often asked.
_USER_FUNCTIONS: dict[str, RewardFn] = {}


class RewardError(ValueError):
    """A reward function cannot be found or failed; the message is one line."""


def get_reward_fn(name: str, answer_key: str = "answer") -> RewardFn:
    """The reward function called `name`.

    Args:
        name: a key of `rules.RULES`, or `"package.module:function"`, or
            `"path/to/file.py:function"`.
        answer_key: the sample field built-in rules compare with (`data.answer_key`);
            user functions receive the whole sample and pick their own fields.

    Raises RewardError when the name is unknown, the module cannot be imported, or the
    attribute is missing, not callable or cannot take `(response_text, sample)`.
    """
    if name in RULES:
        rule = functools.partial(RULES[name], answer_key=answer_key)
        rule.__name__ = name  # type: ignore[attr-defined]  # named in error messages
        return rule
    if ":" not in name:
        raise RewardError(
            f"reward.function: unknown reward {name!r}; use one of {', '.join(RULES)} "
            "or 'package.module:function'"
        )
    if name not in _USER_FUNCTIONS:
        _USER_FUNCTIONS[name] = _import_user_function(name)
    return _USER_FUNCTIONS[name]


def reward_fn_from_config(config: Config) -> RewardFn:
    """`reward.function` with `data.answer_key`."""
    return get_reward_fn(config.reward.function, config.data.answer_key)


def _import_user_function(spec: str) -> RewardFn:
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise RewardError(f"reward.function: {spec!r} must look like 'package.module:function'")
    module = import_named_module(
        "reward.function", spec, module_name, "rl_megatron_user_reward_", RewardError
    )
    if not hasattr(module, attr):
        raise RewardError(f"reward.function: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward.function: {spec!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("", {})
    except TypeError:
        raise RewardError(
            f"reward.function: {spec!r} must accept (response_text, sample), its signature "
            f"is {attr}{inspect.signature(fn)}"
        ) from None
    except ValueError:
        pass  # builtins without a signature: trust them, errors surface when scoring
    return fn
