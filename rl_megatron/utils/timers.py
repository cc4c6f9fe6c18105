"""Phase timers and memory probes: `with phases.time("generate"): ...`.

Each phase records wall seconds (`timing_s/<phase>`) and, on GPUs, what memory it used:

    memory_gb/<phase>_peak           PyTorch allocator: peak allocated inside the phase
    memory_gb/<phase>_reserved_peak  PyTorch allocator: peak reserved (cached) inside it
    memory_gb/<phase>_device_used    the driver: device memory in use at the phase's end
                                     (`cudaMemGetInfo`: total − free)

The allocator's figures count only what torch's caching allocator handed out — and vLLM's
sleep-mode pool too, since vLLM allocates through a pluggable allocator, asleep or not; the
driver's figure is what the GPU holds, whoever holds it (vLLM, NCCL, other processes), and
is the one to size a run by. The allocator peak is reset at every phase start; a phase
entered twice in a step (per mini-batch) keeps the larger of its figures.

`phases.part(phase, part)` times a part of a phase (`timing_parts_s/<phase>/<part>`: not
under `timing_s/`, whose keys add up to the step), with the same synchronisation but no
memory reset, so the enclosing phase's peak still covers it.
GPU work is synchronised at every boundary so the time belongs to what queued it.
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


def device_used_gb() -> float | None:
    """Device memory in use as the driver sees it (total − free), GiB; None on CPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


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
            self._add(f"timing_s/{phase}", time.perf_counter() - start)
            if torch.cuda.is_available():
                self._max(f"memory_gb/{phase}_peak", peak_memory_gb())
                self._max(
                    f"memory_gb/{phase}_reserved_peak", torch.cuda.max_memory_reserved() / 2**30
                )
                self._max(f"memory_gb/{phase}_device_used", device_used_gb())

    @contextlib.contextmanager
    def part(self, phase: str, part: str) -> Iterator[None]:
        """Time `part` of `phase` (inside `time(phase)`): `timing_parts_s/<phase>/<part>`."""
        _synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self._add(f"timing_parts_s/{phase}/{part}", time.perf_counter() - start)

    def record(self, key: str, value: float) -> None:
        """A figure measured elsewhere (e.g. the engine's memory asleep), this step."""
        self.metrics[key] = value

    def _add(self, key: str, value: float) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + value

    def _max(self, key: str, value: float) -> None:
        self.metrics[key] = max(self.metrics.get(key, 0.0), value)

    def pop(self) -> dict[str, float]:
        """This step's timings and memory figures; resets for the next step."""
        metrics, self.metrics = self.metrics, {}
        return metrics
