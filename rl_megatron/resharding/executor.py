"""Run a resharding plan: bucketed point-to-point transfers, written into the target.

    stats = sync_weights(actor_chunks, target, info=info, training=layout, version=step,
                         bucket_mb=config.rollout.weight_sync_bucket_mb)

Every rank of the world calls `sync_weights` (SPMD). Before anything is written, the ranks
agree on the plan's inputs (vocabulary padding, dtype) and check the trainer's parameters
and the target's against the plan's shard specs; any mismatch raises on every rank, with
the first rank's reason, and leaves the engine untouched. Then, round by round:

* local moves copy rows of the rank's own training shard into its generation parameter;
* each rank packs the rows it sends to one peer into one buffer, and receives one buffer
  from each peer it hears from (`batch_isend_irecv`): only ranks that exchange data talk,
  and when t_g == t and p == 1 (and the vocabulary is split alike) nobody does;
* received rows are copied into the target's storage.

The plan caps each round's send + receive buffers per rank at one bucket; they are slices
of one arena allocated per sync, so the executor's extra memory is at most `bucket_mb`
(`StagingTracker.peak_bytes`; CPU has no allocator statistics, so the multi-rank test
checks it independently with torch.profiler's memory events). Targets that cannot be
written in place (vLLM's CPU build) add their own buffers, reported separately.

Failures: every check that can fail before the first byte moves (plan inputs, shapes,
configs, the engine accepting the update) is agreed on by all ranks, which then raise
together (`agreement.py`). A rank failing in the middle of the transfer marks its engine
failed (it refuses to generate) and raises; its peers wait in their transfers until the
process group's timeout, as with any collective.

Fixed cost. Until the first copy is issued the device idles, so host work per sync adds
to every sync whatever its size. A repeated sync keeps what did not change and checks,
per tensor, only that it did not: the actor's name → parameter table is kept while each
parameter is the same object (`actor_sources`); the agreement and the checks take one
all-reduce, the engine's acceptance one more (none on one rank); the copies from the
rank's own shards stay bound to views of their tensors while those keep their address,
shape, strides, dtype and device (per target: a new target, or tensors reallocated
between syncs, bind afresh); and the multi-tensor copy of whole tensors is issued before
the strided ones, so the device has work while the host issues the rest.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.hf_loader import iter_rule_params, unwrap
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.agreement import MIB as MIB  # the bucket unit, for callers
from rl_megatron.resharding.agreement import CheckedTarget, prepare_plan, raise_together
from rl_megatron.resharding.copy_program import (
    Bound,
    CopyProgram,
    Tensors,
    bind,
    compile_program,
    issue,
    run_ops,
)
from rl_megatron.resharding.layouts import TrainingLayout
from rl_megatron.resharding.plan import Fill, ReshardPlan


class WriteTarget(Protocol):
    """Where generation shards are written (see `targets.ReshardTarget`)."""

    def writable(self, name: str) -> torch.Tensor:
        """The storage of generation parameter `name` (this rank's shard) to write into."""
        ...

    def param_done(self, name: str) -> None:
        """Every row of `name` has been written."""
        ...


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
    device_peak_extra_bytes: int | None = None  # CUDA allocator peak − start (GPU only)
    wall_s: float = 0.0  # execute_plan, host time (on GPUs it does not wait for the copies)
    prepare_s: float = 0.0  # sync_weights' host time: sources, agreement and checks
    begin_s: float = 0.0  # the target's begin and the ranks' agreement on it
    finish_s: float = 0.0  # the target's finish

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------- sources


def megatron_sources(model_chunks: Sequence[torch.nn.Module], info: HFModelInfo) -> dict:
    """This rank's training parameters by dist-checkpoint name (global layer numbers)."""
    from rl_megatron.checkpoint import hf_mapping as hm

    rules = hm.rules_for(info, "lm")
    out: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        for rule, layer, param in iter_rule_params(unwrap(chunk), rules):
            out[rule.megatron.format(layer=layer)] = param
    return out


# Unwrapped chunk → (info, its sources, [(module ref, leaf, parameter)]). Walking a
# Megatron chunk's modules and mapping their names takes ~1 ms on a 16-layer model; a
# check by identity, ~0.3 µs a parameter, shows the table still holds.
_SOURCE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def actor_sources(model_chunks: Sequence[torch.nn.Module], info: HFModelInfo) -> dict:
    """`megatron_sources`, kept per chunk while each parameter is its module's same object.

    Parameters replaced since the last call (`module.weight = ...`, `load_state_dict(...,
    assign=True)`) or modules freed rebuild a chunk's table; in-place changes (training,
    offload and reload of storages) keep it. A module *added* to a chunk after its first
    sync is not seen: build a new chunk instead. Treat the result as read-only.
    """
    out: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        table = _SOURCE_TABLES.get(model)
        if table is None or table[0] != info or not _still_owned(table[2]):
            table = (info, megatron_sources([model], info), _owners(model))
            _SOURCE_TABLES[model] = table
        out.update(table[1])
    return out


def _owners(model: torch.nn.Module) -> list[tuple[weakref.ref, str, torch.nn.Parameter]]:
    return [
        (weakref.ref(module), leaf, param)
        for module in model.modules()
        for leaf, param in module._parameters.items()
        if param is not None
    ]


def _still_owned(owners: list[tuple[weakref.ref, str, torch.nn.Parameter]]) -> bool:
    for ref, leaf, param in owners:
        module = ref()
        if module is None or module._parameters.get(leaf) is not param:
            return False
    return True


# ---------------------------------------------------------------------- execute


def _rows(t: torch.Tensor, dim: int, offset: int, rows: int) -> torch.Tensor:
    return t.narrow(dim, offset, rows)


class _Copies:
    """Row-block copies and zero fills, issued together as multi-tensor kernels."""

    def __init__(self) -> None:
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst.append(dst)
        self.src.append(src)

    def zero(self, dst: torch.Tensor) -> None:
        self.zeros.append(dst)

    def flush(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
        if self.zeros:
            torch._foreach_zero_(self.zeros)
        self.dst, self.src, self.zeros = [], [], []


# (id(plan), local rank) -> (plan, its program): plans are cached by `build_plan`, so the
# same object comes back on every sync; holding it keeps its id from being reused.
_PROGRAMS: dict[tuple[int, int], tuple[ReshardPlan, CopyProgram]] = {}


def _program(plan: ReshardPlan, local: int) -> CopyProgram:
    cached = _PROGRAMS.get((id(plan), local))
    if cached is None or cached[0] is not plan:
        if len(_PROGRAMS) >= 64:
            _PROGRAMS.clear()
        cached = (plan, compile_program(plan, local))
        _PROGRAMS[(id(plan), local)] = cached
    return cached[1]


# Target → {id(program): (program, geometry of its bases, bound `local` ops per round)}.
# Keyed by the target, so the views (which keep their tensors' storage alive) go with it.
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _geometry(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def _bound_local(program: CopyProgram, tensors: Tensors, target: WriteTarget) -> list[Bound]:
    """Each round's `local` ops bound to this sync's tensors: the last sync's views when
    every tensor they view is where and what it was (engines may reallocate weights on
    wake, trainers reload offloaded ones elsewhere)."""
    geometry = [_geometry(tensors.full(ref)) for ref in program.bases]
    by_program = _BOUND.setdefault(target, {})
    cached = by_program.get(id(program))
    if cached is not None and cached[0] is program and cached[1] == geometry:
        return cached[2]
    bound = [bind(r.local, tensors) for r in program.rounds]
    if len(by_program) >= 8:
        by_program.clear()
    by_program[id(program)] = (program, geometry, bound)
    return bound


def _copy_local_by_block(rnd, sources, target, arena, remaining: dict[str, int]) -> None:
    """A round's local writes and send packing, each parameter reported when complete."""
    copies = _Copies()
    for w in rnd.writes:
        dst = _rows(target.writable(w.dst_param), w.dim, w.dst_offset, w.rows)
        if isinstance(w, Fill):
            copies.zero(dst)
        else:
            copies.copy(dst, _rows(sources[w.src_param], w.dim, w.src_offset, w.rows))
        _wrote(w.dst_param, copies, target, remaining)
    pos = 0
    for moves in rnd.sends.values():
        for m in moves:
            src = _rows(sources[m.src_param], m.dim, m.src_offset, m.rows)
            copies.copy(arena[pos : pos + m.numel].view(src.shape), src)
            pos += m.numel
    copies.flush()  # send buffers must be packed before they are posted


def _unpack_by_block(rnd, prog, target, arena, remaining: dict[str, int]) -> None:
    copies = _Copies()
    for (_, start, _), moves in zip(prog.recvs, rnd.recvs.values()):
        pos = start
        for m in moves:
            dst = _rows(target.writable(m.dst_param), m.dim, m.dst_offset, m.rows)
            copies.copy(dst, arena[pos : pos + m.numel].view(dst.shape))
            pos += m.numel
            _wrote(m.dst_param, copies, target, remaining)
    copies.flush()  # the arena is reused by the next round


def _wrote(name: str, copies: _Copies, target, remaining: dict[str, int]) -> None:
    remaining[name] -= 1
    if not remaining[name]:
        copies.flush()
        target.param_done(name)


@torch.no_grad()
def execute_plan(
    plan: ReshardPlan,
    rank: int,
    sources: Mapping[str, torch.Tensor],
    target: WriteTarget,
    *,
    group: dist.ProcessGroup | None = None,
    tracker: StagingTracker | None = None,
) -> SyncStats:
    """Run `plan` on global `rank` (collective over the rank's training replica).

    Args:
        sources: this rank's training shards by name (`megatron_sources`).
        target: where this rank's generation shards go.
        group: process group for the point-to-point transfers (ranks are global ranks).
        tracker: counts live transfer buffers (a fresh one by default).
    """
    tracker = tracker or StagingTracker()
    local = plan.local_rank(rank)
    elem = plan.key.elem_size
    dtype = next(iter(sources.values())).dtype if sources else torch.float32
    device = next(iter(sources.values())).device if sources else torch.device("cpu")
    stats = SyncStats(rank=rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start_alloc = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    program = _program(plan, local)
    # One arena for the whole sync, sized to this rank's fullest round (≤ one bucket):
    # every round's send and receive buffers are slices of it, so the extra memory is
    # one allocation, whatever the number of rounds.
    numel = program.arena_numel
    arena = tracker.alloc(numel, dtype, device) if numel else None
    # Targets that buffer each parameter until it is complete (vLLM's CPU build) hear of
    # a parameter as soon as its last rows land, so few buffers are alive at once: they
    # take the block-by-block path. In-place targets run the compiled program.
    by_block = getattr(target, "buffers_params", False)
    remaining = dict(plan.writes[local]) if by_block else {}
    tensors = Tensors(sources, target.writable, arena)
    bound = [None] * len(program.rounds) if by_block else _bound_local(program, tensors, target)
    for rnd, prog, local_ops in zip(plan.rounds[local], program.rounds, bound):
        stats.rounds += 1
        stats.bytes_local += prog.local_numel * elem
        stats.bytes_filled += prog.filled_numel * elem
        if by_block:
            _copy_local_by_block(rnd, sources, target, arena, remaining)
        else:
            issue(local_ops)
            run_ops(prog.pack, tensors)  # send buffers are packed before they are posted
        ops = []
        for peer, start, n in prog.sends:
            ops.append(dist.P2POp(dist.isend, arena[start : start + n],
                                  plan.global_rank(peer, rank), group))  # fmt: skip
            stats.bytes_sent += n * arena.element_size()
            stats.messages_sent += 1
        for peer, start, n in prog.recvs:
            ops.append(dist.P2POp(dist.irecv, arena[start : start + n],
                                  plan.global_rank(peer, rank), group))  # fmt: skip
            stats.bytes_received += n * arena.element_size()
            stats.messages_received += 1
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if by_block:
            _unpack_by_block(rnd, prog, target, arena, remaining)
        else:
            run_ops(prog.unpack, tensors)  # the arena is reused by the next round
            for name in prog.completed:  # all of them, over the rounds (`compile_program`)
                target.param_done(name)
    if any(remaining.values()):
        raise AssertionError(f"rank {rank}: plan left parameters unfinished")
    if arena is not None:
        tracker.free(arena)
        del arena, tensors
    stats.wall_s = time.perf_counter() - t0
    stats.peak_staging_bytes = tracker.peak_bytes
    if cuda:
        stats.device_peak_extra_bytes = torch.cuda.max_memory_allocated(device) - start_alloc
    return stats


# ------------------------------------------------------------------------- sync


class SyncTarget(WriteTarget, CheckedTarget, Protocol):
    """The part of `targets.ReshardTarget` that `sync_weights` drives."""

    def begin(self, version: int) -> None: ...

    def finish(self) -> None: ...

    def abort(self, why: str) -> None: ...

    def staging_peak_bytes(self) -> int: ...


def sync_weights(
    model_chunks: Sequence[torch.nn.Module],
    target: SyncTarget,
    *,
    info: HFModelInfo,
    training: TrainingLayout,
    version: int,
    bucket_mb: float,
    group: dist.ProcessGroup | None = None,
) -> SyncStats:
    """Reshard the actor's weights into `target` as training step `version` (collective).

    Args:
        model_chunks: this rank's actor chunks (one per virtual stage; wrappers allowed).
        target: the engine adapter (`targets.py`), built on every rank.
        info: the model's HF facts (the trainer's; checked against the engine's).
        training: the training layout (t, p, d, vpp) of `model_chunks`.
        version: training step of these weights; recorded by the engine.
        bucket_mb: `rollout.weight_sync_bucket_mb`, the per-rank cap on transfer buffers.
        group: the whole world's process group (None: the default group); transfers
            name global ranks.
    Returns:
        this rank's `SyncStats` (`prepare_s`, `begin_s`, `wall_s`, `finish_s`: host time
        of each phase).
    """
    rank = dist.get_rank()
    t0 = time.perf_counter()
    sources = actor_sources(model_chunks, info)
    plan = prepare_plan(
        sources, target, info=info, training=training, bucket_mb=bucket_mb, group=group
    )
    t1 = time.perf_counter()
    begin_failed = []
    try:
        target.begin(version)
    except (RuntimeError, ValueError) as exc:  # asleep, older version, ...
        begin_failed.append(f"the engine refused the update: {exc}")
    try:
        raise_together(begin_failed, rank, group)
    except ValueError:
        if not begin_failed:
            target.abort("another rank's engine refused the update")
        raise
    t2 = time.perf_counter()
    try:
        stats = execute_plan(plan, rank, sources, target, group=group)
    except BaseException as exc:
        target.abort(f"transfer failed: {exc}")
        raise
    t3 = time.perf_counter()
    target.finish()
    stats.prepare_s, stats.begin_s, stats.finish_s = t1 - t0, t2 - t1, time.perf_counter() - t3
    stats.target_staging_bytes = target.staging_peak_bytes()
    return stats
