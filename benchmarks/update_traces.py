"""Where an actor update spends its time: torch.profiler tables, a Chrome trace with the
device's idle gaps, and the call sites of its host-device syncs (torch's sync debug mode).

Used by `trainer_bench.py` for one trainer step's actor-update phase and by `plain_loop.py`
for the plain loop's iterations, so that the two compare op by op; `profile_calls` by
`sync_ab.py` and `reshard_bench.py` for a few weight syncs.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from bench_utils import sync  # benchmarks/, on sys.path in the scripts


def _activities() -> list:
    """The host's ops, and the device's kernels where there is a GPU."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return activities


def _export_trace(prof, path: Path) -> str:
    """`prof`'s Chrome trace as `path`.gz (the JSON itself is not kept)."""
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return f"{path}.gz"


def profiled(fn, path: Path, write: bool):
    """`fn()` under torch.profiler; the top ops by device and by host time go to `path`."""
    from torch.profiler import profile

    sync()
    with profile(activities=_activities()) as prof:
        out = fn()
        sync()
    if write:
        events = prof.key_averages()
        device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"by {device_key}:\n{events.table(sort_by=device_key, row_limit=40)}\n\n"
            f"by self_cpu_time_total:\n"
            f"{events.table(sort_by='self_cpu_time_total', row_limit=40)}\n"
        )
    return out


def profile_calls(call, count: int, out_dir: Path, stem: str, before=None, write: bool = True):
    """`count` more calls of `call`, each under torch.profiler (`before()` runs first, outside
    it): the top ops of each by host time, to `out_dir/<stem>.txt`, and the last call's
    Chrome trace, to `out_dir/trace_<stem>.json.gz`. For the few-millisecond phases (a
    weight sync) whose host time a GPU run has to explain: which ops, how many launches,
    where the device waited. Returns the paths written (`write`: this rank writes)."""
    from torch.profiler import profile

    tables, last = [], None
    for i in range(count):
        if before is not None:
            before()
        sync()
        with profile(activities=_activities()) as prof:
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
    return {"table": str(text), "trace": _export_trace(last, out_dir / f"trace_{stem}.json")}


def python_profile(call, count: int, out_dir: Path, stem: str, before=None, write: bool = True):
    """`count` more calls of `call` under cProfile (`before()` runs first, outside it): the
    Python functions by own time and by cumulative time, to `out_dir/<stem>_python.txt`.
    torch.profiler sees ops and kernels; a sync's host time before its first launch is
    Python (plan checks, tensor facts, the engine's begin), which only this names.
    cProfile's own overhead inflates every call alike: read the shares, not the times."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(count):
        if before is not None:
            before()
        sync()
        prof.enable()
        call()
        sync()
        prof.disable()
    if not write:
        return None
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"{count} calls under cProfile\n\nby own time:\n")
    stats.sort_stats("tottime").print_stats(40)
    out.write("\nby cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(60)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}_python.txt"
    path.write_text(out.getvalue())
    return str(path)


def kept_actor_update(trainer, during=contextlib.nullcontext):
    """One more training step; its actor-update phase kept as `update()`, which runs it
    again (the same batch into the same role) inside the trainer's `update_actor` phase
    timer, as the step does (its last optimizer step closes the phase's memory figures
    before it wakes the engine's weights: `rollout.wake_weights_during_update`), and what
    `during()` yielded around the step's own run of it (e.g.
    `update_diagnostics.recorded_micro_batches`)."""
    kept = {}

    def keep(update):
        kept["update"] = update
        with during() as kept["seen"]:
            return update()

    step_with_actor_update(trainer, keep)

    def again():
        with trainer.phases.time("update_actor"):
            return kept["update"]()

    return again, kept["seen"]


def step_with_actor_update(trainer, around) -> None:
    """One more training step whose actor-update phase runs as `around(update)`, where
    `update()` is the phase itself (the critic's and the other phases run as usual)."""
    original = trainer._update

    def patched(role, batch, loss_fn, name, **kwargs):
        if name != "actor":
            return original(role, batch, loss_fn, name, **kwargs)
        return around(lambda: original(role, batch, loss_fn, name, **kwargs))

    trainer._update = patched
    try:
        trainer.train_step()
        trainer.step += 1
    finally:
        trainer._update = original


def trace_actor_update(trainer, stem: Path) -> dict:
    """One more step with its actor update (every mini-batch, and the work around them)
    under torch.profiler: a Chrome trace (`stem`.json.gz, rank 0) and the device's idle time.

    Wall time above device time is time the GPU waits for the host; the summary lists the
    longest waits with the host ops that ran in them.
    """
    from torch.profiler import ProfilerActivity, profile

    summary: dict = {}

    def traced(update):
        if not torch.cuda.is_available():
            return update()
        sync()
        # No wall time here: it would include the profiler's own start and stop. The
        # phase's span is the first to the last kernel (`_device_idle`).
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = update()
            sync()
        summary.update(_device_idle(prof.events()))
        if dist.get_rank() == 0:
            summary["trace"] = _export_trace(prof, stem.with_suffix(".json"))
        return out

    step_with_actor_update(trainer, traced)
    return summary


def actor_update_sync_sites(trainer) -> dict:
    """One more step; the host-device syncs of its actor-update phase (`sync_sites_of`)."""
    sites: dict = {}

    def counted(update):
        box = []
        sites.update(sync_sites_of(lambda: box.append(update())) or {})
        return box[0]

    step_with_actor_update(trainer, counted)
    return sites


def sync_sites_of(fn) -> dict | None:
    """Where `fn()` makes the host wait for the GPU, from torch's sync debug mode: a count
    per call site, each named by its innermost frames outside torch (GPU only).

    Every sync empties the launch queue: the device then idles while the host issues what
    comes next, so on a launch-bound step each one costs time.
    """
    if not torch.cuda.is_available():
        fn()
        return None
    import collections
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(*_args, **_kwargs):
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if f"{os.sep}torch{os.sep}" not in f.filename and "warnings" not in f.filename
        ]
        where = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))
        sites[where] += 1

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return dict(sites.most_common())


def device_idle_of(fn) -> dict | None:
    """`fn()` under torch.profiler (GPU only): the device's busy and idle time in it."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return _device_idle(prof.events())


def _device_idle(events, longest: int = 15) -> dict:
    """Busy and idle device time between the first and last kernel; the longest idle gaps,
    each with the host ops that began inside it (what the device was waiting for)."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels:
        return {}
    busy, gaps = 0.0, []
    cur_start, cur_end = kernels[0]
    for start, end in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_end, start))
            cur_start = start
        cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    host = sorted(
        (e.time_range.start, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith("cuda")
    )
    top = []
    for length, gap_start, gap_end in sorted(gaps, reverse=True)[:longest]:
        names = [n for t, n in host if gap_start <= t < gap_end]
        top.append({"idle_us": length, "host_ops": list(dict.fromkeys(names))[:8]})
    span = kernels[-1][1] - kernels[0][0]
    return {
        "span_ms": span / 1e3,
        "device_busy_ms": busy / 1e3,
        "device_idle_ms": (span - busy) / 1e3,
        "idle_gaps_over_100us": sum(1 for g in gaps if g[0] > 100),
        "idle_ms_in_gaps_over_100us": sum(g[0] for g in gaps if g[0] > 100) / 1e3,
        "longest_idle_gaps": top,
    }


def profile_next_call(owner, attr: str, path: Path, write: bool) -> None:
    """Profile the next call of `owner.attr` (to `path`), then put the method back."""
    original = getattr(owner, attr)

    def once(*args, **kwargs):
        setattr(owner, attr, original)
        return profiled(lambda: original(*args, **kwargs), path, write)

    setattr(owner, attr, once)


def profile_step(trainer, run, out_dir: Path) -> str:
    """One more step under torch.profiler; the top ops by device and host time, to a file."""
    path = out_dir / f"trainer_profile_{trainer.config.algorithm.adv_estimator}.txt"
    profiled(trainer.train_step, path, run.env.rank == 0)
    trainer.step += 1
    return str(path)
