"""megatron_to_hf's failures a user can cause: one line on stderr, exit code 2, no output.

One tiny checkpoint (hf_to_megatron.py of a 4-layer Llama) is copied and damaged per case:
common.pt as random bytes (with and without --no-verify), as a pickle that would run a
command, or missing; an --out that cannot be created; a shard size that is no size;
--adapter-only on a checkpoint without LoRA adapters. Each
run leaves no `--out` and no `.partial` behind, and the checkpoint as it was. An internal
error after the partial directory exists keeps its traceback but removes the partial too.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multirank.test_checkpoint_tools import _make_hf

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "checkpoints_tools" / "megatron_to_hf.py"
PREFIX = "megatron_to_hf: error: "
pytestmark = pytest.mark.slow  # ~35 s: one conversion to make the checkpoint, then 9 runs


def _env() -> dict:
    # No PYTHONWARNINGS: the tool keeps its own console quiet, as users run it.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tool_errors")
    _make_hf(tmp / "hf")
    result = subprocess.run(
        [sys.executable, str(ROOT / "checkpoints_tools" / "hf_to_megatron.py"), "--hf-dir",
         str(tmp / "hf"), "--out", str(tmp / "meg"), "--tp", "1"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "meg"


def _damaged(ckpt: Path, tmp: Path, common_pt: bytes | None) -> Path:
    copy = tmp / "meg"
    shutil.copytree(ckpt, copy)
    if common_pt is None:
        (copy / "common.pt").unlink()
    else:
        (copy / "common.pt").write_bytes(common_pt)
    return copy


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _export(ckpt: Path, out: Path, *extra: str, code: str | None = None):
    cmd = [sys.executable, str(TOOL)] if code is None else [sys.executable, "-c", code, str(TOOL)]
    return subprocess.run(
        [*cmd, "--ckpt", str(ckpt), "--out", str(out), *extra],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} left behind"
    assert not list(out.parent.glob(f".{out.name}.partial*")), "a .partial left behind"


class _Command:
    """Unpickled, would run a shell command (what a weights-only load must refuse)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_random_bytes_common_pt(ckpt, tmp_path):
    garbage = random.Random(0).randbytes(1255)
    bad = _damaged(ckpt, tmp_path, garbage)
    before = _snapshot(bad)
    out = tmp_path / "hf_out"
    result = _export(bad, out, "--no-verify")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"{PREFIX}{bad}/common.pt: cannot be read as a weights-only torch file "
        f"(Unsupported operand {garbage[0]})"
    ]
    _nothing_written(out)
    # Checked against manifest.json (the default), the same bytes are a checksum mismatch.
    result = _export(bad, out)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{PREFIX}{bad}/common.pt: checksum mismatch (crc32 ")
    assert line.endswith("recorded at save): the file is corrupt")
    _nothing_written(out)
    assert _snapshot(bad) == before


def test_common_pt_that_would_run_code_is_refused(ckpt, tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / "evil.pt", "wb") as f:
        torch.save({"x": _Command(marker)}, f)
    bad = _damaged(ckpt, tmp_path, (tmp_path / "evil.pt").read_bytes())
    out = tmp_path / "hf_out"
    result = _export(bad, out, "--no-verify")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"{PREFIX}{bad}/common.pt: cannot be read as a weights-only torch file (Trying to "
        f"load unsupported GLOBAL {os.system.__module__}.system whose module "
        f"{os.system.__module__} is blocked.)"
    ]
    assert not marker.exists(), "the pickle's command ran"
    _nothing_written(out)


def test_missing_common_pt(ckpt, tmp_path):
    bad = _damaged(ckpt, tmp_path, None)
    out = tmp_path / "hf_out"
    result = _export(bad, out, "--no-verify")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"{PREFIX}{bad}/common.pt: missing (every dist_checkpointing save writes it)"
    ]
    _nothing_written(out)


@pytest.mark.parametrize(
    ("out_name", "extra", "expected"),
    [
        ("a_file/sub", [], "--out: {out}: {tmp}/a_file is not a directory"),
        ("hf_out", ["--max-shard-gb", "nan"], "--max-shard-gb: nan is not a size > 0 (GB)"),
        ("hf_out", ["--max-shard-gb", "0"], "--max-shard-gb: 0.0 is not a size > 0 (GB)"),
        ("hf_out", ["--adapter-only"], "{ckpt}: holds no LoRA adapters (--adapter-only)"),
    ],
)
def test_output_refusals(ckpt, tmp_path, out_name, extra, expected):
    (tmp_path / "a_file").write_text("mine")
    out = tmp_path / out_name
    result = _export(ckpt, out, *extra)
    assert result.returncode == 2, result.stderr[-3000:]
    line = PREFIX + expected.format(out=out, tmp=tmp_path, ckpt=ckpt)
    assert result.stderr.splitlines() == [line]
    _nothing_written(out)
    assert (tmp_path / "a_file").read_text() == "mine"


def test_internal_error_keeps_traceback_leaves_no_partial(ckpt, tmp_path):
    """A bug while writing (here: the shard writer raises) is not a user error: its
    traceback shows, and the half-written export is removed all the same."""
    code = (
        "import runpy, sys\n"
        "from rl_megatron.checkpoint import hf_export\n"
        "def boom(self, name, tensor):\n"
        "    raise RuntimeError('boom while writing ' + name)\n"
        "hf_export.SafetensorsShardWriter.write = boom\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    out = tmp_path / "hf_out"
    result = _export(ckpt, out, code=code)
    assert result.returncode == 1
    assert "RuntimeError: boom while writing model.embed_tokens.weight" in result.stderr
    _nothing_written(out)


def test_error_found_while_converting_is_one_line(ckpt, tmp_path):
    """A damaged tensor file is found by the checksums in the conversion itself (after
    megatron-core is imported, whose notices about our set-up must not surround the line)."""
    bad = tmp_path / "meg"
    shutil.copytree(ckpt, bad)
    [distcp] = bad.glob("*.distcp")
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    out = tmp_path / "hf_out"
    result = _export(bad, out)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{PREFIX}{distcp}: checksum mismatch (crc32 ")
    _nothing_written(out)
