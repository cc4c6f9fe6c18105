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
* a failed rank's stderr went to a file (`--redirects`/`--tee` with `--log-dir`) or was
  hidden (`--local_ranks_filter`) → a refusal's one line is repeated from its `stderr.log`,
  and the line after a crash names that file;
* this node never met the others (`--rdzv_endpoint` unreachable, or not every node within
  the join timeout) → one line naming the node, the endpoint and the timeout, exit code 2,
  before any rank started (torch logs a stack trace per failed attempt otherwise).
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

# Read once, when torch loads: quiets the store client's per-attempt C++ stack traces in
# this agent process only (its ranks get the user's setting back below).
_USER_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"

from torch.distributed.elastic.multiprocessing.api import Std  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402
from torch.distributed.run import parse_args  # noqa: E402
from torch.distributed.run import run as torchrun_run  # noqa: E402

from rl_megatron.utils.console import print_line  # noqa: E402

if _USER_CPP_LOG_LEVEL is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
else:
    os.environ["TORCH_CPP_LOG_LEVEL"] = _USER_CPP_LOG_LEVEL

__all__ = [
    "REFUSAL_EXIT_CODE",
    "describe",
    "failure_summary",
    "join_timeout",
    "main",
    "stderr_destination",
]

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


def _std(spec: str, local_rank: int) -> Std:
    """A `--redirects`/`--tee` value ("3", or "0:3,1:2" per local rank) for one rank."""
    value = Std.from_str(spec)
    return value if isinstance(value, Std) else value.get(local_rank, Std.NONE)


def stderr_destination(local_rank: int, args) -> str | None:
    """Where a rank's stderr went when not to this console: its `stderr.log` (torchrun's
    `--redirects`/`--tee`), or os.devnull (hidden by `--local_ranks_filter`, not
    redirected). None: printed here.

    Args:
        args: torchrun's parsed arguments, after the run (`rdzv_id` is then the run's id).
    """
    ranks_filter = args.local_ranks_filter
    shown = not ranks_filter or local_rank in {int(r) for r in ranks_filter.split(",")}
    teed = bool(_std(args.tee, local_rank) & Std.ERR)
    to_file = teed or bool(_std(args.redirects, local_rank) & Std.ERR)
    if args.log_dir == os.devnull:  # no files at all: torchrun leaves the console as is
        to_file = False
    if shown and (not to_file or teed):
        return None
    if not to_file:
        return os.devnull
    return _rank_log(args.log_dir, args.rdzv_id, local_rank)


def _rank_log(log_dir: str, run_id: str, local_rank: int) -> str:
    """torchrun's `<log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stderr.log`: the
    newest such run folder, its last attempt; `log_dir` itself when there is none."""
    runs = [p for p in Path(log_dir).glob(f"{glob.escape(run_id)}_*") if p.is_dir()]
    if not runs:
        return log_dir
    run = max(runs, key=lambda p: p.stat().st_mtime)
    attempts = [p for p in run.glob("attempt_*") if p.name.removeprefix("attempt_").isdigit()]
    if not attempts:
        return str(run)
    last = max(attempts, key=lambda p: int(p.name.removeprefix("attempt_")))
    return str(last / str(local_rank) / "stderr.log")


def _last_line(path: str) -> str | None:
    try:
        with open(path, errors="replace") as log:
            lines = [line.rstrip() for line in log if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def failure_summary(failures: dict, stderr_of=lambda failure: None) -> tuple[int, list[str]]:
    """Exit code and the lines to add (none: every rank said it already) for failed ranks.

    Args:
        failures: global rank → `ProcessFailure` (`ChildFailedError.failures`), whose
            `exitcode` is negative for a signal.
        stderr_of: failure → where its stderr went when not to this console
            (`stderr_destination`), None when it was printed here.
    """
    # Once one rank fails the agent stops the others with SIGTERM, and reports them too:
    # the failures that matter are the ones it did not cause.
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    failures = {r: f for r, f in failures.items() if r not in stopped} or failures
    unseen = {r: stderr_of(f) for r, f in failures.items() if stderr_of(f) is not None}
    if all(f.exitcode == REFUSAL_EXIT_CODE for f in failures.values()):
        # Each failed rank printed its one line; one that went to a file is repeated here.
        lines = []
        for rank in sorted(unseen):
            where = unseen[rank]
            said = None if where == os.devnull else _last_line(where)
            line = said or f"error: rank {rank} exited with code 2" + (
                " (its output is hidden by --local_ranks_filter)"
                if where == os.devnull
                else f" (its output: {where})"
            )
            if line not in lines:
                lines.append(line)
        return REFUSAL_EXIT_CODE, lines
    parts = []
    for rank in sorted(failures):
        failure = failures[rank]
        if failure.exitcode < 0:
            part = f"rank {rank} killed by {failure.signal_name()}"
        else:
            part = f"rank {rank} exited with code {failure.exitcode}"
        if rank in unseen:
            hidden = unseen[rank] == os.devnull
            part += " (output hidden by --local_ranks_filter)" if hidden else f" ({unseen[rank]})"
        parts.append(part)
    where = "" if unseen else " (each rank's own output is above)"
    return 1, [f"error: {'; '.join(parts)}; the other ranks were stopped{where}"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    _quiet_the_agent()
    if args.log_dir is None and (args.redirects != "0" or args.tee != "0"):
        # Where torchrun would put the files too, but known here: a failed rank's line
        # names its file.
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    try:
        torchrun_run(args)
    except ChildFailedError as exc:
        code, lines = failure_summary(
            exc.failures, lambda failure: stderr_destination(failure.local_rank, args)
        )
        for line in lines:
            print_line(line)
        return code
    except RendezvousError as exc:
        print_line(
            f"error: node {socket.gethostname()}: no rendezvous with the other nodes at "
            f"{args.rdzv_endpoint} within join_timeout={join_timeout(args.rdzv_conf)} s "
            f"({describe(exc)}); check that every node started and can reach that address"
        )
        return REFUSAL_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
