"""Run a rank's compiled copy program: bucketed point-to-point transfers, written into the target.

    stats = execute(plan, program, rank, sources, target, views=views, group=group)

Called by `WeightSync.sync` (`weight_sync.py`) once the ranks have agreed on the plan and
the engine has begun its update; every rank of the world runs its own program (SPMD).
Round by round:

* local steps copy rows of the rank's own training shard into its generation parameter;
* the rank packs the rows it sends to one peer into one buffer, and receives one buffer
  from each peer it hears from (`batch_isend_irecv`): only ranks that exchange data talk,
  and when t_g == t and p == 1 (and the vocabulary is split alike) nobody does;
* received rows are copied into the target's storage.

After each step the target hears which parameters it completed (`param_done`): once per
round for in-place targets, as soon as each parameter's last rows land for targets that
buffer parameters (their program is compiled `per_param`). There is one path for both.

The plan caps each round's send + receive buffers per rank at one bucket; they are slices
of one arena allocated per sync, so the executor's extra memory is at most `bucket_mb`
(`StagingTracker.peak_bytes`; CPU has no allocator statistics, so the multi-rank test
checks it independently with torch.profiler's memory events). Targets that cannot be
written in place (vLLM's CPU build) add their own buffers, reported separately.

A rank failing in the middle of the transfer raises (the weight sync then marks its engine
failed, so it refuses to generate); its peers wait in their transfers until the process
group's timeout, as with any collective.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.resharding.copy_program import CopyProgram, KeptViews, Tensors, bind, issue
from rl_megatron.resharding.plan import ReshardPlan
from rl_megatron.resharding.targets import ReshardTarget
from rl_megatron.resharding.tensor_facts import TensorFacts

# A round's messages: (buffer, peer rank) to send, then to receive into; posts and waits.
Transport = Callable[[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]], None]


def _batch_p2p(sends, recvs, *, group: dist.ProcessGroup | None) -> None:
    ops = [dist.P2POp(dist.isend, buffer, peer, group) for buffer, peer in sends]
    ops += [dist.P2POp(dist.irecv, buffer, peer, group) for buffer, peer in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


class StagingTracker:
    """Bytes of the executor's live transfer buffers, and their peak (CPU-measurable)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype, device=device)
        self.live_bytes += buf.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return buf

    def free(self, buf: torch.Tensor) -> None:
        self.live_bytes -= buf.nbytes


@dataclasses.dataclass
class SyncStats:
    """What one rank moved in one sync (bytes are payload, in the transfer dtype)."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0  # copied from the rank's own training shard
    bytes_filled: int = 0  # zero padding written
    messages_sent: int = 0
    messages_received: int = 0
    rounds: int = 0  # rounds this rank took part in
    peak_staging_bytes: int = 0  # executor buffers (≤ bucket by construction)
    target_staging_bytes: int = 0  # the target's own buffers (vLLM CPU reload path)
    lora_merged_bytes: int = 0  # a LoRA actor's merged weights, made for the sync (lora_merge)
    # CUDA allocator peak − start (GPU, and only when asked: `execute(measure_peak=True)`)
    device_peak_extra_bytes: int | None = None
    wall_s: float = 0.0  # `execute`, host time (on GPUs it does not wait for the copies)
    prepare_s: float = 0.0  # the sync's host time before: sources, agreement and checks
    begin_s: float = 0.0  # the target's begin and the ranks' agreement on it
    finish_s: float = 0.0  # the target's finish
    copies_replayed: bool = False  # the local copies were one CUDA graph replay a step
    verify: Any = None  # `verify.VerifyStats` when this sync was verified (rollout.verify_sync)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@torch.no_grad()
def execute(
    plan: ReshardPlan,
    program: CopyProgram,
    rank: int,
    sources: Mapping[str, torch.Tensor],
    target: ReshardTarget,
    *,
    views: KeptViews | None = None,
    source_facts: TensorFacts | None = None,
    group: dist.ProcessGroup | None = None,
    tracker: StagingTracker | None = None,
    measure_peak: bool = False,
    peers: Sequence[int] | None = None,
    transport: Transport | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> SyncStats:
    """Run `program` (this rank's part of `plan`) on global `rank` (collective over the
    rank's training replica).

    Args:
        sources: this rank's training shards by name (`sources.py`).
        target: where this rank's generation shards go.
        views: the `local` steps kept bound between syncs (None: bind them now, as for a
            per-parameter program, whose targets hand out new buffers every sync).
        source_facts: `TensorFacts.of(sources)` if already read this sync (None: read here).
        group: process group for the point-to-point transfers (ranks are global ranks).
        tracker: counts live transfer buffers (a fresh one by default).
        measure_peak: on a GPU, record the CUDA allocator's peak above the start
            (`device_peak_extra_bytes`). Off by default: it resets the allocator's peak,
            which the trainer's phase figures read, and its two reads of the allocator's
            statistics (`torch.cuda.memory_stats`, a dict of ~160 entries built in
            Python) took ~0.3 ms of the 0.85B sync's host time on an H200 (benchmarks/runs/2026-12-02-h200-run13-sync-after-graphs.md).
        peers: each local rank's rank in `group` (None: the plan's own numbering,
            `ReshardPlan.global_rank`); split placement's plan spans two sides
            (`plan.build_remote_plan`).
        transport: posts a round's sends and receives, (buffer, rank) each, and waits for
            them (None: `dist.batch_isend_irecv` over `group`; split placement's bridge is
            a process group of its own, `placement.SplitWorld.exchange`).
        dtype, device: of the transfer buffers, for a rank without sources (a generation
            rank of split placement); otherwise the sources'.
    """
    tracker = tracker or StagingTracker()
    elem = plan.key.elem_size
    first = next(iter(sources.values()), None)
    dtype = dtype or (first.dtype if first is not None else torch.float32)
    device = device or (first.device if first is not None else torch.device("cpu"))

    def peer_rank(local: int) -> int:
        return plan.global_rank(local, rank) if peers is None else peers[local]

    stats = SyncStats(rank=rank)
    peak = measure_peak and device.type == "cuda"
    if peak:
        torch.cuda.reset_peak_memory_stats(device)
        start_alloc = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    # One arena for the whole sync, sized to this rank's fullest round (≤ one bucket):
    # every round's send and receive buffers are slices of it, so the extra memory is
    # one allocation, whatever the number of rounds.
    numel = program.arena_numel
    arena = tracker.alloc(numel, dtype, device) if numel else None
    tensors = Tensors(sources, target.writable, arena)
    kept = None
    if views is not None:
        facts = source_facts if source_facts is not None else TensorFacts.of(sources)
        kept = views.local(program, tensors, facts)
    stats.copies_replayed = views is not None and views.captured
    for i, prog in enumerate(program.rounds):
        stats.rounds += 1
        stats.bytes_local += prog.local_numel * elem
        stats.bytes_filled += prog.filled_numel * elem
        for k, step in enumerate(prog.local):
            if kept is not None:
                kept[i][k]()
            else:
                issue(bind(step.ops, tensors))
            for name in step.completed:
                target.param_done(name)
        issue(bind(prog.pack, tensors))  # send buffers are packed before they are posted
        sends = [(arena[start : start + n], peer_rank(peer)) for peer, start, n in prog.sends]
        recvs = [(arena[start : start + n], peer_rank(peer)) for peer, start, n in prog.recvs]
        stats.bytes_sent += sum(b.numel() for b, _ in sends) * elem
        stats.bytes_received += sum(b.numel() for b, _ in recvs) * elem
        stats.messages_sent += len(sends)
        stats.messages_received += len(recvs)
        if sends or recvs:
            (transport or functools.partial(_batch_p2p, group=group))(sends, recvs)
        for step in prog.unpack:  # before the next round reuses the arena
            issue(bind(step.ops, tensors))
            for name in step.completed:
                target.param_done(name)
    if arena is not None:
        tracker.free(arena)
        del arena, tensors
    stats.wall_s = time.perf_counter() - t0
    stats.peak_staging_bytes = tracker.peak_bytes
    if peak:
        stats.device_peak_extra_bytes = torch.cuda.max_memory_allocated(device) - start_alloc
    return stats
