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


def profile_calls(call, count: int, out_dir, stem: str, before=None, write: bool = True) -> dict:
    """`count` more calls of `call`, each under torch.profiler (`before()` runs first, outside
    it): the top ops of each by host time, to `out_dir/<stem>.txt`, and the last call's
    Chrome trace, to `out_dir/trace_<stem>.json.gz`. For the few-millisecond phases (a
    weight sync) whose host time a GPU run has to explain: which ops, how many launches,
    where the device waited. Returns the paths written (`write`: this rank writes)."""
    import gzip
    import shutil
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    tables, last = [], None
    for i in range(count):
        if before is not None:
            before()
        sync()
        with profile(activities=activities) as prof:
            call()
            sync()
        last = prof
        tables.append(
            f"call {i + 1} of {count}, by self_cpu_time_total:\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        )
    if not write or last is None:
        return {}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / f"{stem}.txt"
    text.write_text("\n\n".join(tables) + "\n")
    raw = out_dir / f"trace_{stem}.json"
    last.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {"table": str(text), "trace": f"{raw}.gz"}
