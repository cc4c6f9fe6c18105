"""A user reward function that hangs, in real runs (issue 36): the run ends within
`reward.timeout_s` plus a margin of the hang's start, with one `error:` line naming the
function and the sample and exit code 2 (`reward.on_error=raise`), or completes with the
hung calls counted (`score`); SIGTERM during a hang stops it after that step, saved.

Two ranks of `yaml_configs/tiny_cpu.yaml` at tp=1 (each its own replica, each scoring its
own rows), 2 prompts × 2 responses a step, so each rank scores 2 samples."""

from __future__ import annotations

import json
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from tests.e2e.test_launcher import TINY
from tests.e2e.test_run_safety import TWO_RANKS_SMALL, _finish, _start_ranks

LIMIT = 2  # reward.timeout_s
# Seconds from the hang's start to the last rank's exit beyond LIMIT: the other sample's
# call, the collectives, teardown and interpreter exit, on 2 loaded cores.
MARGIN = 20
SMALL = [
    *TWO_RANKS_SMALL,
    "checkpoint.save_interval=0",
    f"reward.timeout_s={LIMIT}",
]


def _reward_module(tmp_path: Path, hang_ranks: set[int]) -> str:
    """A reward function that hangs on `hang_ranks`, noting when it starts hanging."""
    path = tmp_path / "hanging_reward.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import os, time

            def score(response_text, sample):
                if int(os.environ["RANK"]) in {sorted(hang_ranks)!r}:
                    marker = {str(tmp_path / "hang_started")!r} + os.environ["RANK"]
                    if not os.path.exists(marker):
                        open(marker, "w").write(repr(time.time()))
                    time.sleep(3600)
                return 1.0
            """
        )
    )
    return f"{path}:score"


def _launch(tmp_path: Path, spec: str, *overrides: str):
    args = ["--config", TINY, f"trainer.output_dir={tmp_path}", *SMALL]
    args += [f"reward.function={spec}", *overrides]
    return _start_ranks(2, args)


def _first_hang(tmp_path: Path) -> float:
    return min(float(p.read_text()) for p in tmp_path.glob("hang_started*"))


def _one_error_line(results) -> str:
    assert [code for code, _, _ in results] == [2, 2], [err[-3000:] for _, _, err in results]
    stderr = "\n".join(err for _, _, err in results)
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("hang_ranks", [{1}, {0, 1}], ids=["one_rank", "every_rank"])
def test_a_hung_reward_stops_the_run_in_one_line(tmp_path, hang_ranks):
    spec = _reward_module(tmp_path, hang_ranks)
    results = _finish(_launch(tmp_path, spec, "reward.on_error=raise", "trainer.total_steps=2"))
    ended = time.time()
    line = _one_error_line(results)
    assert ended - _first_hang(tmp_path) < LIMIT + MARGIN
    prefix = f"error: reward function {spec!r} failed on sample 0 (synthetic:train:"
    assert line.startswith(prefix), line
    assert re.fullmatch(r"\d+", line[len(prefix) :].split(")", 1)[0]), line
    assert line.endswith(
        f"): no result within reward.timeout_s={LIMIT} (the call was stopped) (raise "
        "reward.timeout_s, or set reward.on_error=score to score such samples "
        "reward.error_score)"
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_reward_hung_on_one_rank_is_scored_and_counted(tmp_path):
    """`on_error=score`: both steps complete; each step's 2 hung calls are counted."""
    spec = _reward_module(tmp_path, {1})
    results = _finish(_launch(tmp_path, spec, "trainer.total_steps=2"))
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    assert "Traceback" not in "\n".join(err for _, _, err in results)
    records = _metrics(tmp_path / "tiny_cpu")
    assert [r["step"] for r in records] == [1, 2]
    assert [r["reward/errors"] for r in records] == [2.0, 2.0]
    # rank 0's 2 samples score 1.0, rank 1's the error score 0.0
    assert [r["reward/mean"] for r in records] == [0.5, 0.5]


@pytest.mark.slow
def test_sigterm_during_a_hung_reward_stops_after_the_step(tmp_path):
    """SIGTERM to every rank (as Slurm sends it) while rank 1 waits on a hung call: the
    step ends once the call's limit is reached, is saved, and the run exits 0."""
    spec = _reward_module(tmp_path, {1})
    procs = _launch(tmp_path, spec, "trainer.total_steps=1000")
    marker = tmp_path / "hang_started1"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert all(p.poll() is None for p in procs), "a rank exited before the hang"
        assert time.monotonic() < deadline, "no hang within 300 s"
        time.sleep(0.1)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    results = _finish(procs)
    ended = time.time()
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    # both of rank 1's calls wait out their limit; then the step, its save and the exit
    assert ended - _first_hang(tmp_path) < 2 * LIMIT + MARGIN
    run_dir = tmp_path / "tiny_cpu"
    assert [r["step"] for r in _metrics(run_dir)] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
