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
together. A rank failing in the middle of the transfer marks its engine failed (it
refuses to generate) and raises; its peers wait in their transfers until the process
group's timeout, as with any collective.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.hf_loader import iter_rule_params, unwrap
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.copy_program import CopyProgram, Tensors, compile_program, run_ops
from rl_megatron.resharding.layouts import GenerationLayout, TrainingLayout
from rl_megatron.resharding.plan import Fill, PlanKey, ReshardPlan, build_plan
from rl_megatron.resharding.shards import ShardSpec

MIB = 1 << 20


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
    wall_s: float = 0.0

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


def check_tensors(specs: Sequence[ShardSpec], tensors: Mapping[str, Any], what: str) -> list[str]:
    """Problems (one line each) if `tensors` (name → tensor or shape) do not match `specs`."""
    problems = []
    want = {s.name: s.shape for s in specs}
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"{what} lacks parameter '{name}' (plan shape {list(shape)})")
            continue
        have = tuple(getattr(tensors[name], "shape", tensors[name]))
        if have != tuple(shape):
            problems.append(f"{what} '{name}' has shape {list(have)}, the plan {list(shape)}")
    problems += [
        f"{what} parameter '{name}' is not in the plan" for name in tensors if name not in want
    ]
    return problems


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
    # One arena for the whole sync, sized to this rank's fullest round (≤ one bucket):
    # every round's send and receive buffers are slices of it, so the extra memory is
    # one allocation, whatever the number of rounds.
    arena_numel = max((r.staging_numel() for r in plan.rounds[local]), default=0)
    arena = tracker.alloc(arena_numel, dtype, device) if arena_numel else None
    program = _program(plan, local)
    # Targets that buffer each parameter until it is complete (vLLM's CPU build) hear of
    # a parameter as soon as its last rows land, so few buffers are alive at once: they
    # take the block-by-block path. In-place targets run the compiled program.
    by_block = getattr(target, "buffers_params", False)
    remaining = dict(plan.writes[local])
    tensors = Tensors(sources, target.writable, arena)
    for rnd, prog in zip(plan.rounds[local], program.rounds):
        stats.rounds += 1
        stats.bytes_local += prog.local_numel * elem
        stats.bytes_filled += prog.filled_numel * elem
        if by_block:
            _copy_local_by_block(rnd, sources, target, arena, remaining)
        else:
            run_ops(prog.local, tensors)  # send buffers are packed before they are posted
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
            for name in prog.completed:
                target.param_done(name)
                remaining[name] = 0
    if any(remaining.values()):
        raise AssertionError(f"rank {rank}: plan left parameters unfinished")
    if arena is not None:
        tracker.free(arena)
        del arena
    stats.wall_s = time.perf_counter() - t0
    stats.peak_staging_bytes = tracker.peak_bytes
    if cuda:
        stats.device_peak_extra_bytes = torch.cuda.max_memory_allocated(device) - start_alloc
    return stats


# ------------------------------------------------------------------------- sync


class SyncTarget(WriteTarget, Protocol):
    """The part of `targets.ReshardTarget` that `sync_weights` drives."""

    kind: str
    layout: GenerationLayout

    def padded_vocab(self) -> int: ...

    def check(self, specs: Sequence[ShardSpec], info: HFModelInfo) -> list[str]: ...

    def begin(self, version: int) -> None: ...

    def finish(self) -> None: ...

    def abort(self, why: str) -> None: ...

    def staging_peak_bytes(self) -> int: ...


def _padded_vocab_of(sources: Mapping[str, torch.Tensor], tp: int) -> int:
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in sources:
            return sources[name].shape[0] * tp
    return 0


def _reduce(values: list[int], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[int]:
    """Element-wise `op` (MAX / MIN) of small integers over the group."""
    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op, group=group)
    return t.cpu().tolist()


def _raise_together(problems: list[str], rank: int, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank found a problem; each names its own or the first."""
    failing = _reduce([1 if problems else 0], dist.ReduceOp.MAX, group)[0]
    if not failing:
        return
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"weight sync refused on rank {rank}: {problems[0]}{more}")
    raise ValueError("weight sync refused: another rank found a mismatch (see its error)")


def prepare_plan(
    sources: Mapping[str, torch.Tensor],
    target: SyncTarget,
    *,
    info: HFModelInfo,
    training: TrainingLayout,
    bucket_mb: float,
    group: dist.ProcessGroup | None = None,
) -> ReshardPlan:
    """Agree on the plan's inputs, build (or fetch) it, and check both sides against it.

    Collective over `group`; raises on every rank, before anything is written, when the
    trainer's parameters, the target's parameters or the configs disagree with the plan.
    """
    rank = dist.get_rank()
    dtypes = {t.dtype for t in sources.values()}
    problems = []
    if len(dtypes) > 1:
        problems.append(f"training parameters mix dtypes {sorted(map(str, dtypes))}")
    elem = next(iter(sources.values())).element_size() if sources else 0
    mine = [_padded_vocab_of(sources, training.tp), target.padded_vocab(), elem]
    high = _reduce(mine, dist.ReduceOp.MAX, group)
    low = _reduce(mine, dist.ReduceOp.MIN, group)
    # Middle pipeline stages hold no vocabulary (0); everyone else must agree.
    if mine[0] and mine[0] != high[0]:
        problems.append(f"training padded vocabulary {mine[0]} != another rank's {high[0]}")
    if low[1] != high[1]:
        problems.append(f"engine padded vocabularies differ across ranks ({low[1]}…{high[1]})")
    if elem and elem != high[2]:
        problems.append(f"training dtype has {elem}-byte elements, another rank {high[2]}")
    key = PlanKey(
        info=info,
        training=training,
        generation=target.layout,
        target=target.kind,
        training_padded_vocab=high[0],
        generation_padded_vocab=high[1],
        bucket_bytes=int(bucket_mb * MIB),
        elem_size=high[2],
    )
    plan = None
    if not problems:
        try:
            plan = build_plan(key)
        except ValueError as exc:
            problems.append(str(exc))
    if plan is not None:
        local = plan.local_rank(rank)
        problems += check_tensors(plan.sources[local], sources, "trainer")
        problems += target.check(plan.targets[local], info)
    _raise_together(problems, rank, group)
    assert plan is not None
    return plan


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
        this rank's `SyncStats`.
    """
    sources = megatron_sources(model_chunks, info)
    plan = prepare_plan(
        sources, target, info=info, training=training, bucket_mb=bucket_mb, group=group
    )
    begin_failed = []
    try:
        target.begin(version)
    except (RuntimeError, ValueError) as exc:  # asleep, older version, ...
        begin_failed.append(f"the engine refused the update: {exc}")
    try:
        _raise_together(begin_failed, dist.get_rank(), group)
    except ValueError:
        if not begin_failed:
            target.abort("another rank's engine refused the update")
        raise
    try:
        stats = execute_plan(plan, dist.get_rank(), sources, target, group=group)
    except BaseException as exc:
        target.abort(f"transfer failed: {exc}")
        raise
    target.finish()
    stats.target_staging_bytes = target.staging_peak_bytes()
    return stats
