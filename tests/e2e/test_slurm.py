"""Multi-node launches as on a Slurm cluster, with stand-ins for `srun` and `scontrol`.

`tests/e2e/slurm_standin/` holds the stand-ins: every "node" is this machine, and srun
starts one task per node (or `--ntasks-per-node`) with the variables Slurm gives a task.
Five launches run at once (they mostly wait on each other, and two cores are all CI has):

* `launch/slurm/ppo.sbatch` as sbatch would run it: two nodes, each one `torchrun` of two
  ranks, rendezvousing on the first node; two GRPO steps of tiny_cpu.yaml (TP 2 x DP 2).
  Its console is also the quiet-console check: no warning line, nothing unexpected.
* The plain Slurm path, no torchrun: srun starts the four ranks of `launch/ppo.py`, which
  read SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the node list; same two steps, same
  numbers. It runs with `logging.level=DEBUG`, which must show the warnings filtered above.
* Launches that cannot rendezvous, each with a 5 s timeout: the sbatch script with its
  second node never started (torchrun's join timeout), and the plain path with rank 0's
  node, then rank 1's, never started. Each fails with exit code 2 and one line per task
  naming the endpoint (host:port), within the timeout plus start-up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_launcher import ROOT, TINY
from tests.ports import reserve_port

STANDIN = Path(__file__).parent / "slurm_standin"
TWO_STEPS = ["trainer.total_steps=2", "trainer.val_interval=0", "checkpoint.save_interval=0"]
RDZV_TIMEOUT_S = 5
# What a quiet console may print: the per-step line, INFO lines, the layout table, and the
# resolved config (YAML) that follows "resolved config:".
STEP_LINE = re.compile(r"^step \d+/\d+ \| reward ")
INFO_LINE = re.compile(r"^\[\d\d:\d\d:\d\d INFO\] ")
TABLE_LINE = re.compile(
    r"^(\s*rank node .*|-+|\s*\d+ \S+(\s+\d+){4} \|(\s+\d+){2}|training layout: .*)$"
)
YAML_LINE = re.compile(r"^( +\S.*|[a-z_]+:( .*)?)$")


def _free_port() -> int:
    # Below the ephemeral range, once per process: tests/ports.py says why.
    return reserve_port()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(key, None)
    env.update(
        PATH=os.pathsep.join([str(STANDIN), str(Path(sys.executable).parent), env["PATH"]]),
        PYTHON=sys.executable,
        SLURM_JOB_NODELIST="localhost,localhost",  # two "nodes", both this machine
        SLURM_NNODES="2",
        SLURM_JOB_ID=str(os.getpid()),
        SLURM_GPUS_PER_NODE="2",  # ranks per node
        SLURM_CPUS_PER_TASK="2",
        MASTER_PORT=str(_free_port()),
        **extra,
    )
    return env


def _start(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, float, str]:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return proc, time.monotonic(), env["MASTER_PORT"]


def _sbatch(out: Path, *overrides: str, **env: str):
    cmd = ["bash", "launch/slurm/ppo.sbatch", TINY, f"trainer.output_dir={out}", *overrides]
    return _start(cmd, _env(**{"RDZV_TIMEOUT_S": "120", **env}))


def _srun_plain(out: Path, *overrides: str, **env: str):
    cmd = ["srun", "--nodes", "2", "--ntasks-per-node", "2", "--kill-on-bad-exit"]
    cmd += [sys.executable, "launch/ppo.py", "--config", TINY, f"trainer.output_dir={out}"]
    return _start(cmd + list(overrides), _env(OMP_NUM_THREADS="1", **env))


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("slurm")
    rdzv = [f"parallel.rendezvous_timeout_s={RDZV_TIMEOUT_S}"]
    started = {
        "sbatch": _sbatch(tmp / "sbatch", *TWO_STEPS),
        "plain": _srun_plain(tmp / "plain", *TWO_STEPS, "logging.level=DEBUG"),
        "sbatch_node_down": _sbatch(
            tmp / "down", STANDIN_NODES_DOWN="1", RDZV_TIMEOUT_S=str(RDZV_TIMEOUT_S)
        ),
        # --nodes 2 and one task per node: a world of two ranks, one of which never starts.
        "plain_rank0_down": _start(
            [
                "srun",
                "--nodes",
                "2",
                sys.executable,
                "launch/ppo.py",
                "--config",
                TINY,
                f"trainer.output_dir={tmp / 'down0'}",
                *rdzv,
            ],
            _env(STANDIN_NODES_DOWN="0"),
        ),  # fmt: skip
        "plain_rank1_down": _start(
            [
                "srun",
                "--nodes",
                "2",
                sys.executable,
                "launch/ppo.py",
                "--config",
                TINY,
                f"trainer.output_dir={tmp / 'down1'}",
                *rdzv,
            ],
            _env(STANDIN_NODES_DOWN="1"),
        ),  # fmt: skip
    }
    results = {}
    for name, (proc, begun, port) in started.items():
        stdout, stderr = proc.communicate(timeout=400)
        results[name] = {
            "code": proc.returncode,
            "stdout": stdout,
            "stderr": stderr,
            "seconds": time.monotonic() - begun,
            "port": port,
            "run_dir": tmp / name / "tiny_cpu",
        }
    return results


def _metrics(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _warning_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Warning" in line or "warnings.warn" in line]


def test_sbatch_two_nodes_of_two_ranks_train_two_steps(launches):
    run = launches["sbatch"]
    assert run["code"] == 0, run["stderr"][-3000:]
    assert [r["step"] for r in _metrics(run["run_dir"])] == [1, 2]
    assert len([line for line in run["stdout"].splitlines() if STEP_LINE.match(line)]) == 2
    # Four ranks in the layout table, TP 2 x DP 2 over the two "nodes".
    assert "training layout: tp=2 pp=1 dp=2" in run["stdout"]
    rows = [
        line.split() for line in run["stdout"].splitlines() if re.match(r"^\s*\d+ \S+\s+\d", line)
    ]
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3]


def test_sbatch_console_is_quiet(launches):
    """The demo-sized launch prints our lines only: no warning, nothing unclassified."""
    run = launches["sbatch"]
    assert run["code"] == 0, run["stderr"][-3000:]
    assert _warning_lines(run["stdout"] + run["stderr"]) == []
    assert run["stderr"].strip() == "", run["stderr"][-3000:]
    lines = run["stdout"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("resolved config:"))
    unexpected = [
        line
        for i, line in enumerate(lines)
        if line.strip()
        and not (STEP_LINE.match(line) or INFO_LINE.match(line) or TABLE_LINE.match(line))
        and not (i > start and YAML_LINE.match(line))
    ]
    assert unexpected == []


def test_plain_slurm_path_trains_the_same_two_steps(launches):
    plain, sbatch = launches["plain"], launches["sbatch"]
    assert plain["code"] == 0, plain["stderr"][-3000:]
    got, want = _metrics(plain["run_dir"]), _metrics(sbatch["run_dir"])
    assert [r["step"] for r in got] == [1, 2]
    # The same seeds, layout and data: launched either way, the same numbers.
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-6), key


def test_debug_level_shows_third_party_warnings(launches):
    plain = launches["plain"]
    assert plain["code"] == 0, plain["stderr"][-3000:]
    shown = _warning_lines(plain["stderr"])
    assert any("FutureWarning" in line for line in shown), plain["stderr"][-3000:]
    assert any("Apex is not installed" in line for line in shown)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("sbatch_node_down", r"no rendezvous with the other nodes at localhost:\d+ within "
         rf"join_timeout={RDZV_TIMEOUT_S} s"),
        ("plain_rank0_down", rf"nothing answered at localhost:\d+ within {RDZV_TIMEOUT_S} s "
         r"\(rank 1 of 2 on "),
        ("plain_rank1_down", rf"rendezvous at localhost:\d+ failed within {RDZV_TIMEOUT_S} s "
         r"\(rank 0 of 2 on .*1/2 clients joined"),
    ],
)  # fmt: skip
def test_failed_rendezvous_is_one_line_naming_host_and_port(launches, name, expected):
    run = launches[name]
    assert run["code"] == 2, run["stderr"][-3000:]
    lines = run["stderr"].strip().splitlines()
    assert len(lines) == 1, run["stderr"][-3000:]
    assert re.search(expected, lines[0]), lines[0]
    assert f"localhost:{run['port']}" in lines[0]
    assert lines[0].startswith("error: ")
    # Within the timeout, plus the start-up of Python and torch on a busy 2-core machine.
    assert run["seconds"] < RDZV_TIMEOUT_S + 60
