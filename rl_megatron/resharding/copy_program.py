"""A rank's part of a resharding plan, compiled once into few strided copies per round.

A 7B sync moves ~3k row blocks per rank (the q, k and v rows of every query group of
every layer, which Megatron interleaves per group and vLLM keeps in three runs). Issuing
them one by one from Python made the sync host-bound: ~31 of its 39 ms on an H200 went
to the per-block loop. The blocks of a round only depend on the plan, so they are turned,
once per plan and rank, into a `CopyProgram`:

* tensors are named by role, not held: a training shard (`src`), a generation parameter
  (`dst`) or the sync's transfer arena, so the program outlives the tensors of one sync
  (the arena is allocated per sync; the engine may reallocate its parameters);
* blocks along dim 0 of contiguous tensors are flat element ranges; those between the
  same two tensors, of one size, whose offsets step evenly on both sides (every group's
  q rows of a layer, say) become one strided copy (`Run`);
* blocks along another dim (row-parallel weights split by columns) stay single
  narrow-to-narrow copies (`Block`), a few per layer.

A round's ops come in three lists: `local` (zero fills and copies from training shards
into generation parameters), `pack` (send rows into the arena) and `unpack` (received rows
out of it). Destinations within a round are disjoint, so copies may run in any order.

Running is two steps: `bind` resolves ops to views of one sync's tensors (a `Bound`:
the lists for one multi-tensor copy, the strided copies, the zero fills), `issue` launches
them. The executor keeps the bound `local` ops across syncs while the tensors they view
are unchanged (`CopyProgram.bases`), so a repeated sync issues its copies with almost no
Python; `pack` and `unpack` view the arena, which is allocated per sync, and are bound on
every sync. The executor keeps the block-by-block path for targets that buffer each
parameter until it is complete (vLLM's CPU build), which must hear of a parameter as soon
as its rows land.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from rl_megatron.resharding.plan import Fill, Move, RankRound, ReshardPlan

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
class Block:
    """Rows `[offset, +rows)` along `dim`; an arena side is a flat range of the same size."""

    dst: Ref
    dst_offset: int
    src: Ref
    src_offset: int
    dim: int
    rows: int


@dataclasses.dataclass(frozen=True)
class Zero:
    dst: Ref
    dim: int
    offset: int
    rows: int


@dataclasses.dataclass
class RoundProgram:
    local: list[Run | Block | Zero]  # zero fills and copies from the rank's training shards
    pack: list[Run | Block]  # send rows into the arena
    unpack: list[Run | Block]  # received rows into the generation parameters
    completed: list[str]  # generation parameters whose last rows land in this round
    sends: list[tuple[int, int, int]]  # (peer, arena start, numel)
    recvs: list[tuple[int, int, int]]
    local_numel: int  # elements copied from the rank's own training shards
    filled_numel: int  # zero padding elements written


@dataclasses.dataclass
class CopyProgram:
    rounds: list[RoundProgram]
    arena_numel: int  # the fullest round's send + receive elements (≤ one bucket)
    bases: list[Ref]  # the tensors the rounds' `local` ops view


# ------------------------------------------------------------------------- compile


def compile_program(plan: ReshardPlan, local: int) -> CopyProgram:
    """The copy program of local rank `local` (pure: plan in, program out)."""
    remaining = dict(plan.writes[local])
    rounds = []
    for rnd in plan.rounds[local]:
        rounds.append(_compile_round(rnd, remaining))
    if any(remaining.values()):
        raise AssertionError(f"local rank {local}: plan leaves parameters unfinished")
    arena_numel = max((r.staging_numel() for r in plan.rounds[local]), default=0)
    bases = {ref for r in rounds for op in r.local for ref in _refs(op)}
    return CopyProgram(rounds, arena_numel, sorted(bases))


def _refs(op: Run | Block | Zero) -> tuple[Ref, ...]:
    return (op.dst,) if isinstance(op, Zero) else (op.dst, op.src)


def _compile_round(rnd: RankRound, remaining: dict[str, int]) -> RoundProgram:
    local: list[Run | Block | Zero] = []
    flat: list[tuple[Ref, int, Ref, int, int]] = []  # (dst, d_start, src, s_start, numel)
    completed: list[str] = []

    def wrote(name: str) -> None:
        remaining[name] -= 1
        if not remaining[name]:
            completed.append(name)

    for w in rnd.writes:
        if isinstance(w, Fill):
            local.append(Zero((DST, w.dst_param), w.dim, w.dst_offset, w.rows))
        elif w.dim == 0:
            flat.append(((DST, w.dst_param), w.dst_offset * w.row_numel,
                         (SRC, w.src_param), w.src_offset * w.row_numel, w.numel))  # fmt: skip
        else:
            local.append(Block((DST, w.dst_param), w.dst_offset, (SRC, w.src_param),
                               w.src_offset, w.dim, w.rows))  # fmt: skip
        wrote(w.dst_param)
    local += coalesce(flat)
    flat, pack = [], []
    used, sends, recvs = 0, [], []
    for peer, moves in rnd.sends.items():
        sends.append((peer, used, sum(m.numel for m in moves)))
        for m, pos in _positions(moves, used):
            if m.dim == 0:
                flat.append(((ARENA, ""), pos, (SRC, m.src_param), m.src_offset * m.row_numel,
                             m.numel))  # fmt: skip
            else:
                pack.append(Block((ARENA, ""), pos, (SRC, m.src_param), m.src_offset,
                                  m.dim, m.rows))  # fmt: skip
        used += sends[-1][2]
    pack += coalesce(flat)
    flat, unpack = [], []
    for peer, moves in rnd.recvs.items():
        recvs.append((peer, used, sum(m.numel for m in moves)))
        for m, pos in _positions(moves, used):
            if m.dim == 0:
                flat.append(((DST, m.dst_param), m.dst_offset * m.row_numel, (ARENA, ""), pos,
                             m.numel))  # fmt: skip
            else:
                unpack.append(Block((DST, m.dst_param), m.dst_offset, (ARENA, ""), pos,
                                    m.dim, m.rows))  # fmt: skip
            wrote(m.dst_param)
        used += recvs[-1][2]
    unpack += coalesce(flat)
    local_numel = sum(w.numel for w in rnd.writes if isinstance(w, Move))
    filled_numel = sum(w.numel for w in rnd.writes if isinstance(w, Fill))
    return RoundProgram(local, pack, unpack, completed, sends, recvs, local_numel, filled_numel)


def _positions(moves: list[Move], start: int) -> Iterator[tuple[Move, int]]:
    """Each move with its element offset in the peer's buffer (moves packed back to back)."""
    pos = start
    for m in moves:
        yield m, pos
        pos += m.numel


def coalesce(blocks: list[tuple[Ref, int, Ref, int, int]]) -> list[Run]:
    """Flat blocks → runs: same tensors and size, offsets stepping evenly on both sides."""
    groups: dict[tuple[Ref, Ref, int], list[tuple[int, int]]] = {}
    for dst, d_start, src, s_start, numel in blocks:
        groups.setdefault((dst, src, numel), []).append((d_start, s_start))
    runs = []
    for (dst, src, numel), starts in groups.items():
        for (d0, s0), count, d_step, s_step in even_runs(sorted(starts), numel):
            runs.append(Run(dst, d0, d_step, src, s0, s_step, count, numel))
    return runs


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
    strided: list[tuple[torch.Tensor, torch.Tensor]]  # runs of several blocks: (dst, src)
    zeros: list[torch.Tensor]


def bind(ops: list[Run | Block | Zero], tensors: Tensors) -> Bound:
    """Views of `tensors` for `ops` (no copy is made)."""
    bound = Bound([], [], [], [])
    for op in ops:
        if isinstance(op, Run):
            d, s = tensors.flat(op.dst), tensors.flat(op.src)
            if op.count == 1:
                bound.dst.append(d[op.dst_start : op.dst_start + op.numel])
                bound.src.append(s[op.src_start : op.src_start + op.numel])
                continue
            shape = (op.count, op.numel)
            dst = d.as_strided(shape, (op.dst_step, 1), d.storage_offset() + op.dst_start)
            src = s.as_strided(shape, (op.src_step, 1), s.storage_offset() + op.src_start)
            bound.strided.append((dst, src))
        elif isinstance(op, Block):
            dst, src = _block_sides(op, tensors)
            bound.dst.append(dst)
            bound.src.append(src)
        else:
            bound.zeros.append(tensors.full(op.dst).narrow(op.dim, op.offset, op.rows))
    return bound


def issue(bound: Bound) -> None:
    """Launch `bound`'s copies: the multi-tensor copy first, as it holds the whole tensors
    (embeddings, MLP weights), so the device is busy while the host issues the rest."""
    if bound.dst:
        torch._foreach_copy_(bound.dst, bound.src)
    for dst, src in bound.strided:
        dst.copy_(src)
    if bound.zeros:
        torch._foreach_zero_(bound.zeros)


def run_ops(ops: list[Run | Block | Zero], tensors: Tensors) -> None:
    """Bind and issue `ops` at once."""
    issue(bind(ops, tensors))


def _block_sides(op: Block, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """A narrow-to-narrow block; an arena side is the flat range shaped like the other."""
    if op.dst[0] == ARENA:
        src = tensors.full(op.src).narrow(op.dim, op.src_offset, op.rows)
        return tensors.arena[op.dst_offset : op.dst_offset + src.numel()].view(src.shape), src
    dst = tensors.full(op.dst).narrow(op.dim, op.dst_offset, op.rows)
    if op.src[0] == ARENA:
        return dst, tensors.arena[op.src_offset : op.src_offset + dst.numel()].view(dst.shape)
    return dst, tensors.full(op.src).narrow(op.dim, op.src_offset, op.rows)
