"""The launcher as users run it: exit codes, one-line errors, the dry-run layout table."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = "yaml_configs/tiny_cpu.yaml"


def _run(args: list[str], torchrun_ranks: int | None = None, timeout: int = 240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if torchrun_ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={torchrun_ranks}", "launch/ppo.py", *args]
    else:
        cmd = [sys.executable, "launch/ppo.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            [TINY, "actor.optim.lrr=1e-6"],
            "actor.optim.lrr: unknown key; did you mean actor.optim.lr?",
        ),
        ([TINY, "actor.optim.lr=fast"], "actor.optim.lr: expected a number, got str 'fast'"),
        ([TINY, "parallel.tp=3"], "parallel.tp: 3 does not divide model.num_attention_heads=4"),
        (["missing.yaml"], "config file not found: missing.yaml"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, expected):
    config, *overrides = args
    result = _run(["--config", config, *overrides, "trainer.dry_run=true"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"config error: {expected}"]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: 2\n")
    result = _run(["--config", str(bad)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith(f"config error: {bad}:") and "malformed" in lines[0]
    )


def test_help_exits_0():
    result = _run(["--help"])
    assert result.returncode == 0 and "--dry-run" in result.stdout


def test_one_rank_run_binds_no_port(tmp_path):
    """A one-rank run (no torchrun, no MASTER_PORT) once bound torch's default 29500, so a
    second one on the machine failed with EADDRINUSE and a traceback; it has nobody to meet."""
    with socket.socket() as held:
        with contextlib.suppress(OSError):  # someone else holds it: as good for this test
            held.bind(("", 29500))
            held.listen()
        result = _run(
            ["--config", TINY, "--dry-run", "parallel.tp=1", "rollout.tp=1",
             f"trainer.output_dir={tmp_path}"],
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training layout: tp=1 pp=1 dp=1" in result.stdout


@pytest.mark.slow
def test_dry_run_prints_layout_table_on_4_ranks(tmp_path):
    result = _run(
        [
            "--config",
            TINY,
            "--dry-run",
            "parallel.tp=2",
            "parallel.pp=2",
            "rollout.engine=vllm",  # the megatron engine generates at pp=1 only
            f"trainer.output_dir={tmp_path}",
        ],
        torchrun_ranks=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))
    ]
    # rank node tp pp dp cp | gen_tp gen_dp — ranks ordered tp fastest, then pp.
    coords = {int(r[0]): tuple(int(x) for x in r[2:6]) for r in rows}
    assert coords == {0: (0, 0, 0, 0), 1: (1, 0, 0, 0), 2: (0, 1, 0, 0), 3: (1, 1, 0, 0)}
    assert "training layout: tp=2 pp=2 dp=1 cp=1 ep=1 etp=2 vpp=None sp=off;" in result.stdout
    assert (tmp_path / "tiny_cpu" / "config.resolved.yaml").is_file()


@pytest.mark.slow
def test_dry_run_layout_line_shows_expert_degrees(tmp_path):
    """The launch line names every degree: an MoE run's ep and etp, sequence parallelism.
    Through `rl-megatron-run` (the plain-torchrun dry run is above): a passing run, exit 0."""
    result = _launch(
        ["--nproc_per_node", "2"], "launch/ppo.py", "--config", "yaml_configs/tiny_moe_cpu.yaml",
        "--dry-run", "parallel.ep=2", f"trainer.output_dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("training layout:"))
    assert line.startswith("training layout: tp=1 pp=1 dp=2 cp=1 ep=2 etp=1 vpp=None sp=off;")


# --- rl-megatron-run (rl_megatron/launcher.py): torchrun that keeps the ranks' one line ---


def _launch(torchrun_args: list[str], script: str, *args: str, timeout: int = 240):
    """`python -m rl_megatron.launcher` (what the `rl-megatron-run` script runs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "rl_megatron.launcher", "--standalone", *torchrun_args]
    cmd += [script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# Each rank does what its argument says: `rank:what` pairs, the others exit 0.
RANK_SCRIPT = """
import os, signal, sys, time
rank = os.environ["RANK"]
what = dict(pair.split(":") for pair in sys.argv[1:]).get(rank, "ok")
if what == "refuse":
    print(f"error: refused on rank {rank}", file=sys.stderr)
    sys.exit(2)
if what == "refuse_together":  # both lines printed before either rank exits
    here = os.path.dirname(os.path.abspath(__file__))
    sys.stderr.write(f"error: refused on rank {rank}\\n")  # one write, as print_line
    sys.stderr.flush()
    open(os.path.join(here, f"refused.{rank}"), "w").close()
    while sum(name.startswith("refused.") for name in os.listdir(here)) < 2:
        time.sleep(0.05)
    sys.exit(2)
if what == "raise":
    raise RuntimeError(f"internal bug on rank {rank}")
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "wait":
    time.sleep(60)
"""


@pytest.fixture
def rank_script(tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


def test_launcher_keeps_a_config_errors_one_line_and_exit_code(tmp_path):
    result = _launch(
        ["--nproc_per_node", "2"], "launch/ppo.py", "--config", TINY, "actor.optim.lrr=1e-6",
        f"trainer.output_dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "config error: actor.optim.lrr: unknown key; did you mean actor.optim.lr?"
    ]
    assert result.stdout == ""


@pytest.mark.parametrize(
    "ranks, code, stderr",
    [
        # A refusal on one rank: the agent stops the other (SIGTERM), which is no failure.
        (["0:refuse", "1:wait"], 2, ["error: refused on rank 0"]),
        # Both refuse: both lines (each printed before either exits: the agent stops the
        # other ranks at the first exit, which under load could come before the second print).
        (["0:refuse_together", "1:refuse_together"], 2,
         ["error: refused on rank 0", "error: refused on rank 1"]),
        (["0:ok", "1:ok"], 0, []),
        (["1:kill", "0:wait"], 1, [
            "error: rank 1 killed by SIGKILL; the other ranks were stopped (each rank's own "
            "output is above)"]),
    ],
)  # fmt: skip
def test_launcher_exit_code_and_line_follow_the_ranks(rank_script, ranks, code, stderr):
    result = _launch(["--nproc_per_node", "2"], rank_script, *ranks)
    assert result.returncode == code, result.stderr[-3000:]
    assert sorted(result.stderr.strip().splitlines()) == stderr
    assert result.stdout == ""


def test_launcher_keeps_an_internal_errors_traceback_and_adds_one_line(rank_script):
    result = _launch(["--nproc_per_node", "2"], rank_script, "1:raise", "0:wait")
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "RuntimeError: internal bug on rank 1" in lines
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == (
        "error: rank 1 exited with code 1; the other ranks were stopped (each rank's own "
        "output is above)"
    )
    assert "ChildFailedError" not in result.stderr
    assert sum("Traceback" in line for line in lines) == 1


def test_launch_torchrun_py_is_the_same_launcher(rank_script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "launch/torchrun.py", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, rank_script, "0:refuse", "1:refuse"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "ChildFailedError" not in result.stderr


def test_the_exit_barrier_race_is_dropped_and_a_timeout_is_not():
    """The store's host left first: a closed connection at the exit barrier after this
    node's ranks finished is no failure (seen once in test_sbatch_console_is_quiet); a
    timeout there is."""
    import logging

    from torch.distributed import DistNetworkError, DistStoreError

    from rl_megatron.launcher import _DropExitBarrierRace

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "torch.distributed.elastic.agent.server.api", logging.ERROR, __file__, 1,
            "Error waiting on exit barrier. Elapsed: %s seconds", (0.1,), (type(exc), exc, None),
        )  # fmt: skip

    drop = _DropExitBarrierRace()
    assert not drop.filter(record(DistNetworkError("Failed to recv, got 0 bytes")))
    assert drop.filter(record(DistStoreError("Socket Timeout")))


@pytest.mark.parametrize("log_dir", [True, False])
def test_launcher_repeats_a_refusal_that_went_to_a_log_file(rank_script, tmp_path, log_dir):
    """--redirects 3: the ranks' output is in files only (--log-dir's, or a temporary
    folder's); the refusal's line still shows."""
    logs = ["--log-dir", str(tmp_path / "logs")] if log_dir else []
    result = _launch(
        ["--nproc_per_node", "2", "--redirects", "3", *logs], rank_script, "1:refuse", "0:wait"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == ["error: refused on rank 1"]
    assert result.stdout == ""


def test_launcher_names_the_log_file_holding_a_crashs_traceback(rank_script, tmp_path):
    logs = tmp_path / "logs"
    result = _launch(
        ["--nproc_per_node", "2", "--redirects", "1:2", "--log-dir", str(logs)],
        rank_script, "1:raise", "0:wait",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    [log] = logs.glob("*/attempt_0/1/stderr.log")
    assert line == (f"error: rank 1 exited with code 1 ({log}); the other ranks were stopped")
    assert "RuntimeError: internal bug on rank 1" in log.read_text()
