"""A user's reward function run in a worker process of its own, each call time-limited.

    fn = TimedWorker(user_fn, name="my_rewards:score", timeout_s=30.0)
    fn(response_text, sample)   # a float; CallError when it hangs, crashes or misbehaves

A user function can hang (a network call, an infinite loop) or take its process down
(`os._exit`, a segfault in a C extension). Run in the trainer itself, either leaves the
other ranks waiting in the score's collective until `parallel.timeout_s`, then a stack of
gloo tracebacks from every rank. Here the trainer only waits on a pipe, at most
`timeout_s` per call: a call past its limit has its worker killed (SIGKILL; a hung
function ignores anything gentler) and a fresh one takes the next call. Every failure
is a `CallError` whose message is the description `scoring.score_batch` puts in its one
line, so the sample gets `reward.error_score` or stops the run, as `reward.on_error` says.

Decisions:

* `os.fork`, not spawn or forkserver: the function is already imported (and checked) in
  the trainer, so the worker needs no import and no pickling of the function (a
  `path/file.py:fn` module has no importable name), and a restart after a time-out costs
  a fork (milliseconds), not an interpreter start. The worker only runs the user's code,
  never a collective or CUDA.
* One persistent worker per rank, started at the first call: a call costs a pipe round
  trip (tens of microseconds), not a process start.
* The worker ignores SIGINT and SIGTERM: its life is the trainer's. Ctrl-C or Slurm's
  SIGTERM reach the trainer, which finishes the step (waiting at most `timeout_s`) and
  stops; the worker dies with it (`PR_SET_PDEATHSIG` on Linux, or at the pipe's end).
* The score is checked in the worker (`as_score`): a return value that cannot cross the
  pipe (a generator, an open file) is described there, not a pickling error here.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from rl_megatron.rewards.registry import RewardFn
from rl_megatron.rewards.scoring import CallError, as_score, describe
from rl_megatron.utils.forked_workers import fork_worker, kill_worker

__all__ = ["TimedWorker"]


class TimedWorker:
    """`fn(response_text, sample)` in a child process, each call bounded by `timeout_s`."""

    def __init__(self, fn: RewardFn, name: str, timeout_s: float) -> None:
        """
        Args:
            fn: the user's reward function (`registry.get_reward_fn`).
            name: how messages name it (`reward.function`, e.g. `"my_rewards:score"`).
            timeout_s: seconds one call may take (`reward.timeout_s`).
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn, self.__name__, self.timeout_s = fn, name, float(timeout_s)
        self.pid: int | None = None  # the live worker's, None before the first call
        self._conn: Any = None
        self.restarts = 0  # workers killed or found dead so far (a time-out, a crash)
        # No orphan, whatever way this object goes (garbage, interpreter exit).
        self._finalizer = weakref.finalize(self, _kill, [None])

    def __call__(self, response: str, sample: Mapping[str, Any]) -> float:
        """The function's score, or CallError when it fails, exceeds `timeout_s` or dies."""
        conn = self._worker()
        conn.send((response, dict(sample)))
        # poll is True on a reply and on the pipe's end (a dead worker); SIGTERM to the
        # trainer interrupts it only to run its handler (PEP 475), then the wait goes on.
        if not conn.poll(self.timeout_s):
            self._stop()
            raise CallError(
                f"no result within reward.timeout_s={self.timeout_s:g} (the call was stopped)",
                hint="raise reward.timeout_s, or set reward.on_error=score to score such "
                "samples reward.error_score",
            )
        try:
            ok, value = conn.recv()
        except (EOFError, OSError):
            status = self._stop()
            raise CallError(f"the reward worker process died during the call ({status})") from None
        if not ok:
            raise CallError(value)
        return value

    def close(self) -> None:
        """Stop the worker (a later call starts another)."""
        if self.pid is not None:
            self._stop()
            self.restarts -= 1  # a requested stop is no restart

    def _worker(self):
        if self.pid is None:
            pid, here = fork_worker(lambda conn: _serve(self.fn, conn))
            self.pid, self._conn = pid, here
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _kill, [pid, here])
        return self._conn

    def _stop(self) -> str:
        """Kill and reap the worker; how it ended, for messages ("exit code 3", ...)."""
        pid, conn = self.pid, self._conn
        self.pid, self._conn = None, None
        self.restarts += 1
        self._finalizer.detach()
        return _kill([pid, conn])


def _kill(handle: list) -> str:
    pid, conn = (handle + [None, None])[:2]
    if pid is None:
        if conn is not None:
            conn.close()
        return "not running"
    return kill_worker(pid, conn)


def _serve(fn: RewardFn, conn) -> None:
    """The worker's loop (`fork_worker`): a (response, sample) in, (True, score) or
    (False, why) out."""
    while True:
        try:
            response, sample = conn.recv()
        except (EOFError, OSError):  # the trainer closed its end: nothing more to do
            return
        try:
            reply = (True, as_score(fn(response, sample)))
        # Everything the function raises is the sample's failure, SystemExit and a
        # KeyboardInterrupt of its own included: this process exists only for the calls.
        except BaseException as exc:  # noqa: BLE001
            reply = (False, describe(exc))
        conn.send(reply)
