"""What a trainer phase costs the host besides its own work: garbage-collector pauses and
calls into the CUDA driver's allocator, counted per phase of every step.

Both stop the host where they strike, and on a launch-bound phase the GPU waits with it:
a collection walks every tracked Python object, and when torch's caching allocator has no
cached block to hand out it calls `cudaMalloc` (and, before retrying a failed one,
`cudaFree`s its cache, which waits for the device). Phases that pass their memory back and
forth (the critic's update before the actor's, the engine's KV cache) are where a step can
meet them that a plain training loop, allocating the same blocks every iteration, never
does.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

import torch


class GcPauses:
    """Python garbage-collector pauses (count, seconds) since `reset`, via `gc.callbacks`."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.count, self.seconds = 0, 0.0

    def snapshot(self) -> tuple[int, float]:
        return self.count, self.seconds


GC_PAUSES = GcPauses()

# torch.cuda.memory_stats() counters: device allocations and frees (cudaMalloc / cudaFree),
# and allocations retried after the allocator emptied its cache.
_ALLOCATOR_COUNTERS = {
    "device_mallocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "alloc_retries": "num_alloc_retries",
}


def allocator_counts() -> dict[str, int]:
    """The caching allocator's cumulative driver calls (empty on CPU)."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(key, 0)) for name, key in _ALLOCATOR_COUNTERS.items()}


@contextlib.contextmanager
def probed_phases(phase_timer) -> Iterator[None]:
    """Within this context, every `phase_timer.time(phase)` block also records
    `bench/<phase>_gc_pause_s` and `bench/<phase>_<counter>` (`allocator_counts`) into the
    timer's metrics, so they are popped with the step's timings."""
    original = phase_timer.time

    @contextlib.contextmanager
    def time_and_probe(phase: str) -> Iterator[None]:
        with original(phase):
            gc_before, alloc_before = GC_PAUSES.snapshot(), allocator_counts()
            try:
                yield
            finally:
                metrics = phase_timer.metrics
                key = f"bench/{phase}_gc_pause_s"
                metrics[key] = metrics.get(key, 0.0) + GC_PAUSES.snapshot()[1] - gc_before[1]
                for name, count in allocator_counts().items():
                    key = f"bench/{phase}_{name}"
                    metrics[key] = metrics.get(key, 0) + count - alloc_before[name]

    phase_timer.time = time_and_probe
    try:
        yield
    finally:
        phase_timer.time = original
