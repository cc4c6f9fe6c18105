"""rl_megatron/launcher.py without launching: what it adds after failed ranks, and where a
rank's stderr went under torchrun's --redirects / --tee / --local_ranks_filter."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from rl_megatron.launcher import failure_summary, stderr_destination

STOPPED = "the other ranks were stopped"


def _failure(exitcode: int, local_rank: int = 0, log_dir: str = "/logs/run/attempt_0"):
    return SimpleNamespace(
        exitcode=exitcode,
        local_rank=local_rank,
        error_file=os.path.join(log_dir, str(local_rank), "error.json"),
        signal_name=lambda: signal.Signals(-exitcode).name,
    )


def test_refusals_add_nothing_and_keep_code_2():
    assert failure_summary({0: _failure(2), 1: _failure(2, 1)}) == (2, [])


def test_ranks_the_agent_stopped_are_not_failures():
    code, lines = failure_summary({0: _failure(2), 1: _failure(-signal.SIGTERM, 1)})
    assert (code, lines) == (2, [])
    code, lines = failure_summary({0: _failure(1), 1: _failure(-signal.SIGTERM, 1)})
    assert lines == [
        f"error: rank 0 exited with code 1; {STOPPED} (each rank's own output is above)"
    ]


def test_only_sigterm_is_still_reported():
    """Every rank got SIGTERM from outside (a job step ending): that is the failure."""
    code, lines = failure_summary({0: _failure(-signal.SIGTERM), 1: _failure(-signal.SIGTERM, 1)})
    assert code == 1
    assert lines == [
        f"error: rank 0 killed by SIGTERM; rank 1 killed by SIGTERM; {STOPPED} (each rank's "
        "own output is above)"
    ]


def test_a_refusal_beside_a_crash_is_a_crash():
    code, lines = failure_summary({3: _failure(2, 1), 2: _failure(1, 0)})
    assert code == 1
    assert lines == [
        f"error: rank 2 exited with code 1; rank 3 exited with code 2; {STOPPED} (each rank's "
        "own output is above)"
    ]


def test_a_refusal_written_to_a_file_is_repeated(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("some warning\nerror: refused on rank 1\n\n")
    code, lines = failure_summary({1: _failure(2, 1)}, lambda f: str(log))
    assert (code, lines) == (2, ["error: refused on rank 1"])
    # Two ranks that said the same: once. A file that is missing or empty: the rank is named.
    missing = str(tmp_path / "none.log")
    code, lines = failure_summary(
        {0: _failure(2), 1: _failure(2, 1), 2: _failure(2, 2)},
        lambda f: {0: str(log), 1: str(log), 2: missing}[f.local_rank],
    )
    assert lines == [
        "error: refused on rank 1",
        f"error: rank 2 exited with code 2 (its output: {missing})",
    ]


def test_a_hidden_refusal_is_named():
    code, lines = failure_summary({1: _failure(2, 1)}, lambda f: os.devnull)
    assert (code, lines) == (
        2, ["error: rank 1 exited with code 2 (its output is hidden by --local_ranks_filter)"]
    )  # fmt: skip


def test_a_crash_names_the_file_holding_its_traceback():
    code, lines = failure_summary(
        {0: _failure(1), 1: _failure(-signal.SIGKILL, 1)},
        lambda f: "/logs/0/stderr.log" if f.local_rank == 0 else os.devnull,
    )
    assert code == 1
    assert lines == [
        "error: rank 0 exited with code 1 (/logs/0/stderr.log); rank 1 killed by SIGKILL "
        f"(output hidden by --local_ranks_filter); {STOPPED}"
    ]


def _args(redirects="0", tee="0", ranks_filter="", log_dir="/logs", run_id="job"):
    return SimpleNamespace(
        redirects=redirects, tee=tee, local_ranks_filter=ranks_filter, log_dir=log_dir,
        rdzv_id=run_id,
    )  # fmt: skip


@pytest.mark.parametrize(
    "redirects, tee, ranks_filter, local_rank, expected",
    [
        ("0", "0", "", 1, None),  # torchrun's default: the console
        ("1", "0", "", 1, None),  # stdout only: stderr still here
        ("2", "0", "", 1, "FILE"),
        ("3", "0", "", 0, "FILE"),
        ("0:3,1:0", "0", "", 1, None),  # per rank
        ("0:3,1:0", "0", "", 0, "FILE"),
        ("0", "2", "", 1, None),  # tee: in the file and here
        ("0", "2", "0", 1, "FILE"),  # tee'd, but not shown
        ("0", "0", "0", 1, os.devnull),  # filtered, not redirected: nowhere
        ("0", "0", "0,1", 1, None),
    ],
)
def test_stderr_destination(tmp_path, redirects, tee, ranks_filter, local_rank, expected):
    run = tmp_path / "job_x1y2" / "attempt_0" / str(local_rank)
    run.mkdir(parents=True)
    got = stderr_destination(local_rank, _args(redirects, tee, ranks_filter, str(tmp_path)))
    assert got == (str(run / "stderr.log") if expected == "FILE" else expected)


def test_no_log_dir_means_no_file():
    assert stderr_destination(0, _args("3", log_dir=os.devnull)) is None
    assert stderr_destination(0, _args("3", ranks_filter="1", log_dir=os.devnull)) == os.devnull


def test_the_log_is_the_newest_runs_last_attempt(tmp_path):
    """A log folder used by earlier runs of the same id, and a restarted run (attempt_10
    after attempt_9: numbers, not text)."""
    old = tmp_path / "job_aaaa" / "attempt_3" / "1"
    old.mkdir(parents=True)
    os.utime(old.parents[1], (1, 1))
    for attempt in (0, 9, 10):
        (tmp_path / "job_bbbb" / f"attempt_{attempt}" / "1").mkdir(parents=True)
    (tmp_path / "other_cccc" / "attempt_11" / "1").mkdir(parents=True)  # another run id
    got = stderr_destination(1, _args("2", log_dir=str(tmp_path)))
    assert got == str(tmp_path / "job_bbbb" / "attempt_10" / "1" / "stderr.log")
    # Nothing written (the rank died before torchrun made its folder): the log folder.
    assert stderr_destination(1, _args("2", log_dir=str(tmp_path), run_id="new")) == str(tmp_path)
