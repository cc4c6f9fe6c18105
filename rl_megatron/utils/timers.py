"""Phase timers and memory probes: `with phases.time("generate"): ...`.

Each phase records wall seconds (`timing_s/<phase>`) and, on GPUs, what memory it used:

    memory_gb/<phase>_peak           PyTorch allocator: peak allocated inside the phase
    memory_gb/<phase>_reserved_peak  PyTorch allocator: peak reserved (cached) inside it
    memory_gb/<phase>_device_used    the driver: device memory in use at the phase's end
                                     (`cudaMemGetInfo`: total − free)
    memory_gb/<phase>_peak_on_device           the two peaks less what the allocator
    memory_gb/<phase>_reserved_peak_on_device  counts but the device does not hold: vLLM's
                                               memory asleep (with `off_device_bytes`:
                                               vLLM in sleep mode; the least read in the
                                               phase, so they err high if at all)

The allocator's figures count only what torch's caching allocator handed out — and vLLM's
sleep-mode pool too, since vLLM allocates through a pluggable allocator, asleep or not (on
an H200, 8B: `update_actor_peak` 148 GiB of a 140 GiB GPU, 57 GiB of it vLLM's asleep;
benchmarks/RESULTS.md); the driver's figure is what the GPU holds, whoever holds it (vLLM,
NCCL, other processes), but only at the phase's end. The `_on_device` peaks are the ones to
size a run by: the peak of what is really on the device inside the phase. The allocator
peak is reset at every phase start; a phase entered twice in a step (per mini-batch) keeps
the larger of its figures.

`phases.part(phase, part)` times a part of a phase (`timing_parts_s/<phase>/<part>`: not
under `timing_s/`, whose keys add up to the step), with the same synchronisation but no
memory reset, so the enclosing phase's peak still covers it.
GPU work is synchronised at every boundary so the time belongs to what queued it.

`phases.overlapped(phase, part)` is the exception: host work done while the device still
runs what the phase queued (the engine's weights mapped back during the actor's last
optimizer step), timed on the host only, without synchronising, so that the overlap stays
(`timing_overlap_s/<phase>/<part>`: the most it can add to the phase). A phase that ends
with such a wake takes its peaks before it (`close_peaks`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    def __init__(self, off_device_bytes: Callable[[], int | None] | None = None) -> None:
        """off_device_bytes: bytes the allocator counts as allocated that hold no device
        memory now (`RolloutEngine.unmapped_bytes`), None where it cannot say; with it,
        each phase also reports its `_on_device` peaks."""
        self.metrics: dict[str, float] = {}
        self.off_device_bytes = off_device_bytes
        # Open phases: the least `off_device_bytes` read since each began (None: no figure).
        self._least_off_device: dict[str, int | None] = {}

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        _synchronize()
        reset_peak_memory()
        self._read_off_device(opening=phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self._add(f"timing_s/{phase}", time.perf_counter() - start)
            self._read_off_device()
            if phase in self._least_off_device:  # its peaks not taken yet (`close_peaks`)
                self._take_peaks(phase)
            if torch.cuda.is_available():
                self._max(f"memory_gb/{phase}_device_used", device_used_gb())

    def close_peaks(self, phase: str) -> None:
        """Record `phase`'s memory peaks now, before it ends: what it still runs after this
        only maps the engine's memory back (`RolloutEngine.wake_if_room`). No
        synchronisation: the allocator's peaks count what the host has queued.

        Why not at the end: after such a wake the least read of the engine's memory asleep
        is less by what it mapped, and the peak, reached before the wake, would be
        over-stated by as much. (No read of the memory asleep here: since the last one,
        nothing woke outside a part.)"""
        self._take_peaks(phase)

    def _take_peaks(self, phase: str) -> None:
        off_device = self._least_off_device.pop(phase)
        if not torch.cuda.is_available():
            return
        peaks = {
            "peak": torch.cuda.max_memory_allocated(),
            "reserved_peak": torch.cuda.max_memory_reserved(),
        }
        for name, peak in peaks.items():
            self._max(f"memory_gb/{phase}_{name}", peak / 2**30)
        # Between two reads (the phase's and its parts' boundaries) memory sleeps or wakes,
        # never wakes and sleeps again (a wake inside a phase is a part of it, or comes
        # after its peaks were taken), so what was asleep never fell below the least read:
        # less it, the peaks can only over-state what the device held, never under-state
        # it. (The allocated peak less whole segments also loses the free space inside
        # vLLM's asleep ones: small, its weights and KV cache are large tensors.)
        if off_device is not None:
            for name, peak in peaks.items():
                self._max(f"memory_gb/{phase}_{name}_on_device", (peak - off_device) / 2**30)

    @contextlib.contextmanager
    def part(self, phase: str, part: str) -> Iterator[None]:
        """Time `part` of `phase` (inside `time(phase)`): `timing_parts_s/<phase>/<part>`.
        Its boundaries read `off_device_bytes` too: a wake inside a phase goes in a part."""
        _synchronize()
        self._read_off_device()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self._add(f"timing_parts_s/{phase}/{part}", time.perf_counter() - start)
            self._read_off_device()

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

    def _read_off_device(self, opening: str | None = None) -> None:
        """Read `off_device_bytes` once for the open phases, each keeping its least, and for
        `opening` (a phase it starts), whose first read it is."""
        if opening is None and not self._least_off_device:
            return
        now = self._off_device_now()
        for phase, least in self._least_off_device.items():
            self._least_off_device[phase] = (
                None if now is None or least is None else min(least, now)
            )
        if opening is not None:
            self._least_off_device[opening] = now

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
