"""Starting a training run in the background and killing it at a chosen moment: what the
kill-and-resume tests share (a SIGKILL of the whole process group, as a node loss or
`scancel --signal=KILL` would deliver it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.e2e.test_launcher import ROOT, TINY

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_command(
    output_dir: Path, *overrides: str, ranks: int = 4
) -> tuple[list[str], dict[str, str]]:
    """The torchrun command of launch/ppo.py on the tiny config, and its environment (one
    thread a rank, no distributed variables of the test's own process)."""
    env = {key: value for key, value in os.environ.items() if key not in DIST_VARS}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ranks}", "launch/ppo.py", "--config", TINY]
    cmd += [f"trainer.output_dir={output_dir}", *overrides]
    return cmd, env


def start_run(
    output_dir: Path, *overrides: str, ranks: int = 4, log: Path | None = None
) -> subprocess.Popen:
    """torchrun launch/ppo.py on the tiny config, in a session of its own (so one killpg
    reaches the agent and every rank); output to `log`, or discarded."""
    cmd, env = launch_command(output_dir, *overrides, ranks=ranks)
    out = log.open("w") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        if log is not None:
            out.close()  # the child holds its own descriptor


def sigterm_at_step(proc: subprocess.Popen, step: int, timeout: float = 120) -> None:
    """SIGTERM to torchrun (what Slurm sends before a job's time runs out) once its console
    (`proc.stdout`, text) shows step `step`; then wait for the run to end."""
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.stdout.read()
    proc.wait(timeout=timeout)


def kill_when(
    proc: subprocess.Popen,
    moment: Callable[[], bool],
    what: str,
    delay: float = 0.0,
    timeout: float = 300,
) -> None:
    """SIGKILL the run's whole process group `delay` seconds after `moment()` is true;
    fails, naming `what`, if the run exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    try:
        while not moment():
            if proc.poll() is not None:
                raise AssertionError(f"run exited ({proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s")
            time.sleep(0.005)
        time.sleep(delay)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def logged_steps(run_dir: Path) -> int:
    """Whole lines of the run's metrics.jsonl (one per step)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def kill_after_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    """Kill once step `step`'s checkpoint exists and its metrics line is written (a step's
    record follows its checkpoint: it carries the checkpoint's timing)."""
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    kill_when(
        proc,
        lambda: checkpoint.exists() and logged_steps(run_dir) >= step,
        f"step {step}'s checkpoint and record",
    )
