"""Run a vLLM test script under `torchrun --nproc_per_node 2` and collect its per-rank JSON.

The scripts write `out/rank{r}.json` (a result dict, or {"error": traceback}); vLLM's
in-process engine has to live in a torchrun world, so the tests cannot run it in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NPROC = 2


def run_script(script: Path, spec_path: Path, out: Path, timeout_s: int) -> list[dict]:
    """torchrun `script --spec spec_path --out out` on 2 ranks; each rank's result dict."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny models need far less
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",  # free local port
           "--nproc_per_node", str(NPROC), str(script), "--spec", str(spec_path),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    results = []
    for rank in range(NPROC):
        path = out / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(
                f"rank {rank} wrote no result (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
            )
        res = json.loads(path.read_text())
        if "error" in res:
            pytest.fail(f"rank {rank} failed:\n{res['error']}")
        results.append(res)
    return results
