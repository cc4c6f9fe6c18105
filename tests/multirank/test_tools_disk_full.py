"""`hf_to_megatron.py` on a full disk (issue 36): one line, exit 2, no `.partial` left, the
input untouched. ENOSPC is injected at the write of the checkpoint's shard file (every file
goes through `integrity.HashingWriter`), in the tool's own process."""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
import sys
import textwrap

import pytest
from safetensors import safe_open

from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.utils.disk_space import gigabytes
from tests.multirank.test_checkpoint_tools import ROOT, TOOLS, V, _env, _make_hf

INJECT = textwrap.dedent(
    """
    import errno, os, runpy, sys
    from rl_megatron.checkpoint import integrity

    real = integrity.HashingWriter.write

    def write(self, data):
        if ".partial" in self._file.name and self._file.name.endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    integrity.HashingWriter.write = write
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def _digest(folder) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.mark.slow
def test_hf_to_megatron_on_a_full_disk_is_one_line(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "meg"
    _make_hf(src)
    before = _digest(src)
    tool = str(TOOLS / "hf_to_megatron.py")
    args = ["--hf-dir", str(src), "--out", str(out), "--dtype", "fp32"]
    proc = subprocess.run(
        [sys.executable, "-c", INJECT, tool, *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,  # bytes: text mode would turn the bar's \r into line breaks
        timeout=300,
    )
    stderr = proc.stderr.decode()
    assert proc.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    # What the terminal shows: the progress bar, cleared, leaves no line of its own.
    lines = [line.split("\r")[-1] for line in stderr.split("\n")]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    # N: every tensor at fp32, the vocabulary rows padded as the tool pads them
    padded = padded_vocab_size(V, 128, 1)
    numel = 0
    for f in src.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():  # noqa: SIM118 (no dict)
                shape = list(st.get_slice(name).get_shape())
                if shape[0] == V:
                    shape[0] = padded
                numel += math.prod(shape)
    assert re.fullmatch(
        rf"hf_to_megatron: error: no space left on device writing {out}; "
        rf"{re.escape(gigabytes(4 * numel))} GB needed, \S+ GB free",
        lines[0],
    ), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .partial, no output
    assert _digest(src) == before
