"""Import the module a config names for user code: `package.module` or `path/to/file.py`.

Shared by `reward.function` (`rewards/registry.py`) and `environment.function`
(`environments/loader.py`); each caller puts its own key in front of the messages.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["UserFileError", "first_line", "import_named_module", "import_user_module"]


class UserFileError(ImportError):
    """The named file is missing or is no Python module; the message is one line."""


def import_user_module(module_name: str, prefix: str) -> ModuleType:
    """`module_name` imported: a `.py` path as a module `<prefix><stem>`, else by name.

    Raises UserFileError for a missing or unloadable file; whatever the module raises
    while importing (any exception, SystemExit included) propagates to the caller.
    """
    if module_name.endswith(".py"):
        return _import_file(Path(module_name), prefix)
    return importlib.import_module(module_name)


def import_named_module(
    key: str, spec: str, module_name: str, prefix: str, error: type[Exception]
) -> ModuleType:
    """`import_user_module`, every failure an `error` whose one line starts with `key` (the
    setting, e.g. "reward.function") and names `spec` (its value) and what went wrong."""
    try:
        return import_user_module(module_name, prefix=prefix)
    except UserFileError as exc:
        raise error(f"{key}: {exc}") from None
    except (Exception, SystemExit) as exc:  # a user module can fail to import in any way
        raise error(
            f"{key}: cannot import {module_name!r} for {spec!r} "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from None


def _import_file(path: Path, prefix: str) -> ModuleType:
    if not path.is_file():
        raise UserFileError(f"file not found: {path}")
    name = f"{prefix}{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserFileError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # lets the module pickle / import its own names
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def first_line(exc: BaseException) -> str:
    """An exception's first line of text, for one-line messages."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
