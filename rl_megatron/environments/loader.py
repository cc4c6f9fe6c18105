"""`environment.function` → the environment class the workers instantiate per trajectory.

A name is a built-in (`BUILTIN`), `"package.module:Name"` or `"path/to/file.py:Name"`, as
`reward.function` names a function. The class is imported here, in the trainer, once: the
workers are forked from it and need no import of their own (`workers.py`). Every failure is
one line naming `environment.function` and the module or file.
"""

from __future__ import annotations

import inspect
from typing import Any

from rl_megatron.utils.user_imports import (
    import_named_module,
)

__all__ = ["BUILTIN", "EnvironmentLoadError", "load_environment"]

# Built-in environments: name → "module:Name", imported only when named (the tool
# environment pulls in its tools).
BUILTIN: dict[str, str] = {
    "tool_calling": "rl_megatron.environments.tool_env:ToolEnvironment",
    "key_lookup": "rl_megatron.environments.key_lookup:KeyLookup",
}

_KEY = "environment.function"


class EnvironmentLoadError(ValueError):
    """The environment named in the config cannot be used; the message is one line."""


def load_environment(name: str) -> type[Any]:
    """The class (or factory) `name` designates, checked to make objects with start/step.

    The check reads the class's attributes (a factory's result is checked when a worker
    calls it): an object without `start` and `step` fails here, not at the first turn.
    """
    spec = BUILTIN.get(name, name)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise EnvironmentLoadError(
            f"{_KEY}: {name!r} must look like 'path/to/file.py:Name' or 'package.module:Name', "
            f"or be one of {', '.join(BUILTIN)}"
        )
    module = import_named_module(
        _KEY, name, module_name, "rl_megatron_user_env_", EnvironmentLoadError
    )
    if not hasattr(module, attr):
        raise EnvironmentLoadError(f"{_KEY}: {module_name!r} has no attribute {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise EnvironmentLoadError(
            f"{_KEY}: {name!r} is a {type(factory).__name__}, not a class or callable"
        )
    if inspect.isclass(factory):
        check_environment(factory, name)
    return factory


def check_environment(obj: Any, name: str) -> None:
    """EnvironmentLoadError unless `obj` (a class or an instance) has callable start/step."""
    missing = [m for m in ("start", "step") if not callable(getattr(obj, m, None))]
    if missing:
        what = obj.__name__ if inspect.isclass(obj) else type(obj).__name__
        raise EnvironmentLoadError(
            f"{_KEY}: {name!r}: {what} has no {' or '.join(missing)} method "
            "(subclass rl_megatron.environments.Environment)"
        )
