"""Per-step metrics: one JSON line per step in the run folder, optionally TensorBoard and
Weights & Biases (`logging.wandb`; `wandb` is imported only then, and never required).

Keys are flat `section/name` strings (`timing_s/generate`, `actor/pg_clipfrac`).
Only rank 0 writes; other ranks' `log` calls are no-ops, so callers need no rank checks.
`python -m rl_megatron.plot RUN_DIR` draws the curves from `metrics.jsonl`.
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


WANDB_ID_FILE = "wandb_run_id"  # in the run folder: a resumed run continues its W&B run


def wandb_settings(config) -> dict[str, Any] | None:
    """`wandb.init` arguments from the config's `logging.wandb*`; None when W&B is off."""
    log = config.logging
    if not log.wandb:
        return None
    from rl_megatron.config import to_dict

    return {
        "project": log.wandb_project,
        "entity": log.wandb_entity,
        "name": config.trainer.experiment_name,
        "dir": str(config.run_dir),
        "config": to_dict(config),
    }


class MetricsTracker:
    """Args:
    run_dir: the run folder (`metrics.jsonl`, `tensorboard/`, W&B's files).
    rank: global rank; only rank 0 writes.
    tensorboard: also write TensorBoard events.
    wandb: `wandb.init` arguments (`wandb_settings`), or None for no W&B.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        tensorboard: bool = False,
        wandb: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
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
        if wandb is not None:
            self._wandb = _start_wandb(Path(run_dir), wandb)

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
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        return values

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(run_dir: Path, settings: dict[str, Any]):
    """`wandb.init` with the run folder's W&B id (made on first use), so that a resumed run
    appends to the same W&B run instead of starting another."""
    try:
        import wandb
    except ImportError as exc:  # config_checks refuses this earlier; kept for direct use
        raise RuntimeError(
            "logging.wandb=true needs the `wandb` package (pip install wandb)"
        ) from exc
    id_file = run_dir / WANDB_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
    return wandb.init(id=run_id, resume="allow", **settings)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
