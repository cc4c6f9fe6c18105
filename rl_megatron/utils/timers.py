"""Phase timers and peak-memory probes: `with phases.time("generate"): ...`.

Each phase records wall seconds (`timing_s/<phase>`) and, on GPUs, the peak allocated
memory inside it (`memory_gb/<phase>_peak`). GPU work is synchronised at the phase
boundaries so the time belongs to the phase that queued it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_gb() -> float:
    """Peak allocated GPU memory since the last reset, GiB (0 on CPU)."""
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


class PhaseTimer:
    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        _synchronize()
        reset_peak_memory()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            elapsed = time.perf_counter() - start
            key = f"timing_s/{phase}"
            # A phase entered twice in a step (e.g. per mini-batch) accumulates.
            self.metrics[key] = self.metrics.get(key, 0.0) + elapsed
            if torch.cuda.is_available():
                mem_key = f"memory_gb/{phase}_peak"
                self.metrics[mem_key] = max(self.metrics.get(mem_key, 0.0), peak_memory_gb())

    def pop(self) -> dict[str, float]:
        """This step's timings and peaks; resets for the next step."""
        metrics, self.metrics = self.metrics, {}
        return metrics
