"""Run-directory safety (DESIGN.md §7): one run per run directory, and no rank outlives
its launcher. Real launches of `launch/ppo.py` with `yaml_configs/tiny_cpu.yaml`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_megatron.utils.run_lock import RunDirLock
from tests.e2e.launches import DIST_VARS, start_run
from tests.e2e.test_launcher import ROOT, TINY
from tests.ports import reserve_port

# Two ranks of one replica each, two samples per prompt: the smallest run that trains.
TWO_RANKS_SMALL = [
    "parallel.tp=1",
    "rollout.tp=1",
    "rollout.n=2",
    "data.train_batch_size=2",
    "actor.mini_batch_size=4",
    "actor.micro_batch_size=2",
    "trainer.val_interval=0",
]


def _free_port() -> int:
    # Below the ephemeral range, once per process: tests/ports.py says why.
    return reserve_port()


def _start_ranks(world_size: int, args: list[str]) -> list[subprocess.Popen]:
    """`world_size` ranks of `launch/ppo.py` with torchrun's variables but no torchrun, so
    that each rank's own exit code and output can be read."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {key: value for key, value in os.environ.items() if key not in DIST_VARS}
        env.update(
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "launch/ppo.py", *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str, str]]:
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


@pytest.mark.slow
def test_second_launch_into_a_locked_run_dir_is_refused(tmp_path):
    """A live holder: every rank exits 2 (none waits in a collective), one line from rank 0
    names the holder, and nothing is written into the holder's directory. Once the holder
    is gone the same launch runs, and leaves the lock free behind it."""
    run_dir = tmp_path / "tiny_cpu"
    args = ["--config", TINY, "--dry-run", f"trainer.output_dir={tmp_path}"]
    holder = RunDirLock(run_dir)
    assert holder.acquire() is None
    try:
        results = _finish(_start_ranks(2, args))
    finally:
        holder.release()
    assert [code for code, _, _ in results] == [2, 2], [err[-2000:] for _, _, err in results]
    errors = [line for _, _, err in results for line in err.splitlines()]
    assert "Traceback" not in "\n".join(errors), errors
    refusals = [line for line in errors if line.startswith("error: ")]
    assert len(refusals) == 1, errors
    assert refusals[0].startswith(
        f"error: trainer.experiment_name: the run directory {run_dir} is in use by "
        f"pid {os.getpid()} on host {socket.gethostname()}, started "
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]

    results = _finish(_start_ranks(2, args))
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert (run_dir / "config.resolved.yaml").is_file()
    with RunDirLock(run_dir) as lock:
        assert lock.acquire() is None  # released on the way out


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _alive(pid: int) -> bool:
    """Running, i.e. not gone and not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_a_killed_launcher_leaves_no_rank_running(tmp_path):
    """SIGKILL to the torchrun agent alone (its ranks sit in sessions of their own, so
    nothing else reaches them): every rank is gone within seconds."""
    overrides = ["trainer.total_steps=1000", "trainer.val_interval=0", "checkpoint.save_interval=0"]
    agent = start_run(tmp_path, *overrides, ranks=2)
    ranks: list[int] = []
    try:
        metrics = tmp_path / "tiny_cpu" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # training: a step logged
            assert agent.poll() is None, f"the run exited ({agent.returncode}) before step 1"
            assert time.monotonic() < deadline, "no step logged within 300 s"
            time.sleep(0.2)
        ranks = _children(agent.pid)
        assert len(ranks) == 2 and all(_alive(pid) for pid in ranks), ranks
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "ranks kept running after their launcher"
    finally:
        for pid in [agent.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        agent.wait()
