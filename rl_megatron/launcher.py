"""torchrun, with the ranks' one-line errors and exit codes kept (`rl-megatron-run`).

    rl-megatron-run --standalone --nproc_per_node 4 launch/ppo.py --config yaml_configs/tiny_cpu.yaml
    python -m rl_megatron.launcher --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
        --rdzv_endpoint HOST:PORT launch/ppo.py --config yaml_configs/llama7b.yaml

The arguments are torchrun's (`torch.distributed.run`), handed to its launcher in this
process; `torchrun launch/ppo.py …` runs the same ranks. What differs is the end of a failed
run. torchrun answers any rank's non-zero exit with exit code 1, its own `ChildFailedError`
traceback and a failure table (~40 lines), after the one line the rank printed. Here:

* every failed rank exited with code 2 (a refusal: bad config, data, checkpoint, reward
  function; the rank printed its one line) → exit code 2, nothing added;
* a rank died otherwise (an internal error, whose traceback the rank printed itself, or a
  signal) → one line naming the ranks, their exit codes or signals, and exit code 1;
* this node never met the others (`--rdzv_endpoint` unreachable, or not every node within
  the join timeout) → one line naming the node, the endpoint and the timeout, exit code 2,
  before any rank started (torch logs a stack trace per failed attempt otherwise).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

# Read once, when torch loads: quiets the store client's per-attempt C++ stack traces in
# this agent process only (its ranks get the user's setting back below).
_USER_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402
from torch.distributed.run import parse_args  # noqa: E402
from torch.distributed.run import run as torchrun_run  # noqa: E402

if _USER_CPP_LOG_LEVEL is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
else:
    os.environ["TORCH_CPP_LOG_LEVEL"] = _USER_CPP_LOG_LEVEL

__all__ = ["REFUSAL_EXIT_CODE", "describe", "failure_summary", "join_timeout", "main"]

DEFAULT_JOIN_TIMEOUT_S = 600  # torch's default for --rdzv_conf join_timeout
REFUSAL_EXIT_CODE = 2  # what launch/ppo.py returns after its one line (CONVENTIONS 8)


class _DropShutdownRace(logging.Filter):
    """At the end of a run the agent hosting the store may exit first; the others then
    warn that they could not reach it to close the rendezvous. Nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to shutdown the rendezvous" not in record.getMessage()


class _DropExitBarrierRace(logging.Filter):
    """The same race at the exit barrier: this node's ranks all finished, and the agent
    hosting the store exited before this one read the barrier, so the read fails with a
    closed connection (`DistNetworkError`) and torch logs it with its traceback. A timeout
    there (the other node still running) is another error and stays visible."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "Error waiting on exit barrier" not in record.getMessage() or not record.exc_info:
            return True
        return type(record.exc_info[1]).__name__ != "DistNetworkError"


class _DropChildFailureReport(logging.Filter):
    """The agent's own report of a failed rank ("failed (exitcode: 2) local_rank: …") and
    the SIGTERM it sends the others: `main` says it in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("failed (exitcode:" in message or "Sending process" in message)


def _quiet_the_agent() -> None:
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").addFilter(
        _DropShutdownRace()
    )
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        _DropExitBarrierRace()
    )
    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.agent.server.local_elastic_agent",
    ):
        logging.getLogger(name).addFilter(_DropChildFailureReport())


def join_timeout(rdzv_conf: str) -> str:
    """The join timeout (seconds, as given) of a `--rdzv_conf key=value,...` string."""
    for item in rdzv_conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout":
            return value.strip()
    return str(DEFAULT_JOIN_TIMEOUT_S)


def describe(exc: BaseException) -> str:
    """The innermost cause's first line (the agent's own error says 'see inner exception')."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def failure_summary(failures: dict) -> tuple[int, str | None]:
    """Exit code and line (None: nothing to add) for torchrun's failed ranks.

    Args:
        failures: global rank → `ProcessFailure` (`ChildFailedError.failures`), whose
            `exitcode` is negative for a signal.
    """
    # Once one rank fails the agent stops the others with SIGTERM, and reports them too:
    # the failures that matter are the ones it did not cause.
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    failures = {r: f for r, f in failures.items() if r not in stopped} or failures
    if all(f.exitcode == REFUSAL_EXIT_CODE for f in failures.values()):
        return REFUSAL_EXIT_CODE, None  # each failed rank printed its one line already
    parts = []
    for rank in sorted(failures):
        failure = failures[rank]
        if failure.exitcode < 0:
            parts.append(f"rank {rank} killed by {failure.signal_name()}")
        else:
            parts.append(f"rank {rank} exited with code {failure.exitcode}")
    return 1, (
        f"error: {'; '.join(parts)}; the other ranks were stopped (each rank's own output is above)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    _quiet_the_agent()
    try:
        torchrun_run(args)
    except ChildFailedError as exc:
        code, line = failure_summary(exc.failures)
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except RendezvousError as exc:
        print(
            f"error: node {socket.gethostname()}: no rendezvous with the other nodes at "
            f"{args.rdzv_endpoint} within join_timeout={join_timeout(args.rdzv_conf)} s "
            f"({describe(exc)}); check that every node started and can reach that address",
            file=sys.stderr,
            flush=True,
        )
        return REFUSAL_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
