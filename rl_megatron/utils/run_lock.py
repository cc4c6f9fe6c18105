"""One run per run directory: a kernel lock on `run_dir/run.lock`, held by global rank 0.

    with distributed_run(...) as run, run_dir_lock(config.run_dir) as lock:
        if lock.refusal:                   # the same on every rank
            ...                            # print it once (rank 0), exit 2

Two launches into the same `trainer.output_dir/trainer.experiment_name` would interleave
their metrics, overwrite each other's checkpoints and delete each other's old ones, so the
second is refused with one line naming the holder (host, pid, start time).

The lock is `fcntl.flock` on an open file description, not a pid file: the kernel drops it
when the holder's last descriptor closes, so it is released on every way out — normal exit,
exception, SIGTERM, SIGKILL, OOM kill — and a lock file left by a dead run blocks nothing.
The file itself is never deleted (deleting it would let two runs lock two different inodes
of the same name); the holder's `host`, `pid` and `started` are written into it, for the
refusal message only.

Only global rank 0 takes the lock and broadcasts the outcome (one collective), so every
rank refuses together and none waits in a later collective. One rank suffices because the
run directory must be one shared directory for the whole run anyway (every rank writes its
checkpoint shards there). On a filesystem without lock support (e.g. Lustre mounted without
`flock`) the run goes on unlocked after one warning: refusing to train there would be worse.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

__all__ = ["LOCK_NAME", "LockOutcome", "RunDirLock", "run_dir_lock"]

LOCK_NAME = "run.lock"
# flock errors that mean "this filesystem does not lock", not "someone holds it".
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirLock:
    """An exclusive, non-blocking lock on `run_dir/run.lock` for this process.

    `acquire()` returns None when this process holds the lock (or the filesystem cannot
    lock), else the one-line refusal naming the holder. `release()` is idempotent.
    """

    def __init__(self, run_dir: str | os.PathLike, logger: logging.Logger | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.log = logger or logging.getLogger("rl_megatron")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # No O_TRUNC: until the lock is ours, the file holds the holder's details.
        # os.open's descriptors are close-on-exec, so exec'd helpers do not inherit it.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return self._refusal()
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_LOCKING:
                raise
            self.log.warning(
                "run directory %s: the filesystem cannot lock %s (%s); running without the "
                "run-directory lock, so make sure no other run uses this directory",
                self.run_dir,
                self.path.name,
                os.strerror(exc.errno),
            )
            return None
        self._fd = fd
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        return None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a reader never sees a finished run's details as a holder
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _refusal(self) -> str:
        try:
            holder = json.loads(self.path.read_text())
            who = f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            # The holder has locked but not yet written its details (a moment's window).
            who = "another process (its details are not written yet)"
        return (
            f"trainer.experiment_name: the run directory {self.run_dir} is in use by {who} "
            f"(lock {self.path}); wait for that run to end or stop it, or choose another "
            "trainer.experiment_name"
        )

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


@dataclass(frozen=True)
class LockOutcome:
    """What every rank learns: `refusal` is None when the run may go on, else one line."""

    refusal: str | None


@contextlib.contextmanager
def run_dir_lock(
    run_dir: str | os.PathLike, logger: logging.Logger | None = None
) -> Iterator[LockOutcome]:
    """Lock `run_dir` on global rank 0 for the block; every rank gets the same outcome.

    Collective when torch.distributed is initialised (one broadcast from rank 0); every
    rank must enter it. The lock is released when the block exits, however it exits.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    lock = RunDirLock(run_dir, logger)
    with lock:
        refusal = lock.acquire() if rank == 0 else None
        if distributed and dist.get_world_size() > 1:
            shared = [refusal]
            dist.broadcast_object_list(shared, src=0)
            refusal = shared[0]
        yield LockOutcome(refusal)
