"""A rank's part of a resharding plan, compiled once into few strided copies per round.

A 7B sync moves ~3k row blocks per rank (the q, k and v rows of every query group of
every layer, which Megatron interleaves per group and vLLM keeps in three runs). Issuing
them one by one from Python made the sync host-bound: ~31 of its 39 ms on an H200 went
to the per-block loop. The blocks of a round only depend on the plan, so they are turned,
once per plan and rank, into a `CopyProgram`:

* tensors are named by role, not held: a training shard (`src`), a generation parameter
  (`dst`) or the sync's transfer arena, so the program outlives the tensors of one sync
  (the arena is allocated per sync; the engine may reallocate its parameters);
* blocks along dim 0 of contiguous tensors are flat element ranges, and so are blocks
  along another dim that span their tensor (or a stacked tensor's slot) whole, as
  row-parallel weights and vLLM's `w2_weight` experts do at t = t_g. Flat blocks between
  the same two tensors, of one size, whose offsets step evenly on both sides (every
  group's q rows of a layer, say) become one strided copy (`Run`), or on CUDA, once bound
  and kept, one contiguous view per block in the multi-tensor copy (`KeptViews`); single
  blocks from any tensors that fill one destination range end to end (a stacked
  tensor's experts) become one concatenation (`Concat`, one `torch.cat`);
* blocks along another dim that split it (row-parallel weights split by columns) stay
  single narrow-to-narrow copies (`Block`), a few per layer; into a parameter stacking
  experts a block first selects its slot (`shards.rows_view`). Along dim 0 a stacked
  parameter is a plain contiguous run of rows, so its blocks are flat ranges too.

A round's ops come in three parts: `local` (zero fills and copies from training shards
into generation parameters), `pack` (send rows into the arena) and `unpack` (received rows
out of it). Destinations within a round are disjoint, so copies may run in any order.
`local` and `unpack` are lists of `Step`s, each naming the generation parameters whose
last rows it writes (the per-parameter countdown happens here, once, at compile time). By
default a round has one step per part, so a round is a few multi-tensor copies; compiled
`per_param` (for targets that buffer each parameter until it is complete, vLLM's CPU
build) a step ends where a parameter completes, so the target hears of it as soon as its
rows land and few buffers are alive at once.

Running is two steps: `bind` resolves ops to views of one sync's tensors (a `Bound`:
the lists for one multi-tensor copy, the strided copies, the zero fills), `issue` launches
them. `KeptViews` keeps the bound `local` steps across syncs while the tensors they view
are unchanged (`CopyProgram.bases`), so a repeated sync issues its copies with almost no
Python, and on CUDA replays them as one captured graph a step (`graph_of`); `pack` and
`unpack` view the arena, which is allocated per sync, and are bound on every sync (as are
the steps of a per-parameter program, whose buffers are new each sync).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Iterator, Sequence

import torch

from rl_megatron.resharding.plan import Fill, Move, RankRound, ReshardPlan
from rl_megatron.resharding.shards import ShardSpec, rows_view
from rl_megatron.resharding.tensor_facts import TensorFacts, placement_of

SRC, DST, ARENA = "src", "dst", "arena"
Ref = tuple[str, str]  # (SRC | DST | ARENA, parameter name; "" for the arena)


@dataclasses.dataclass(frozen=True)
class Run:
    """`count` blocks of `numel` elements: flat dst[d0 + i·d_step] ← src[s0 + i·s_step]."""

    dst: Ref
    dst_start: int
    dst_step: int
    src: Ref
    src_start: int
    src_step: int
    count: int
    numel: int


@dataclasses.dataclass(frozen=True)
class Concat:
    """Flat dst[d0 : d0 + numel] ← `pieces` end to end, each `(src, start, numel)`."""

    dst: Ref
    dst_start: int
    pieces: tuple[tuple[Ref, int, int], ...]
    numel: int


@dataclasses.dataclass(frozen=True)
class Block:
    """Rows `[offset, +rows)` along `dim`; an arena side is a flat range of the same size."""

    dst: Ref
    dst_offset: int
    src: Ref
    src_offset: int
    dim: int
    rows: int
    dst_slot_rows: int = 0  # a stacked destination: rows per slot (`shards.rows_view`)


@dataclasses.dataclass(frozen=True)
class Zero:
    dst: Ref
    dim: int
    offset: int
    rows: int


Op = Run | Concat | Block | Zero
FlatBlock = tuple[Ref, int, Ref, int, int]  # (dst, d_start, src, s_start, numel)


@dataclasses.dataclass
class Step:
    """Ops issued together, then `completed` reported to the target."""

    ops: list[Op]
    completed: list[str]  # generation parameters whose last rows these ops write


@dataclasses.dataclass
class RoundProgram:
    local: list[Step]  # zero fills and copies from the rank's training shards
    pack: list[Run | Concat | Block]  # send rows into the arena
    unpack: list[Step]  # received rows into the generation parameters
    sends: list[tuple[int, int, int]]  # (peer, arena start, numel)
    recvs: list[tuple[int, int, int]]
    local_numel: int  # elements copied from the rank's own training shards
    filled_numel: int  # zero padding elements written


@dataclasses.dataclass
class CopyProgram:
    rounds: list[RoundProgram]
    arena_numel: int  # the fullest round's send + receive elements (≤ one bucket)
    bases: list[Ref]  # the tensors the rounds' `local` ops view
    per_param: bool  # a step ends where a parameter completes (see the module docstring)


# ------------------------------------------------------------------------- compile


def compile_program(plan: ReshardPlan, local: int, *, per_param: bool = False) -> CopyProgram:
    """The copy program of local rank `local` (pure: plan in, program out).

    per_param: end a step wherever a generation parameter completes (targets that buffer
        parameters); otherwise each round's `local` and `unpack` are one step each.
    """
    remaining = dict(plan.writes[local])
    whole = _Whole(plan.sources[local], plan.targets[local])
    rounds = []
    for rnd in plan.rounds[local]:
        rounds.append(_compile_round(rnd, remaining, per_param, whole))
    if any(remaining.values()):
        raise AssertionError(f"local rank {local}: plan leaves parameters unfinished")
    arena_numel = max((r.staging_numel() for r in plan.rounds[local]), default=0)
    bases = {ref for r in rounds for step in r.local for op in step.ops for ref in _refs(op)}
    return CopyProgram(rounds, arena_numel, sorted(bases), per_param)


def _refs(op: Op) -> tuple[Ref, ...]:
    if isinstance(op, Zero):
        return (op.dst,)
    if isinstance(op, Concat):
        return (op.dst, *(src for src, _, _ in op.pieces))
    return (op.dst, op.src)


class _Steps:
    """Collects one part's ops and cuts it into steps where parameters complete."""

    def __init__(self, remaining: dict[str, int], per_param: bool) -> None:
        self.remaining, self.per_param = remaining, per_param
        self.steps: list[Step] = []
        self.ops: list[Op] = []
        self.flat: list[FlatBlock] = []
        self.completed: list[str] = []

    def wrote(self, name: str) -> None:
        """One of the plan's writes into `name` is in; cut after its last one (per_param)."""
        self.remaining[name] -= 1
        if not self.remaining[name]:
            self.completed.append(name)
            if self.per_param:
                self.cut()

    def cut(self) -> None:
        if self.ops or self.flat or self.completed:
            self.steps.append(Step(self.ops + coalesce(self.flat), self.completed))
        self.ops, self.flat, self.completed = [], [], []

    def done(self) -> list[Step]:
        self.cut()
        return self.steps


class _Whole:
    """Whether a move along a dim > 0 spans a side whole: its source tensor, or its
    destination tensor (one slot of a stacked one). Then that side's rows are one flat
    range, as along dim 0: at t = t_g the row-parallel weights (and vLLM's `w2_weight`
    experts) move whole, and join the flat copies and concatenations."""

    def __init__(self, sources: Sequence[ShardSpec], targets: Sequence[ShardSpec]) -> None:
        # A stacked tensor's moves count `dim` within one slot (`shards.rows_view`).
        self.src = {s.name: s.shape[1:] if s.stack else s.shape for s in sources}
        self.dst = {s.name: s.shape[1:] if s.stack else s.shape for s in targets}

    def src_side(self, m: Move) -> bool:
        return m.dim == 0 or m.rows == self.src[m.src_param][m.dim]

    def dst_side(self, m: Move) -> bool:
        return m.dim == 0 or m.rows == self.dst[m.dst_param][m.dim]


def _compile_round(
    rnd: RankRound, remaining: dict[str, int], per_param: bool, whole: _Whole
) -> RoundProgram:
    local = _Steps(remaining, per_param)
    for w in rnd.writes:
        if isinstance(w, Fill):
            local.ops.append(Zero((DST, w.dst_param), w.dim, w.dst_offset, w.rows))
        elif whole.src_side(w) and whole.dst_side(w):
            local.flat.append(((DST, w.dst_param), w.dst_offset * w.row_numel,
                               (SRC, w.src_param), w.src_offset * w.row_numel, w.numel))  # fmt: skip
        else:
            local.ops.append(Block((DST, w.dst_param), w.dst_offset, (SRC, w.src_param),
                                   w.src_offset, w.dim, w.rows, w.dst_slot_rows))  # fmt: skip
        local.wrote(w.dst_param)
    flat: list[FlatBlock] = []
    pack: list[Run | Concat | Block] = []
    used, sends, recvs = 0, [], []
    for peer, moves in rnd.sends.items():
        sends.append((peer, used, sum(m.numel for m in moves)))
        for m, pos in _positions(moves, used):
            if whole.src_side(m):
                flat.append(((ARENA, ""), pos, (SRC, m.src_param), m.src_offset * m.row_numel,
                             m.numel))  # fmt: skip
            else:
                pack.append(Block((ARENA, ""), pos, (SRC, m.src_param), m.src_offset,
                                  m.dim, m.rows))  # fmt: skip
        used += sends[-1][2]
    pack += coalesce(flat)
    unpack = _Steps(remaining, per_param)
    for peer, moves in rnd.recvs.items():
        recvs.append((peer, used, sum(m.numel for m in moves)))
        for m, pos in _positions(moves, used):
            if whole.dst_side(m):
                unpack.flat.append(((DST, m.dst_param), m.dst_offset * m.row_numel,
                                    (ARENA, ""), pos, m.numel))  # fmt: skip
            else:
                unpack.ops.append(Block((DST, m.dst_param), m.dst_offset, (ARENA, ""), pos,
                                        m.dim, m.rows, m.dst_slot_rows))  # fmt: skip
            unpack.wrote(m.dst_param)
        used += recvs[-1][2]
    local_numel = sum(w.numel for w in rnd.writes if isinstance(w, Move))
    filled_numel = sum(w.numel for w in rnd.writes if isinstance(w, Fill))
    return RoundProgram(local.done(), pack, unpack.done(), sends, recvs, local_numel, filled_numel)


def _positions(moves: list[Move], start: int) -> Iterator[tuple[Move, int]]:
    """Each move with its element offset in the peer's buffer (moves packed back to back)."""
    pos = start
    for m in moves:
        yield m, pos
        pos += m.numel


def coalesce(blocks: list[tuple[Ref, int, Ref, int, int]]) -> list[Run | Concat]:
    """Flat blocks → runs (same tensors and size, offsets stepping evenly on both sides);
    the blocks left alone that meet end to end in one destination → one `Concat`."""
    groups: dict[tuple[Ref, Ref, int], list[tuple[int, int]]] = {}
    for dst, d_start, src, s_start, numel in blocks:
        groups.setdefault((dst, src, numel), []).append((d_start, s_start))
    runs = []
    for (dst, src, numel), starts in groups.items():
        for (d0, s0), count, d_step, s_step in even_runs(sorted(starts), numel):
            runs.append(Run(dst, d0, d_step, src, s0, s_step, count, numel))
    return concatenated(runs)


def concatenated(runs: list[Run]) -> list[Run | Concat]:
    """Single-block runs that fill one destination's range end to end, from any sources,
    joined into one `Concat` (one `torch.cat` into the range); other runs unchanged.

    An MoE actor without grouped GEMM holds one tensor per expert, and vLLM stacks a
    layer's experts in one tensor: 64 blocks end to end, each from a tensor of its own. As
    one multi-tensor copy they ran at 1.5 TB/s on an H200 (launches of at most 320 blocks
    of 64k elements); a concatenation per stacked tensor runs at a flat copy's 2 TB/s
    (benchmarks/runs/2026-12-02-h200-run12-moe-resharding.md), and is one call where the copies were 64.
    """
    out: list[Run | Concat] = []
    singles: dict[Ref, list[Run]] = {}
    for run in runs:
        if run.count == 1:
            singles.setdefault(run.dst, []).append(run)
        else:
            out.append(run)
    for chain in singles.values():
        chain.sort(key=_DST_START)
        start = 0
        for i in range(1, len(chain) + 1):
            if i == len(chain) or chain[i - 1].dst_start + chain[i - 1].numel != chain[i].dst_start:
                out.append(_joined(chain[start:i]))
                start = i
    return out


_DST_START = operator.attrgetter("dst_start")


def _joined(chain: list[Run]) -> Run | Concat:
    if len(chain) == 1:
        return chain[0]
    pieces = tuple((r.src, r.src_start, r.numel) for r in chain)
    return Concat(chain[0].dst, chain[0].dst_start, pieces, sum(r.numel for r in chain))


def even_runs(starts: list[tuple[int, int]], numel: int):
    """Split sorted `(dst, src)` starts into runs whose offsets step evenly on both sides.

    Yields `((dst0, src0), count, dst_step, src_step)`; a run's destinations never
    overlap (dst_step >= numel) and its steps are positive, as `as_strided` needs.
    """
    i = 0
    while i < len(starts):
        j = i + 1
        if j < len(starts):
            d_step = starts[j][0] - starts[i][0]
            s_step = starts[j][1] - starts[i][1]
            if d_step >= numel and s_step > 0:
                while (
                    j + 1 < len(starts)
                    and starts[j + 1][0] - starts[j][0] == d_step
                    and starts[j + 1][1] - starts[j][1] == s_step
                ):
                    j += 1
                yield starts[i], j - i + 1, d_step, s_step
                i = j + 1
                continue
        yield starts[i], 1, numel, numel
        i += 1


# ----------------------------------------------------------------------------- run


class Tensors:
    """Resolves a program's references to this sync's tensors (flat views cached)."""

    def __init__(self, sources, writable: Callable[[str], torch.Tensor], arena) -> None:
        self.sources, self.writable, self.arena = sources, writable, arena
        self._flat: dict[Ref, torch.Tensor] = {}

    def full(self, ref: Ref) -> torch.Tensor:
        kind, name = ref
        if kind == ARENA:
            return self.arena
        return self.sources[name] if kind == SRC else self.writable(name)

    def flat(self, ref: Ref) -> torch.Tensor:
        if ref not in self._flat:
            t = self.full(ref)
            if not t.is_contiguous():
                raise ValueError(f"resharding: {ref[0]} tensor {ref[1]!r} is not contiguous")
            self._flat[ref] = t.view(-1)
        return self._flat[ref]


@dataclasses.dataclass
class Bound:
    """Ops resolved to views of one sync's tensors, ready to `issue`."""

    dst: list[torch.Tensor]  # flat ranges and blocks: one multi-tensor copy
    src: list[torch.Tensor]
    strided_dst: list[torch.Tensor]  # runs of several blocks: one strided view a side
    strided_src: list[torch.Tensor]
    zeros: list[torch.Tensor]
    concats: list[tuple[torch.Tensor, list[torch.Tensor]]] = dataclasses.field(
        default_factory=list
    )  # (a destination range, the pieces that fill it end to end): one `torch.cat` each
    copies: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=list
    )  # (dst, src) pairs copied one `copy_` each (`large_pairs_apart`)

    def outs(self) -> list[torch.Tensor]:
        """The concatenations' destination ranges."""
        return [out for out, _ in self.concats]


# Under a CUDA graph, a pair at least this large is copied by a `copy_` of its own rather
# than in the multi-tensor copy. On an H200 (benchmarks/runs/2026-12-02-h200-run13-sync-after-graphs.md) the dense
# 0.85B shape's 99 whole tensors replayed at 1.69 TB/s as one `copy_` each against 1.43 TB/s
# as one `_foreach_copy_` (1.01 against 1.19 ms); a `copy_` is a graph node of its own
# (~2.5 µs each: 2 048 expert copies took 5.2 ms), which pays from a few MB on (4 MiB:
# 2.5 µs at 1.7 TB/s), while small pairs (norms, a query group's QKV rows) stay together.
PER_TENSOR_COPY_MIN_BYTES = 4 << 20


def large_pairs_apart(bound: Bound, min_bytes: int = PER_TENSOR_COPY_MIN_BYTES) -> Bound:
    """`bound` with its multi-tensor copy's pairs of at least `min_bytes` moved to
    `copies`, one `copy_` each, for a captured graph (`graph_of`); the rest unchanged."""
    large = [i for i, d in enumerate(bound.dst) if d.numel() * d.element_size() >= min_bytes]
    if not large:
        return bound
    apart = set(large)
    keep = [i for i in range(len(bound.dst)) if i not in apart]
    return dataclasses.replace(
        bound,
        dst=[bound.dst[i] for i in keep],
        src=[bound.src[i] for i in keep],
        copies=bound.copies + [(bound.dst[i], bound.src[i]) for i in large],
    )


def bind(ops: list[Op], tensors: Tensors, *, runs_as_blocks: bool = False) -> Bound:
    """Views of `tensors` for `ops` (no copy is made).

    runs_as_blocks: bind a run of several blocks as one contiguous view per block, all in
        the multi-tensor copy, rather than as one strided view a side (see `KeptViews`).
    """
    bound = Bound([], [], [], [], [])
    for op in ops:
        if isinstance(op, Concat):
            d = tensors.flat(op.dst)
            pieces = [tensors.flat(src)[s0 : s0 + n] for src, s0, n in op.pieces]
            bound.concats.append((d[op.dst_start : op.dst_start + op.numel], pieces))
        elif isinstance(op, Run):
            d, s = tensors.flat(op.dst), tensors.flat(op.src)
            if op.count == 1 or runs_as_blocks:
                for i in range(op.count):
                    d0, s0 = op.dst_start + i * op.dst_step, op.src_start + i * op.src_step
                    bound.dst.append(d[d0 : d0 + op.numel])
                    bound.src.append(s[s0 : s0 + op.numel])
                continue
            shape = (op.count, op.numel)
            dst = d.as_strided(shape, (op.dst_step, 1), d.storage_offset() + op.dst_start)
            src = s.as_strided(shape, (op.src_step, 1), s.storage_offset() + op.src_start)
            bound.strided_dst.append(dst)
            bound.strided_src.append(src)
        elif isinstance(op, Block):
            dst, src = _block_sides(op, tensors)
            bound.dst.append(dst)
            bound.src.append(src)
        else:
            bound.zeros.append(tensors.full(op.dst).narrow(op.dim, op.offset, op.rows))
    return bound


def issue(bound: Bound) -> None:
    """Launch `bound`'s copies: the multi-tensor copy first, as it holds the whole tensors
    (embeddings, MLP weights), so the device is busy while the host issues the rest; then
    the concatenations (a stacked tensor's experts, one call each). The strided runs
    (three per layer's QKV, unless bound block by block) go in one call too: not the
    multi-tensor kernel (their views are not contiguous), but one loop in C++ rather than
    one Python call each. Pairs set apart for a graph (`copies`) go first, in order."""
    for dst, src in bound.copies:
        dst.copy_(src)
    if bound.dst:
        torch._foreach_copy_(bound.dst, bound.src)
    for out, pieces in bound.concats:
        torch.cat(pieces, out=out)
    if bound.strided_dst:
        torch._foreach_copy_(bound.strided_dst, bound.strided_src)
    if bound.zeros:
        torch._foreach_zero_(bound.zeros)


def run_ops(ops: list[Op], tensors: Tensors) -> None:
    """Bind and issue `ops` at once."""
    issue(bind(ops, tensors))


Launch = Callable[[], None]  # issues one bound step's copies


def captured(fn: Callable[[], object]) -> Launch:
    """`fn()`'s kernels recorded once into a CUDA graph (nothing runs); the result replays
    them.

    Captured on a side stream that waits for the current one (as `torch.cuda.graph` does,
    without its synchronize and cache flush); a replay runs on the caller's current stream,
    after whatever it queued before. Kernels not yet loaded must have run once before.
    """
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph.replay


def graph_of(bound: Bound) -> Launch:
    """`issue(bound)` as a captured CUDA graph (`captured`), its large pairs copied one by
    one (`large_pairs_apart`). The copies allocate nothing, so the graph's memory pool
    stays empty."""
    if not (bound.dst or bound.concats or bound.strided_dst or bound.zeros or bound.copies):
        return _nothing  # an empty graph cannot be replayed
    return captured(functools.partial(issue, large_pairs_apart(bound)))


def _nothing() -> None:
    pass


class KeptViews:
    """A program's `local` steps bound to one sync's tensors, kept for the next sync.

    The views are reused while every tensor they view keeps its address, strides, dtype
    and device, its shape being the plan's (the agreement checks it before every sync;
    engines may reallocate weights on wake, trainers reload offloaded ones elsewhere):
    checking that costs a few attribute reads per tensor, binding afresh
    a Python loop over every op. Held by one weight sync, so the views (which keep their
    tensors' storage alive) go with it.

    On CUDA the runs are bound block by block (`bind`'s `runs_as_blocks`): binding is paid
    once, and each block joins the one multi-tensor copy, whose launches are set by the
    bytes (a launch per ~40 MB), not by the number of tensors, while a strided run is a
    copy kernel of its own. On the CPU `_foreach_copy_` has no multi-tensor kernel (one
    copy per pair), so runs stay strided.

    On CUDA, too, the kept steps are issued as CUDA graphs (`graphs`): a graph fixes the
    addresses its kernels touch, exactly what kept views already rely on, so it is valid
    for as long as they are and is dropped with them. Launching the multi-tensor copy
    still costs host time per tensor (its arguments are built and checked per pair):
    the eleventh H200 run's 0.85B sync took 1.9 ms of host time to issue 1 ms of copies,
    the 2B MoE's ~6 ms for its 2 195 tensors (RESULTS.md); a replay is one launch (whose
    large pairs are single copies, faster on the device: `large_pairs_apart`). A step
    is captured on the first sync that reuses its views, so the sync that binds them (the
    first, or one after an engine reallocated) issues them directly, which also loads the
    kernels before any capture; views that change on every sync are never captured.

    Args:
        runs_as_blocks: bind kept runs block by block (None: on CUDA tensors only).
        graphs: issue reused steps as CUDA graphs (None: on CUDA tensors only).
        capture: a bound step → its launch (`graph_of`; tests stand in for it on the CPU).
    """

    def __init__(
        self,
        runs_as_blocks: bool | None = None,
        graphs: bool | None = None,
        capture: Callable[[Bound], Launch] = graph_of,
    ) -> None:
        self.runs_as_blocks, self.graphs, self.capture = runs_as_blocks, graphs, capture
        self.program: CopyProgram | None = None
        self.geometry: tuple = ()  # the placement of the tensors `bound` views
        self.bound: list[list[Bound]] = []  # per round, per `local` step
        self.launches: list[list[Launch]] = []  # the same, as issued: direct or replayed
        self.captured = False  # `launches` replay captured graphs
        self._cuda = False  # the bases are CUDA tensors
        self._targets: list[str] = []  # the generation parameters the program's steps view

    def local(
        self, program: CopyProgram, tensors: Tensors, source_facts: TensorFacts
    ) -> list[list[Launch]]:
        """Each round's `local` steps, ready to launch: bound afresh if anything they view
        moved, else the kept views, replayed as graphs from their second sync on.

        source_facts: `TensorFacts.of(tensors.sources)`, read once for the sync (every
            source counts, not only those the steps view: one changed elsewhere rebinds).
        """
        if program is not self.program:
            self._targets = [name for kind, name in program.bases if kind == DST]
        # Every destination is asked for on every sync (targets record what they hand out).
        targets = list(map(tensors.writable, self._targets))
        geometry = (source_facts.names, source_facts.placement, placement_of(targets))
        if program is not self.program or geometry != self.geometry:
            first = targets[0] if targets else next(iter(tensors.sources.values()), None)
            self._cuda = first is not None and first.is_cuda
            blocks = self._cuda if self.runs_as_blocks is None else self.runs_as_blocks
            self.bound = [
                [bind(step.ops, tensors, runs_as_blocks=blocks) for step in r.local]
                for r in program.rounds
            ]
            self.launches = [[functools.partial(issue, b) for b in steps] for steps in self.bound]
            self.captured = False
            self.program, self.geometry = program, geometry
        elif not self.captured and (self._cuda if self.graphs is None else self.graphs):
            self.launches = [list(map(self.capture, steps)) for steps in self.bound]
            self.captured = True
        return self.launches


def _block_sides(op: Block, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """A narrow-to-narrow block; an arena side is the flat range shaped like the other."""
    if op.dst[0] == ARENA:
        src = tensors.full(op.src).narrow(op.dim, op.src_offset, op.rows)
        return tensors.arena[op.dst_offset : op.dst_offset + src.numel()].view(src.shape), src
    dst = rows_view(tensors.full(op.dst), op.dim, op.dst_offset, op.rows, op.dst_slot_rows)
    if op.src[0] == ARENA:
        return dst, tensors.arena[op.src_offset : op.src_offset + dst.numel()].view(dst.shape)
    return dst, tensors.full(op.src).narrow(op.dim, op.src_offset, op.rows)
