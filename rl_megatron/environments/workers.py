"""Environments in forked worker processes: one trajectory per worker, each call time-limited.

    pool = EnvironmentPool(cls, name="my_env.py:Lookup", timeout_s=30, max_concurrent=64)
    pool.start(7, sample)           # queued; runs when a worker is free
    pool.step(7, response_text)     # the trajectory's next call, after its previous result
    for traj_id, result in pool.ready(timeout_s=0.01):
        ...                         # messages (start), Observation (step), EnvironmentCallError
    pool.close(7)                   # the worker calls env.close() and takes the next trajectory

Why this shape (the spirit of `rewards/user_calls.py`, for stateful, slow user code):

* One trajectory per worker at a time: an environment that hangs, raises or kills its
  process ends its own trajectory only; the others keep their workers and their state.
* At most `max_concurrent` workers per rank (0: no cap, one per trajectory started),
  reused after `close`: a start past the cap waits in a queue (first come, first served).
  The cap is also a cap on the trajectories that generate at once: run 19 found 256
  trajectories behind 32 workers decoding in eight thin waves (`waited` counts them).
* Non-blocking: a driver multiplexing generation and environment calls submits calls and
  collects whatever is ready (`multiprocessing.connection.wait` over the pipes); a call
  past `timeout_s` has its worker killed (SIGKILL: a hung call ignores anything gentler)
  and a fresh one is forked for a later trajectory.
* `os.fork`: the class is imported once in the trainer (`loader.py`); a worker needs no
  import, no pickling of the class (a `file.py:Name` has no importable module name). The
  worker ignores SIGINT/SIGTERM (its life is the trainer's) and dies with it
  (PR_SET_PDEATHSIG on Linux, or at the pipe's end).
* Return values are checked in the worker: something that is not a list of message dicts
  (start) or an Observation with a finite reward (step) is described there in one line,
  never a pickling error here. An observation's text is capped at `max_observation_chars`
  (cut and marked), so a megabyte printed by a tool cannot flood the trainer's memory or
  the policy's context.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from rl_megatron.environments.base import Observation
from rl_megatron.environments.loader import check_environment
from rl_megatron.rewards.scoring import as_score, describe
from rl_megatron.utils.forked_workers import fork_worker, kill_worker

__all__ = ["EnvironmentCallError", "EnvironmentPool", "check_messages", "check_observation"]

CUT_MARK = "\n[... {} characters cut]"


class EnvironmentCallError(Exception):
    """A start/step call failed; the message is one line. `timeout`: it ran past the limit."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass
class _Worker:
    pid: int
    conn: Any
    traj_id: Hashable | None = None  # the trajectory it serves; None = free
    call: str | None = None  # "start" / "step" / "close" in flight
    sent_at: float = 0.0


class EnvironmentPool:
    """Up to `max_concurrent` forked workers (0: no cap), each running one trajectory's
    environment."""

    def __init__(
        self,
        factory: Callable[..., Any],
        name: str,
        timeout_s: float,
        max_concurrent: int,
        kwargs: Mapping[str, Any] | None = None,
        max_observation_chars: int = 16384,
    ) -> None:
        """
        Args:
            factory: the environment class (`loader.load_environment`), called with
                `kwargs` once per trajectory, in the worker.
            name: how messages name it (`environment.function`).
            timeout_s: seconds one start/step/close may take (`environment.timeout_s`).
            max_concurrent: workers at most, 0 for no cap (`environment.max_concurrent`).
            max_observation_chars: an observation's message contents, all together, are
                cut to this many characters (plus a mark saying how many were cut).
        """
        if timeout_s <= 0 or max_concurrent < 0 or max_observation_chars < 1:
            raise ValueError(f"bad pool limits {timeout_s=} {max_concurrent=}")
        self.factory, self.name, self.kwargs = factory, name, dict(kwargs or {})
        self.timeout_s, self.max_concurrent = float(timeout_s), int(max_concurrent)
        self.max_observation_chars = int(max_observation_chars)
        self._workers: list[_Worker] = []
        self._owner: dict[Hashable, _Worker] = {}
        self._queue: collections.deque[tuple[Hashable, Any]] = collections.deque()
        self.seconds: dict[Hashable, float] = collections.defaultdict(float)  # per trajectory
        self.errors = 0  # failed start/step calls, time-outs included
        self.timeouts = 0
        self.forks = 0
        self.waited = 0  # starts that found every worker busy and the cap reached

    # ------------------------------------------------------------------ submitting calls

    def start(self, traj_id: Hashable, sample: Mapping[str, Any]) -> None:
        """Begin trajectory `traj_id` on data record `sample` (queued until a worker is free)."""
        if traj_id in self._owner or any(t == traj_id for t, _ in self._queue):
            raise ValueError(f"trajectory {traj_id!r} already started")
        self._queue.append((traj_id, dict(sample)))
        self._dispatch()
        self.waited += any(t == traj_id for t, _ in self._queue)

    def step(self, traj_id: Hashable, response: str) -> None:
        """Send the policy's turn; its Observation comes back from `ready`."""
        worker = self._owner.get(traj_id)
        if worker is None or worker.call is not None:
            raise ValueError(f"trajectory {traj_id!r} has no idle environment to step")
        self._send(worker, "step", response)

    def close(self, traj_id: Hashable) -> None:
        """The trajectory ended: its environment's `close` runs, then the worker is free."""
        self._queue = collections.deque((t, s) for t, s in self._queue if t != traj_id)
        worker = self._owner.pop(traj_id, None)
        if worker is None:  # never started, or its worker was killed
            return
        if worker.call is not None:  # closed while a call runs: that call is abandoned
            self._kill(worker)
            return
        self._send(worker, "close", None)

    @property
    def pending(self) -> int:
        """start/step calls queued or running (closes not counted)."""
        running = sum(1 for w in self._workers if w.call in ("start", "step"))
        return running + len(self._queue)

    # ------------------------------------------------------------------ collecting results

    def ready(self, timeout_s: float) -> list[tuple[Hashable, Any]]:
        """Results available within `timeout_s`: (traj_id, messages | Observation | error).

        Returns as soon as at least one result is in, or after `timeout_s` (an empty list);
        at once when no call is pending. Calls past `environment.timeout_s` are ended here.
        """
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._dispatch()
            busy = [w for w in self._workers if w.call is not None]
            if not busy:
                return []
            now = time.monotonic()
            nearest = min(w.sent_at + self.timeout_s for w in busy)
            results = self._collect(busy, max(0.0, min(end, nearest) - now))
            if results or time.monotonic() >= end:
                return results

    def wait_for_closes(self) -> None:
        """Block until every close in flight has ended (each within `timeout_s`, else its
        worker is killed). A worker is free only once its close is acknowledged: without
        this, the next rollout's starts find the workers of the last one still closing and
        fork new ones, and forking the trainer's large process costs tens of milliseconds
        each (GPU run 24: the first rollout's 256 forks took 5 s)."""
        while closing := [w for w in self._workers if w.call == "close"]:
            nearest = min(w.sent_at for w in closing) + self.timeout_s
            self._collect(closing, max(0.0, nearest - time.monotonic()))  # closes return none

    def shutdown(self) -> None:
        """Kill every worker (the pool can be used again: workers are forked on demand)."""
        for worker in list(self._workers):
            self._kill(worker)
        self._owner.clear()
        self._queue.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    # ------------------------------------------------------------------ internals

    def _dispatch(self) -> None:
        while self._queue:
            worker = next((w for w in self._workers if w.traj_id is None and w.call is None), None)
            if worker is None:
                if 0 < self.max_concurrent <= len(self._workers):
                    return
                worker = self._fork()
            traj_id, sample = self._queue.popleft()
            worker.traj_id = traj_id
            self._owner[traj_id] = worker
            self._send(worker, "start", sample)

    def _collect(self, busy: list[_Worker], wait_s: float) -> list[tuple[Hashable, Any]]:
        """Wait up to `wait_s` for any of `busy`; receive what is in, end the calls past
        `timeout_s`; the start/step results among them."""
        readable = multiprocessing.connection.wait([w.conn for w in busy], wait_s)
        results = []
        for worker in busy:
            if worker.conn in readable:
                result = self._receive(worker)
            elif time.monotonic() >= worker.sent_at + self.timeout_s:
                result = self._time_out(worker)
            else:
                continue
            if result is not None:
                results.append(result)
        return results

    def _send(self, worker: _Worker, kind: str, payload: Any) -> None:
        worker.call, worker.sent_at = kind, time.monotonic()
        # A dead worker's pipe refuses the send: `ready` sees its end and reports the death.
        with contextlib.suppress(OSError):
            worker.conn.send((kind, payload))

    def _receive(self, worker: _Worker) -> tuple[Hashable, Any] | None:
        kind, traj_id = worker.call, worker.traj_id
        if kind != "close":
            self.seconds[traj_id] += time.monotonic() - worker.sent_at
        try:
            ok, value = worker.conn.recv()
        except (EOFError, OSError):
            status = self._kill(worker)
            if kind == "close":
                return None
            self.errors += 1
            return traj_id, EnvironmentCallError(
                f"the environment worker process died during {kind} ({status})"
            )
        worker.call = None
        if kind == "close":
            worker.traj_id = None  # free for the next trajectory (its close error is moot)
            return None
        if not ok:
            self.errors += 1
            return traj_id, EnvironmentCallError(value)
        return traj_id, value

    def _time_out(self, worker: _Worker) -> tuple[Hashable, Any] | None:
        kind, traj_id = worker.call, worker.traj_id
        self._kill(worker)
        if kind == "close":
            return None
        self.seconds[traj_id] += self.timeout_s
        self.errors += 1
        self.timeouts += 1
        return traj_id, EnvironmentCallError(
            f"{kind} gave no result within environment.timeout_s={self.timeout_s:g} "
            "(the call was stopped)",
            timeout=True,
        )

    def _fork(self) -> _Worker:
        pid, here = fork_worker(lambda conn: _serve(self, conn))
        self.forks += 1
        worker = _Worker(pid=pid, conn=here)
        self._workers.append(worker)
        return worker

    def _kill(self, worker: _Worker) -> str:
        """Kill and reap `worker`, forget it; how it ended ("killed by SIGKILL", ...)."""
        if worker in self._workers:
            self._workers.remove(worker)
        if worker.traj_id is not None and self._owner.get(worker.traj_id) is worker:
            del self._owner[worker.traj_id]
        return kill_worker(worker.pid, worker.conn)


def _serve(pool: EnvironmentPool, conn: Any) -> None:
    """The worker's loop (`fork_worker`): ("start", sample) / ("step", text) / ("close",
    None) in, (True, value) or (False, one line saying why) out."""
    # The trainer's other workers' pipes, inherited by the fork: closed, so that a
    # trainer-side close is seen by them (EOF) even while this process lives.
    for other in pool._workers:
        other.conn.close()
    env = None
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the trainer closed its end: nothing more to do
            return
        try:
            if kind == "start":
                env = pool.factory(**pool.kwargs)
                check_environment(env, pool.name)
                reply = (True, check_messages(env.start(payload), "start"))
            elif kind == "step":
                if env is None:
                    raise RuntimeError("step before start")
                reply = (True, check_observation(env.step(payload), pool.max_observation_chars))
            else:
                env, ending = None, env
                if ending is not None and callable(getattr(ending, "close", None)):
                    ending.close()
                reply = (True, None)
        except EnvironmentCallError as exc:  # garbage returned, already described
            reply = (False, str(exc))
        # Everything user code raises is the trajectory's failure, SystemExit included.
        except BaseException as exc:  # noqa: BLE001
            reply = (False, f"{kind}: {describe(exc)}")
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001  (a value pickle cannot send)
            conn.send((False, f"its result cannot be sent to the trainer ({describe(exc)})"))


def check_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """`value` as a list of chat messages (dicts with string role and content), or
    EnvironmentCallError saying in one line what is wrong."""
    if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
        raise EnvironmentCallError(
            f"{where} returned {type(value).__name__}, not a list of message dicts"
        )
    messages = []
    for i, message in enumerate(value):
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise EnvironmentCallError(
                    f"{where}: message {i} has no string {key!r} ({message.get(key)!r:.60})"
                )
        messages.append(dict(message))
    return messages


def check_observation(value: Any, max_chars: int) -> Observation:
    """`value` checked as an Observation (finite reward and metrics), its messages' text
    cut to `max_chars` in all; EnvironmentCallError when it is not one."""
    if not isinstance(value, Observation):
        raise EnvironmentCallError(f"step returned {type(value).__name__}, not an Observation")
    messages = check_messages(value.messages, "step's Observation.messages")
    try:
        reward = as_score(value.reward)
        metrics = {str(k): as_score(v) for k, v in dict(value.metrics).items()}
    except (TypeError, ValueError) as exc:
        raise EnvironmentCallError(f"step's Observation: reward or metric {exc}") from None
    budget, cut = max_chars, 0
    for message in messages:
        text = message["content"]
        if len(text) > budget:
            cut += len(text) - budget
            message["content"] = text[:budget]
        budget -= len(message["content"])
    if cut:
        messages[-1]["content"] += CUT_MARK.format(cut)
        metrics["observations_cut"] = metrics.get("observations_cut", 0.0) + 1.0
    return Observation(messages=messages, reward=reward, done=bool(value.done), metrics=metrics)
