"""Per-step metrics: one JSON line per step in the run folder, optionally TensorBoard.

Keys are flat `section/name` strings (`timing_s/generate`, `actor/pg_clipfrac`).
Only rank 0 writes; other ranks' `log` calls are no-ops, so callers need no rank checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)


class MetricsTracker:
    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = False) -> None:
        self.enabled = rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError(
                    "logging.tensorboard=true needs the `tensorboard` package (pip install tensorboard)"
                ) from exc
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Append one line `{"step": step, **metrics}`; returns the floats written."""
        values = {k: _to_float(v) for k, v in metrics.items()}
        if not self.enabled:
            return values
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        return values

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
