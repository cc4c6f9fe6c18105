"""A full disk in real runs of `launch/ppo.py` (issue 36), 2 ranks of `yaml_configs/
tiny_cpu.yaml`: ENOSPC on one rank while step 4's checkpoint is written ends the run in one
line, exit 2 on every rank, no traceback, step 2's checkpoint and HF folder intact; a restart
on the still-full disk removes what the failed save (and a killed HF export) left before it
writes anything, then stops in one line at its resolved config; the next restart resumes
from step 2, redoes step 2's HF export that the kill interrupted, and completes.

ENOSPC is injected at the write (a small tmpfs needs root): `python -c INJECT launch/ppo.py`
patches the checkpoint writer (`integrity.HashingWriter.write`) or `Path.write_text` on the
rank and for the file that `DISK_FULL` names, then runs the launcher as `__main__`.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl_megatron.utils.disk_space import gigabytes
from tests.e2e.launches import DIST_VARS
from tests.e2e.test_launcher import ROOT, TINY
from tests.e2e.test_run_safety import TWO_RANKS_SMALL, _finish, _free_port

SMALL = [
    *TWO_RANKS_SMALL,
    "trainer.total_steps=4",
    "checkpoint.save_interval=2",
    "checkpoint.save_hf=true",
]
INJECT = textwrap.dedent(
    """
    import errno, os, pathlib, runpy, sys
    from rl_megatron.checkpoint import integrity

    rank, part = os.environ["DISK_FULL"].split(":", 1)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if os.environ["RANK"] == rank:
        write, write_text = integrity.HashingWriter.write, pathlib.Path.write_text

        def hashed(self, data):
            if part in self._file.name:
                raise full
            return write(self, data)

        def text(self, *args, **kwargs):
            if part in str(self):
                raise full
            return write_text(self, *args, **kwargs)

        integrity.HashingWriter.write, pathlib.Path.write_text = hashed, text
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def _launch(tmp_path: Path, disk_full: str | None) -> list[tuple[int, str, str]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {key: value for key, value in os.environ.items() if key not in DIST_VARS}
        env.update(
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = [sys.executable, "launch/ppo.py", "--config", TINY]
        cmd += [f"trainer.output_dir={tmp_path}", *SMALL]
        if disk_full is not None:
            env["DISK_FULL"] = disk_full
            cmd[1:1] = ["-c", INJECT]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return _finish(procs, timeout=300)


def _one_line(results) -> str:
    assert [code for code, _, _ in results] == [2, 2], [err[-3000:] for _, _, err in results]
    stderr = "\n".join(err for _, _, err in results)
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert results[0][2].count("error: ") == 1  # from rank 0
    return lines[0]


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_and_a_restart_cleans_up(tmp_path):
    run = tmp_path / "tiny_cpu"
    ckpts, hf = run / "checkpoints", run / "hf"
    # 1. rank 1's shard of step 4's checkpoint does not fit.
    line = _one_line(_launch(tmp_path, "1:step_00000004.tmp-"))
    kept = ckpts / "step_00000002"
    match = re.fullmatch(
        rf"error: no space left on device writing {ckpts / 'step_00000004'}; "
        r"(\S+) GB needed, (\S+) GB free",
        line,
    )
    assert match, line
    # N: what step 2's checkpoint took (the estimate is the last complete one's size)
    size = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file())
    assert match.group(1) == gigabytes(size)
    assert _names(ckpts) == ["step_00000002"]  # the failed save's .tmp- is gone
    assert _names(hf) == [".source", "step_00000002"]
    ckpt_digest, hf_digest = _digest(kept), _digest(hf / "step_00000002")

    # 2. As if killed: a save in progress, and step 2's HF export cut short.
    leftover = ckpts / "step_00000004.tmp-0123456789ab" / "actor"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"x" * 4096)
    (hf / "step_00000002").rename(hf / ".step_00000002.partial")
    # The disk still full: the leftovers are removed before config.resolved.yaml fails.
    results = _launch(tmp_path, "0:config.resolved.tmp")
    line = _one_line(results)
    assert re.fullmatch(
        rf"error: no space left on device writing {run / 'config.resolved.yaml'}; "
        r"\S+ GB needed, \S+ GB free",
        line,
    ), line
    assert _names(ckpts) == ["step_00000002"]
    assert _names(hf) == [".source"]
    assert not (run / "config.resolved.tmp").exists()
    log = results[0][1] + results[0][2]
    assert f"start-up: removed {leftover.parent} (left by an interrupted save)" in log, log[-3000:]

    # 3. Space again: resumes at step 2, exports step 2 again (the same weights), completes.
    results = _launch(tmp_path, None)
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    log = results[0][1] + results[0][2]
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in log, log[-3000:]
    assert (
        f"hf export of step 2 did not complete (no {hf / 'step_00000002'}): exporting it again"
        in log
    )
    assert _names(ckpts) == ["step_00000002", "step_00000004"]
    assert _names(hf) == [".source", "step_00000002", "step_00000004"]
    assert _digest(hf / "step_00000002") == hf_digest
    assert _digest(kept) == ckpt_digest
