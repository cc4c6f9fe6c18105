"""benchmarks/reshard_bench.py on one CPU rank: the sync against the flat copy as
interleaved rounds, in the order the ratio needs (sync ÷ copy), and its headline row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import headline  # noqa: E402


def test_the_sync_is_timed_against_the_flat_copy_in_rounds(tmp_path):
    out = tmp_path / "reshard.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1", str(ROOT / "benchmarks/reshard_bench.py"), "--model", "qwen3-moe-tiny",
           "--repeats", "3", "--warmup", "1", "--out-json", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=env, timeout=300)
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    ab = row["floor"]["sync_vs_copy"]
    assert ab["repeats"] == 3 and row["graphs_vs_direct"] is None  # CPU: no graphs
    assert ab["ratios"] == [b / a for a, b in zip(ab["a_s"], ab["b_s"], strict=True)]
    # A: the flat copy of ~1 MB; B: the whole sync (its checks and all its copies), the
    # slower side by far on any machine, so the ratio (sync ÷ copy) is well above 1.
    assert ab["ratio_median"] > 2, ab
    (got,), note = headline.load_rows(out)
    assert note is None and got["ratio_median"] == ab["ratio_median"]
