"""A full disk as one line for the user: what was being written, what it needs, what is free.

    try:
        write(path)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(no_space_line(path, needed_bytes)) from None
        raise

A full disk (ENOSPC) or an exhausted quota (EDQUOT) is the user's to fix, like a bad
config: the trainer and the tools print `no space left on device writing <path>; <N> GB
needed, <M> GB free` and exit with code 2, and whoever was writing removes its partial
output first. N is the size of what was being written where known (a checkpoint's
expected bytes, a file's size), M the free space on `path`'s filesystem now.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shutil
from pathlib import Path

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\"]*)")


class DiskFullError(Exception):
    """A write failed for lack of space (ENOSPC / EDQUOT): one line, exit code 2."""


def disk_full_cause(exc: BaseException | None) -> OSError | None:
    """The ENOSPC / EDQUOT OSError behind `exc`, or None.

    Looks at `exc` itself, its cause / context chain (megatron-core re-raises a writer's
    error as a RuntimeError "from" it) and, for torch DCP's CheckpointException, the
    exceptions it carries per rank.
    """
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return e
        # An error that crossed processes pickled (megatron-core gathers a rank's writer
        # failure to rank 0 so) has lost its cause: only OSError's `[Errno 28]` text is left.
        found = _ERRNO_TEXT.search(str(e))
        if found and int(found.group(1)) in NO_SPACE:
            return OSError(int(found.group(1)), found.group(2))
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # {rank: (exception, traceback)}
            if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
                todo.append(failure[0])
    return None


def is_disk_full(exc: BaseException | None) -> bool:
    return disk_full_cause(exc) is not None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def gigabytes(n: int | None) -> str:
    """`n` bytes in decimal GB: two decimals, or two significant digits below 0.01 GB (a
    small file is not "0.00 GB")."""
    if n is None:
        return "?"
    x = n / 1e9
    if n == 0 or x >= 0.01:
        return f"{x:.2f}"
    return f"{x:.{1 - math.floor(math.log10(x))}f}"


def no_space_line(path: str | os.PathLike, needed: int | None) -> str:
    """`no space left on device writing <path>; <N> GB needed, <M> GB free`."""
    return (
        f"no space left on device writing {path}; {gigabytes(needed)} GB needed, "
        f"{gigabytes(free_bytes(path))} GB free"
    )


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the regular files under `path` (0 if it does not exist)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
