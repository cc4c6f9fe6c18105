"""Run-time verification of a weight sync: the engine's own parameters against what was sent.

    verifier = SyncVerifier("sample", interval=1, read_engine=engine_parameters)
    WeightSync(target, ..., verifier=verifier)   # checks after every `interval`-th sync

The sync writes into the engine's storage in place; an engine that repacked a parameter
after loading (kernel-private layouts, quantized weights) would be written wrongly and
silently. So after a sync the engine's parameters are read back through the engine itself
(`read_engine`, supplied by the engine's package: for vLLM the live module's parameters,
looked up by name, not the views the copy program wrote) and compared bit for bit with
what the trainer sent.

"What was sent" is computed again, independently of the engine's storage: the sync's plan
is restricted to the chosen parameters (`restricted_plan`: the same moves and fills, only
those into them) and its copy program is run into scratch tensors of the engine tensor's
shape and dtype (`ScratchTarget`). That reuses the plan and copy code the sync itself ran
(recomputing from the actor's shards through the name tables would need whole-tensor
gathers across the training ranks, a second implementation of the plan), and a restricted
plan moves only the chosen tensors' rows: `sample` costs a few tensors' copies and
transfers, not a second sync. The check is collective (the restricted plan's transfers,
one all-reduce for the verdict) and every rank chooses the same tensors: the choice is a
function of the plan's parameter names and the count of verifications only.

Scratch memory: the chosen tensors are verified in chunks of at most the sync's bucket
(`rollout.weight_sync_bucket_mb`), or one tensor if it is larger.

Cost (`sync_ab --verify-ab`, 0.85B): on the first H200 run `sample` read 352 MB (the
embedding and the LM head 262 MB of it) in ~5 ms against a 14 ms sync, and an H100 rerun
still spent 3-5 ms, mostly on the host: every check compiled a new restricted plan (the
kinds' rotations had a period of hundreds of checks), grouped every name by kind, and read
all of the engine's parameters. So now (`Rotation`): a tensor larger than
`SAMPLE_WINDOW_BYTES` is compared one row window at a time (the window moves on each time
the tensor's turn comes), which bounds a check's bytes whatever the model's size; the
kinds rotate in lockstep with a period of the longest kind's turns, and the period's sets
are compiled once, at a plan's first check; only the chosen parameters are read from the
engine; and each chunk's tensors are compared on the device as their widest integer words
(`differs`), with one host sync per chunk (one chunk for `sample`; the element that differs
is looked for only when one does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.agreement import all_max
from rl_megatron.resharding.copy_program import compile_program
from rl_megatron.resharding.executor import execute
from rl_megatron.resharding.plan import Move, RankRound, ReshardPlan
from rl_megatron.resharding.shards import ShardSpec, Span
from rl_megatron.resharding.targets import ReshardTarget

VerifyMode = Literal["off", "sample", "full"]

# Kinds of engine parameters (name fragments, first match wins): `sample` checks one of
# each kind per verification, so a layout that breaks one kind shows on the first check.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention_qkv", ("qkv_proj",)),
    ("attention_o", ("o_proj",)),
    ("mlp_gate_up", ("gate_up_proj",)),
    ("mlp_down", ("down_proj",)),
    ("experts_w13", ("w13_weight",)),
    ("experts_w2", ("w2_weight",)),
    ("router", ("mlp.gate.",)),
    ("embedding", ("embed_tokens",)),
    ("lm_head", ("lm_head",)),
    ("norm", ("norm",)),
)

# Same-size integer views: a bitwise comparison (NaN == NaN, -0 != +0).
_BITS = ((1, torch.uint8), (2, torch.int16), (4, torch.int32), (8, torch.int64))

# `sample` compares at most this many bytes of one tensor per check: a larger one (the
# vocabulary matrices, an 8B model's MLP weights) is checked a row window at a time.
SAMPLE_WINDOW_BYTES = 8 << 20

# A parameter's rows [start, start + rows) along its shard's row dim (`ShardSpec.dim`).
Window = tuple[int, int]


class SyncVerifyError(RuntimeError):
    """The engine's parameter differs from what the sync sent (one line, every rank)."""


def kind_of(name: str) -> str:
    """The parameter kind of engine parameter `name` (`KINDS`; "other" if none)."""
    for kind, fragments in KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other"


class Rotation:
    """What `sample` checks at each verification: one (parameter, row window) of each kind.

    Within a kind the parameters take turns, and a parameter of `windows[name]` windows
    (1 if absent) moves its window on each turn: at step `j` of the kind's cycle, parameter
    `j mod n` and, on that parameter's `(j div n)`-th turn, its window `(j div n) mod w`. The
    kinds step together, with the period of the longest kind's cycle (`period`): so a
    period holds `period` distinct sets (compiled once), every kind is checked every time,
    and every window of every parameter within two periods.
    """

    def __init__(self, names: Sequence[str], windows: Mapping[str, int]) -> None:
        by_kind: dict[str, list[str]] = {}
        for name in names:
            by_kind.setdefault(kind_of(name), []).append(name)
        self.order = {name: i for i, name in enumerate(names)}
        self.windows = dict(windows)
        self.kinds = list(by_kind.values())
        self.cycles = [len(g) * max(self.windows.get(n, 1) for n in g) for g in self.kinds]
        self.period = max(self.cycles, default=1)

    def picks(self, index: int) -> list[tuple[str, int | None]]:
        """(parameter, its window's number or None for the whole tensor), in names' order."""
        step = index % self.period
        out = []
        for group, cycle in zip(self.kinds, self.cycles, strict=True):
            j = step % cycle
            name = group[j % len(group)]
            count = self.windows.get(name, 1)
            out.append((name, (j // len(group)) % count if count > 1 else None))
        return sorted(out, key=lambda pick: self.order[pick[0]])


def first_difference(
    engine: torch.Tensor, sent: torch.Tensor
) -> tuple[tuple[int, ...], float, float] | None:
    """The first element where `engine` and `sent` differ bitwise: (index, engine's value,
    sent value), or None if equal. Same shape and dtype required (the caller's check)."""
    bits = dict(_BITS)[engine.element_size()]
    a = engine.detach().reshape(-1).view(bits)
    b = sent.detach().reshape(-1).view(bits)
    differ = (a != b).nonzero()
    if differ.numel() == 0:
        return None
    flat = int(differ[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), engine.shape))
    value = lambda t: t.reshape(-1)[flat].to(torch.float32).item()  # noqa: E731 (fp8 too)
    return index, value(engine), value(sent)


def differs(engine: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """Whether `engine` and `sent` differ bitwise, as a 0-dim bool tensor (no host sync).

    Compares the bytes as the widest integer words that tile them (8 bytes for most
    weights: a quarter of the bf16 elements' comparisons and mask), so it reads each
    tensor once and writes a mask of numel / 4 bytes."""
    a, b = engine.detach().reshape(-1), sent.detach().reshape(-1)
    for size, bits in reversed(_BITS):
        if size < a.element_size() or a.nbytes % size:
            continue
        try:
            return torch.ne(a.view(torch.uint8).view(bits), b.view(torch.uint8).view(bits)).any()
        except RuntimeError:  # a storage offset not aligned to the word: a narrower one
            continue
    raise AssertionError("unreachable: the element's own size always tiles its bytes")


def restricted_plan(
    plan: ReshardPlan, names: set[str], windows: Mapping[str, Window] | None = None
) -> ReshardPlan:
    """`plan` with only the moves and fills into generation parameters `names` (pure);
    a parameter in `windows` only its rows `[start, start + rows)` along its row dim,
    renumbered from 0 (its shard spec becomes the window's shape).

    Every rank restricts the same plan to the same names and windows, so a message's moves
    shrink alike on its sender and its receiver (a window is in the destination's rows)."""
    windows = windows or {}

    def clip(m):
        if m.dst_param not in names:
            return None
        if m.dst_param not in windows:
            return m
        start, rows = windows[m.dst_param]
        lo, hi = max(start, m.dst_offset), min(start + rows, m.dst_offset + m.rows)
        if lo >= hi:
            return None
        if getattr(m, "dst_slot_rows", 0):  # `_window_rows` never windows a stacked one
            raise AssertionError(f"{m.dst_param}: a row window of a stacked parameter")
        fields = dict(dst_offset=lo - start, rows=hi - lo)
        if isinstance(m, Move):
            fields["src_offset"] = m.src_offset + (lo - m.dst_offset)
        return dataclasses.replace(m, **fields)

    def keep(moves):
        return [c for c in map(clip, moves) if c is not None]

    def part(r: RankRound) -> RankRound:
        sends = {p: ms for p, ms in ((p, keep(ms)) for p, ms in r.sends.items()) if ms}
        recvs = {p: ms for p, ms in ((p, keep(ms)) for p, ms in r.recvs.items()) if ms}
        return RankRound(r.index, keep(r.writes), sends, recvs)

    def spec(s: ShardSpec) -> ShardSpec:
        if s.name not in windows:
            return s
        start, rows = windows[s.name]
        rows = min(rows, s.shape[s.dim] - start)
        spans = []
        for span in s.spans:
            lo, hi = max(start, span.offset), min(start + rows, span.offset + span.length)
            if lo < hi:
                hf_start = span.hf_start + (lo - span.offset) if span.hf_name else 0
                spans.append(Span(lo - start, hi - lo, span.hf_name, hf_start))
        shape = tuple(rows if d == s.dim else n for d, n in enumerate(s.shape))
        return dataclasses.replace(s, shape=shape, spans=tuple(spans))

    rounds = tuple(tuple(part(r) for r in rank_rounds) for rank_rounds in plan.rounds)
    writes = []
    for rank_rounds in rounds:  # local moves, fills and received moves, as `build_plan`
        count: dict[str, int] = {}
        for r in rank_rounds:
            for m in (*r.writes, *(m for ms in r.recvs.values() for m in ms)):
                count[m.dst_param] = count.get(m.dst_param, 0) + 1
        writes.append(count)
    return dataclasses.replace(
        plan,
        targets=tuple(tuple(spec(s) for s in specs if s.name in names) for specs in plan.targets),
        rounds=rounds,
        writes=tuple(writes),
    )


@dataclasses.dataclass(frozen=True)
class StoredForm:
    """How the engine stores a parameter in another form than the one sent (vLLM's FP8
    weights: the target quantizes what lands). The verifier encodes what it recomputes the
    same way and compares the engine's tensors with that, bit for bit."""

    sent_dtype: torch.dtype  # the dtype the sync sends it in (the trainer's)
    # what was sent -> the engine's tensors it becomes, by engine parameter name
    encode: Callable[[torch.Tensor], Mapping[str, torch.Tensor]]
    stored: tuple[str, ...]  # the names `encode` returns (read from the engine)


class ScratchTarget(ReshardTarget):
    """Fresh tensors (uninitialised: a plan writes every element of its targets, padding
    rows by its fills) in the engine tensors' shapes and dtypes (or the dtype sent,
    for a parameter stored in another form; or the shapes given): what a sync sends."""

    def __init__(
        self,
        like: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype] | None = None,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        dtypes, shapes = dtypes or {}, shapes or {}
        self.tensors = {
            n: torch.empty(shapes.get(n, t.shape), dtype=dtypes.get(n, t.dtype), device=t.device)
            for n, t in like.items()
        }

    def padded_vocab(self) -> int:  # pragma: no cover
        raise RuntimeError("a verification's scratch target is handed its plan, never agreed on")

    def check(self, shapes: Mapping[str, tuple[int, ...]], info: HFModelInfo) -> list[str]:
        return []

    def begin(self, version: int) -> None:
        pass

    def writable(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def finish(self) -> None:
        pass

    def abort(self, why: str) -> None:
        pass


@dataclasses.dataclass
class VerifyStats:
    """One verification on this rank (`sync/verify_s`, `sync/verified_*`)."""

    verify_s: float = 0.0
    verified_tensors: int = 0
    verified_bytes: int = 0  # engine bytes compared on this rank
    unreadable: int = 0  # parameters the engine does not hold in the format sent


@dataclasses.dataclass
class _Check:
    """One chunk of a verification: its parameters' windows, restricted plan and program."""

    names: list[str]
    windows: dict[str, Window]
    plan: ReshardPlan
    program: object  # `CopyProgram` on this rank


@dataclasses.dataclass
class _Selection:
    """A plan's verifications, worked out at its first: what is comparable, the rotation,
    and each of the period's sets as compiled chunks."""

    plan: ReshardPlan
    shapes: dict[str, tuple[int, ...]]  # this rank's generation shards, by name
    dims: dict[str, int]  # each parameter's row dim (`ShardSpec.dim`)
    unreadable: int
    rotation: Rotation | None  # None: `full`
    sets: dict[int, list[_Check]]  # period step (0 for `full`) -> its chunks


class SyncVerifier:
    """Checks, after every `interval`-th sync, the engine's parameters against what was sent.

    Args:
        mode: `sample` (a few tensors, every kind, rotating) or `full` (all).
        interval: verify every `interval`-th sync (`rollout.verify_sync_interval`).
        read_engine: the engine's own parameters on this rank, name → tensor, read through
            the engine (its package supplies it: `rollout/vllm/verify.py`); called with the
            names wanted, or None for all of them.
        forms: parameters the engine stores in another form than sent, by name.
        window_bytes: `sample`'s row window (`SAMPLE_WINDOW_BYTES`).
    """

    def __init__(
        self,
        mode: VerifyMode,
        *,
        interval: int,
        read_engine: Callable[[Sequence[str] | None], Mapping[str, torch.Tensor]],
        forms: Mapping[str, StoredForm] | None = None,
        window_bytes: int = SAMPLE_WINDOW_BYTES,
    ) -> None:
        if mode not in ("sample", "full"):
            raise ValueError(f"rollout.verify_sync: no verifier for {mode!r}")
        self.mode, self.interval, self.read_engine = mode, interval, read_engine
        self.forms = dict(forms or {})
        self.window_bytes = window_bytes
        self.syncs = 0  # syncs seen
        self.verifications = 0  # verifications run (the sample's rotation)
        self._selection: _Selection | None = None  # of the last plan verified

    def due(self) -> bool:
        """Count a sync; whether this one is verified."""
        self.syncs += 1
        return (self.syncs - 1) % self.interval == 0

    @torch.no_grad()
    def verify(
        self,
        plan: ReshardPlan,
        rank: int,
        sources: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None,
    ) -> tuple[VerifyStats, str | None]:
        """Verify this sync (collective). Returns the stats and the problem every rank must
        raise on (None if all ranks' checks held): this rank's first mismatch, or a line
        saying another rank found one."""
        t0 = time.perf_counter()
        selection = self._select(plan, rank, group)
        stats = VerifyStats(unreadable=selection.unreadable)
        rotation = selection.rotation
        checks = selection.sets[0 if rotation is None else self.verifications % rotation.period]
        self.verifications += 1
        chosen = [n for check in checks for n in check.names]
        stored = [n for name in chosen for n in self._stored_names(name)]
        engine = self.read_engine(stored)
        problem = None
        for name in chosen:  # what was comparable at the plan's first check still is
            if name not in engine or tuple(engine[name].shape) != selection.shapes[name]:
                have = tuple(engine[name].shape) if name in engine else "absent"
                problem = problem or (
                    f"weight sync verification failed on rank {rank}: engine parameter "
                    f"{name} is {have}, not {selection.shapes[name]} as at the first check "
                    "(rollout.verify_sync)"
                )
        local = plan.local_rank(rank)
        first = next(iter(sources.values()), torch.empty(0))
        for check in checks:
            ok = [n for n in check.names if n in engine and problem is None]
            like = {n: self._window(engine[n], selection.dims[n], check.windows.get(n)) for n in ok}
            # The program writes every chosen parameter: scratch for those not compared too.
            dtypes = {n: like[n].dtype if n in like else first.dtype for n in check.names}
            dtypes |= {n: self.forms[n].sent_dtype for n in check.names if n in self.forms}
            scratch = ScratchTarget(
                {n: like.get(n, first) for n in check.names},
                dtypes,
                {sp.name: sp.shape for sp in check.plan.targets[local]},
            )
            execute(check.plan, check.program, rank, sources, scratch, group=group)
            compared: list[tuple[str, torch.Tensor, torch.Tensor, StoredForm | None, int]] = []
            for name in ok:
                form = self.forms.get(name)
                start = check.windows[name][0] if name in check.windows else 0
                sent = scratch.tensors[name]
                for stored_name, expected in (form.encode(sent) if form else {name: sent}).items():
                    have = engine[stored_name] if form else like[name]
                    compared.append((stored_name, have, expected, form, start))
            stats.verified_tensors += len(compared)
            stats.verified_bytes += sum(have.nbytes for _, have, _, _, _ in compared)
            # One host sync per chunk (one chunk for `sample`'s windows): a flag per tensor.
            flags = (
                torch.stack([differs(h, e) for _, h, e, _, _ in compared]).tolist()
                if compared
                else []
            )
            for (stored_name, have, expected, form, start), flagged in zip(
                compared, flags, strict=True
            ):
                if flagged and problem is None and (diff := first_difference(have, expected)):
                    problem = self._mismatch(rank, stored_name, diff, form, start, selection)
            del scratch, like, compared
        failing = all_max([1 if problem else 0], group)[0]
        if failing and problem is None:
            problem = "weight sync verification failed on another rank (see its error)"
        stats.verify_s = time.perf_counter() - t0
        return stats, problem

    @staticmethod
    def _mismatch(rank, name, diff, form, start, selection) -> str:
        """The one-line error for `name`'s first differing element (`diff`), its index in the
        whole tensor (a window's rows start at `start`)."""
        index, engine_value, sent_value = diff
        dim = selection.dims.get(name, 0)
        index = tuple(i + start if d == dim else i for d, i in enumerate(index))
        how = (
            "what the trainer sent"
            if form is None
            else "the trainer's weight quantized as the engine stores it"
        )
        return (
            f"weight sync verification failed on rank {rank}: engine parameter {name} "
            f"differs from {how} at index {list(index)}: engine {engine_value!r}, sent "
            f"{sent_value!r} (rollout.verify_sync)"
        )

    def _stored_names(self, name: str) -> tuple[str, ...]:
        form = self.forms.get(name)
        return form.stored if form is not None else (name,)

    @staticmethod
    def _window(tensor: torch.Tensor, dim: int, window: Window | None) -> torch.Tensor:
        return tensor if window is None else tensor.narrow(dim, window[0], window[1])

    def _select(self, plan: ReshardPlan, rank: int, group) -> _Selection:
        """The plan's selection, worked out at its first verification (collective then:
        which parameters every rank's engine holds in the shape sent)."""
        if self._selection is not None and self._selection.plan is plan:
            return self._selection
        local = plan.local_rank(rank)
        specs = plan.targets[local]
        names = [s.name for s in plan.targets[0]]  # the same names on every rank
        shapes = {s.name: tuple(s.shape) for s in specs}
        engine = self.read_engine(None)
        # A parameter the engine keeps in another shape (repacked after loading: vLLM's CPU
        # build) cannot be compared bitwise; left out on every rank if on any.
        flags = [0 if n in engine and tuple(engine[n].shape) == shapes[n] else 1 for n in names]
        flags = all_max(flags, group)
        readable = [n for n, f in zip(names, flags, strict=True) if not f]
        del engine
        if self.mode == "full":
            rotation, windows = None, {}
            steps = {0: [(n, None) for n in readable]}
        else:
            windows = self._window_rows(plan, readable)
            rotation = Rotation(readable, {n: len(w) for n, w in windows.items()})
            steps = {step: rotation.picks(step) for step in range(rotation.period)}
        sets: dict[int, list[_Check]] = {}
        for step, picks in steps.items():
            chosen = {n: windows[n][w] for n, w in picks if w is not None}
            sets[step] = []
            for chunk in self._chunks(plan, [n for n, _ in picks], chosen):
                mine = {n: chosen[n] for n in chunk if n in chosen}
                sub = restricted_plan(plan, set(chunk), mine)
                sets[step].append(_Check(chunk, mine, sub, compile_program(sub, local)))
        self._selection = _Selection(
            plan=plan,
            shapes=shapes,
            dims={s.name: s.dim for s in specs},
            unreadable=len(names) - len(readable),
            rotation=rotation,
            sets=sets,
        )
        return self._selection

    def _window_rows(self, plan: ReshardPlan, names: list[str]) -> dict[str, list[Window]]:
        """`sample`'s row windows of each parameter larger than `window_bytes` (not a
        stacked one, nor one stored in another form): the same on every rank (from the
        largest of the plan's ranks' shards)."""
        specs: dict[str, list[ShardSpec]] = {}
        for rank_specs in plan.targets:
            for sp in rank_specs:
                specs.setdefault(sp.name, []).append(sp)
        out: dict[str, list[Window]] = {}
        for name in names:
            if name in self.forms or any(sp.stack for sp in specs[name]):
                continue
            rows = max(sp.shape[sp.dim] for sp in specs[name])
            row_bytes = max(sp.row_numel for sp in specs[name]) * plan.key.elem_size
            per = max(1, self.window_bytes // row_bytes)
            if per < rows:
                out[name] = [(start, min(per, rows - start)) for start in range(0, rows, per)]
        return out

    @staticmethod
    def _chunks(
        plan: ReshardPlan, chosen: list[str], windows: Mapping[str, Window]
    ) -> list[list[str]]:
        """`chosen` cut into runs of at most one bucket of scratch (every rank alike: sizes
        are the largest over the plan's ranks; a windowed parameter's its window's)."""
        size = {n: 0 for n in chosen}
        for specs in plan.targets:
            for sp in specs:
                if sp.name in size:
                    rows = windows[sp.name][1] if sp.name in windows else sp.rows
                    size[sp.name] = max(size[sp.name], rows * sp.row_numel * plan.key.elem_size)
        chunks: list[list[str]] = []
        used = 0
        for name in chosen:
            if chunks and used + size[name] <= plan.key.bucket_bytes:
                chunks[-1].append(name)
                used += size[name]
            else:
                chunks.append([name])
                used = size[name]
        return chunks


def abort_on(problem: str | None, target: ReshardTarget) -> None:
    """Stop before generating: the engine refuses its update, and every rank raises."""
    if problem is None:
        return
    target.abort(problem)
    raise SyncVerifyError(problem)
