"""Processes forked from the trainer to run user code: started, entered and killed alike.

Shared by the reward worker (`rewards/user_calls.py`) and the environment workers
(`environments/workers.py`); their module docstrings say why a fork (no pickling, no
interpreter start) and why SIGKILL (a hung call ignores anything gentler).

    pid, conn = fork_worker(lambda conn: serve(conn))   # serve runs in the child
    how = kill_worker(pid, conn)                        # "killed by SIGKILL", "exit code 3"
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

__all__ = ["fork_worker", "kill_worker"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def fork_worker(serve: Callable[[Connection], None]) -> tuple[int, Connection]:
    """Fork a worker that runs `serve(its end of a pipe)` and exits; (pid, the trainer's end).

    The worker ignores SIGINT and SIGTERM (its life is the trainer's: Ctrl-C and Slurm's
    SIGTERM reach the trainer, which finishes the step) and dies with the thread that
    forked it (PR_SET_PDEATHSIG on Linux, at once even inside the user's C code). It never
    returns into the trainer's code.
    """
    parent_pid = os.getpid()
    here, there = multiprocessing.Pipe()
    # Flushed first, or the child would print the trainer's buffered output again.
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            here.close()
            if _enter_worker(parent_pid):
                serve(there)
            code = 0
        finally:
            os._exit(code)
    there.close()
    return pid, here


def _enter_worker(parent_pid: int) -> bool:
    """The worker's signals; False when the trainer died before they were set."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    return os.getppid() == parent_pid


def kill_worker(pid: int, conn: Connection | None) -> str:
    """Close the pipe, SIGKILL and reap `pid`; how it ended, for messages."""
    if conn is not None:
        conn.close()
    with contextlib.suppress(ProcessLookupError):  # not reaped yet, so not expected
        os.kill(pid, signal.SIGKILL)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "already reaped"
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"
