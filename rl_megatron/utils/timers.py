"""Phase timers and memory probes: `with phases.time("generate"): ...`.

Each phase records wall seconds (`timing_s/<phase>`) and, on GPUs, what memory it used:

    memory_gb/<phase>_peak           PyTorch allocator: peak allocated inside the phase
    memory_gb/<phase>_reserved_peak  PyTorch allocator: peak reserved (cached) inside it
    memory_gb/<phase>_device_used    the driver: device memory in use at the phase's end
                                     (`cudaMemGetInfo`: total − free)
    memory_gb/<phase>_peak_on_device           the two peaks less what the allocator
    memory_gb/<phase>_reserved_peak_on_device  counts but the device does not hold: vLLM's
                                               memory asleep (with `off_device_bytes`:
                                               vLLM in sleep mode; see below)

The allocator's figures count only what torch's caching allocator handed out — and vLLM's
sleep-mode pool too, since vLLM allocates through a pluggable allocator, asleep or not (on
an H200, 8B: `update_actor_peak` 148 GiB of a 140 GiB GPU, 57 GiB of it vLLM's asleep;
benchmarks/RESULTS.md); the driver's figure is what the GPU holds, whoever holds it (vLLM,
NCCL, other processes), but only at the phase's end. The `_on_device` peaks are the ones to
size a run by: the peak of what is really on the device inside the phase. A phase entered
twice in a step (per mini-batch) keeps the larger of its figures.

How the `_on_device` peaks are made: every boundary (a phase's or a part's start and end)
ends an interval of the memory accounting. There the timer reads the allocator's peaks
since the last boundary, then resets them, and reads `off_device_bytes`. Each open phase
keeps, per interval, the interval's peak less the lesser of the memory asleep at its two
ends, and reports the largest. Within an interval the engine's memory only sleeps or only
wakes, never both (a wake inside a phase goes in parts of its own: `make_room`, where
torch's cache is given back, then the wake), so what was asleep at the interval's peak was
at least that lesser read: the figures can over-state what the device held, never
under-state it. (The allocated peak less whole segments also loses the free space inside
vLLM's asleep ones: small, its weights and KV cache are large tensors.)

`phases.part(phase, part)` times a part of a phase (`timing_parts_s/<phase>/<part>`: not
under `timing_s/`, whose keys add up to the step), with the same synchronisation; its
memory is the enclosing phase's.
GPU work is synchronised at every boundary so the time belongs to what queued it.

`phases.overlapped(phase, part)` is the exception: host work done while the device still
runs what the phase queued (the engine's weights mapped back during the actor's last
optimizer step), timed on the host only, without synchronising, so that the overlap stays
(`timing_overlap_s/<phase>/<part>`: the most it can add to the phase). A phase that ends
with such a wake takes its memory figures before it (`close_peaks`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_used_gb() -> float | None:
    """Device memory in use as the driver sees it (total − free), GiB; None on CPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


@dataclass
class _OpenPhase:
    """A phase's memory accounting while it runs (bytes)."""

    asleep: int | None  # `off_device_bytes` at the last boundary; None: no figure
    peaks: dict[str, int] = field(default_factory=dict)  # the largest of each figure so far


class PhaseTimer:
    def __init__(self, off_device_bytes: Callable[[], int | None] | None = None) -> None:
        """off_device_bytes: bytes the allocator counts as allocated that hold no device
        memory now (`RolloutEngine.unmapped_bytes`), None where it cannot say; with it,
        each phase also reports its `_on_device` peaks."""
        self.metrics: dict[str, float] = {}
        self.off_device_bytes = off_device_bytes
        self._open: dict[str, _OpenPhase] = {}

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        _synchronize()
        self._boundary(opening=phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self._add(f"timing_s/{phase}", time.perf_counter() - start)
            self._boundary()
            if phase in self._open:  # its figures not taken yet (`close_peaks`)
                self._record_peaks(phase)
            if torch.cuda.is_available():
                self._max(f"memory_gb/{phase}_device_used", device_used_gb())

    def close_peaks(self, phase: str) -> None:
        """Record `phase`'s memory peaks now, before it ends: what it still runs after this
        only maps the engine's memory back (`RolloutEngine.wake_if_room`), which is no
        allocation of torch's and makes the device hold more, not less, than the figures
        said. No synchronisation: the allocator's peaks count what the host has queued.

        Why not at the end: that wake would end the phase's last interval with less memory
        asleep, and the interval's peak, reached before the wake, would be over-stated by
        what it mapped."""
        if phase not in self._open:
            raise RuntimeError(
                f"close_peaks({phase!r}): the phase is not open (call it inside "
                f"`time({phase!r})`, once)"
            )
        self._boundary()
        self._record_peaks(phase)

    @contextlib.contextmanager
    def part(self, phase: str, part: str) -> Iterator[None]:
        """Time `part` of `phase` (inside `time(phase)`): `timing_parts_s/<phase>/<part>`.
        Its boundaries end intervals of the memory accounting too: a wake inside a phase
        goes in a part (and giving torch's cache back for it in another, before)."""
        _synchronize()
        self._boundary()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self._add(f"timing_parts_s/{phase}/{part}", time.perf_counter() - start)
            self._boundary()

    @contextlib.contextmanager
    def overlapped(self, phase: str, part: str) -> Iterator[None]:
        """Time host work of `phase` that overlaps the device's (`timing_overlap_s/...`);
        no synchronisation before or after it."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add(f"timing_overlap_s/{phase}/{part}", time.perf_counter() - start)

    def _off_device_now(self) -> int | None:
        """`off_device_bytes` now; None without it, or off GPUs."""
        if self.off_device_bytes is None or not torch.cuda.is_available():
            return None
        return self.off_device_bytes()

    def _boundary(self, opening: str | None = None) -> None:
        """End the accounting's interval for every open phase (module docstring), then start
        the next: `opening`, a phase that starts here, opens with it."""
        if opening is None and not self._open:
            return
        asleep = self._off_device_now()
        if torch.cuda.is_available():
            interval = {
                "peak": torch.cuda.max_memory_allocated(),
                "reserved_peak": torch.cuda.max_memory_reserved(),
            }
            for open_phase in self._open.values():
                before, open_phase.asleep = open_phase.asleep, asleep
                off_device = None if before is None or asleep is None else min(before, asleep)
                for name, peak in interval.items():
                    figures = {name: peak}
                    if off_device is not None:
                        figures[f"{name}_on_device"] = peak - off_device
                    for key, value in figures.items():
                        open_phase.peaks[key] = max(open_phase.peaks.get(key, value), value)
            torch.cuda.reset_peak_memory_stats()
        if opening is not None:
            self._open[opening] = _OpenPhase(asleep)

    def _record_peaks(self, phase: str) -> None:
        for name, peak in self._open.pop(phase).peaks.items():
            self._max(f"memory_gb/{phase}_{name}", peak / 2**30)

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
