"""Small helpers the trainer bench's modules share: device sync and memory in GiB."""

from __future__ import annotations

import contextlib
import gc

import torch


def sync() -> None:
    """Wait for the GPU's queued work (nothing on CPU), so that host timers cover it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gib(nbytes: float) -> float:
    """Bytes to GiB."""
    return nbytes / 2**30


def allocated_gb() -> float:
    """GiB held by torch's CUDA tensors now (0 on CPU)."""
    return gib(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0


def free_memory() -> None:
    """Collect garbage and hand the CUDA allocator's cached blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def trainer_gc_policy(manual_gc: bool):
    """Garbage collection as the trainer has it (`trainer.manual_gc`): with it, one
    collection first and none automatic inside; without it, as it was."""
    enabled = gc.isenabled()
    if manual_gc:
        gc.collect()
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
