"""Run-time verification of a weight sync: the engine's own parameters against what was sent.

    verifier = SyncVerifier("sample", interval=1, read_engine=engine_parameters)
    WeightSync(target, ..., verifier=verifier)   # checks after every `interval`-th sync

The sync writes into the engine's storage in place; an engine that repacked a parameter
after loading (kernel-private layouts, quantized weights) would be written wrongly and
silently. So after a sync the engine's parameters are read back through the engine itself
(`read_engine`, supplied by the engine's package: for vLLM the live module's
`named_parameters()`, not the views the copy program wrote) and compared bit for bit with
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

Cost: on the first H200 run (`sync_ab --verify-ab`, 0.85B, run 21) `sample` read 352 MB
(the embedding and the LM head are 262 MB of it) in ~5 ms against a 14 ms sync. So each
chunk's tensors are compared on the device as their widest integer words (`differs`: one
flag per tensor, one host sync per chunk; the element that differs is looked for only
when one does), and each chosen set's restricted plan and copy program are compiled once
per plan (`sample` rotates through as many sets as its largest kind has tensors).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.agreement import all_max
from rl_megatron.resharding.copy_program import compile_program
from rl_megatron.resharding.executor import execute
from rl_megatron.resharding.plan import RankRound, ReshardPlan
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


class SyncVerifyError(RuntimeError):
    """The engine's parameter differs from what the sync sent (one line, every rank)."""


def kind_of(name: str) -> str:
    """The parameter kind of engine parameter `name` (`KINDS`; "other" if none)."""
    for kind, fragments in KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other"


def choose(names: Sequence[str], mode: VerifyMode, index: int) -> list[str]:
    """The parameters to verify at the `index`-th verification, in `names`' order.

    `full`: all. `sample`: one of each kind, the kind's `index mod count`-th, so every
    kind is checked every time and every parameter within as many verifications as its
    kind has parameters.
    """
    if mode == "full":
        return list(names)
    by_kind: dict[str, list[str]] = {}
    for name in names:
        by_kind.setdefault(kind_of(name), []).append(name)
    chosen = {group[index % len(group)] for group in by_kind.values()}
    return [n for n in names if n in chosen]


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


def restricted_plan(plan: ReshardPlan, names: set[str]) -> ReshardPlan:
    """`plan` with only the moves and fills into generation parameters `names` (pure).

    Every rank restricts the same plan to the same names, so a message's moves shrink
    alike on its sender and its receiver."""

    def keep(moves):
        return [m for m in moves if m.dst_param in names]

    def part(r: RankRound) -> RankRound:
        sends = {p: ms for p, ms in ((p, keep(ms)) for p, ms in r.sends.items()) if ms}
        recvs = {p: ms for p, ms in ((p, keep(ms)) for p, ms in r.recvs.items()) if ms}
        return RankRound(r.index, keep(r.writes), sends, recvs)

    return dataclasses.replace(
        plan,
        targets=tuple(tuple(s for s in specs if s.name in names) for specs in plan.targets),
        rounds=tuple(tuple(part(r) for r in rounds) for rounds in plan.rounds),
        writes=tuple({n: c for n, c in w.items() if n in names} for w in plan.writes),
    )


@dataclasses.dataclass(frozen=True)
class StoredForm:
    """How the engine stores a parameter in another form than the one sent (vLLM's FP8
    weights: the target quantizes what lands). The verifier encodes what it recomputes the
    same way and compares the engine's tensors with that, bit for bit."""

    sent_dtype: torch.dtype  # the dtype the sync sends it in (the trainer's)
    # what was sent -> the engine's tensors it becomes, by engine parameter name
    encode: Callable[[torch.Tensor], Mapping[str, torch.Tensor]]


class ScratchTarget(ReshardTarget):
    """Fresh tensors (zeros) in the engine tensors' shapes and dtypes (or the dtype sent,
    for a parameter stored in another form): what a sync sends."""

    def __init__(
        self, like: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None = None
    ) -> None:
        dtypes = dtypes or {}
        self.tensors = {
            n: torch.zeros(t.shape, dtype=dtypes.get(n, t.dtype), device=t.device)
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


class SyncVerifier:
    """Checks, after every `interval`-th sync, the engine's parameters against what was sent.

    Args:
        mode: `sample` (a few tensors, every kind, rotating) or `full` (all).
        interval: verify every `interval`-th sync (`rollout.verify_sync_interval`).
        read_engine: the engine's own parameters on this rank, name → tensor, read through
            the engine (its package supplies it: `rollout/vllm/verify.py`).
        forms: parameters the engine stores in another form than sent, by name.
    """

    def __init__(
        self,
        mode: VerifyMode,
        *,
        interval: int,
        read_engine: Callable[[], Mapping[str, torch.Tensor]],
        forms: Mapping[str, StoredForm] | None = None,
    ) -> None:
        if mode not in ("sample", "full"):
            raise ValueError(f"rollout.verify_sync: no verifier for {mode!r}")
        self.mode, self.interval, self.read_engine = mode, interval, read_engine
        self.forms = dict(forms or {})
        self.syncs = 0  # syncs seen
        self.verifications = 0  # verifications run (the sample's rotation)
        # this plan's chosen chunks -> their restricted plans and compiled copy programs
        self._programs: tuple[ReshardPlan, dict] | None = None

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
        stats = VerifyStats()
        local = plan.local_rank(rank)
        specs = plan.targets[local]
        engine = self.read_engine()
        names = [s.name for s in plan.targets[0]]  # the same names on every rank
        shapes = {s.name: s.shape for s in specs}
        # A parameter the engine keeps in another shape (repacked after loading: vLLM's CPU
        # build) cannot be compared bitwise; skipped on every rank if on any.
        flags = [0 if n in engine and tuple(engine[n].shape) == shapes[n] else 1 for n in names]
        flags = all_max(flags, group)
        readable = [n for n, f in zip(names, flags, strict=True) if not f]
        stats.unreadable = len(names) - len(readable)
        chosen = choose(readable, self.mode, self.verifications)
        self.verifications += 1
        problem = None
        for chunk in self._chunks(plan, chosen):
            like = {n: engine[n] for n in chunk}
            dtypes = {n: self.forms[n].sent_dtype for n in chunk if n in self.forms}
            scratch = ScratchTarget(like, dtypes)
            sub, program = self._program(plan, local, chunk)
            execute(sub, program, rank, sources, scratch, group=group)
            compared: list[tuple[str, torch.Tensor, StoredForm | None]] = []
            for name in chunk:
                sent = scratch.tensors[name]
                form = self.forms.get(name)
                stored = form.encode(sent) if form is not None else {name: sent}
                for stored_name, expected in stored.items():
                    stats.verified_tensors += 1
                    stats.verified_bytes += engine[stored_name].nbytes
                    compared.append((stored_name, expected, form))
            flags = torch.stack([differs(engine[n], want) for n, want, _ in compared]).tolist()
            for (stored_name, expected, form), flagged in zip(compared, flags, strict=True):
                if flagged and problem is None:
                    diff = first_difference(engine[stored_name], expected)
                    if diff:
                        index, have, want = diff
                        how = (
                            "what the trainer sent"
                            if form is None
                            else ("the trainer's weight quantized as the engine stores it")
                        )
                        problem = (
                            f"weight sync verification failed on rank {rank}: engine "
                            f"parameter {stored_name} differs from {how} at index "
                            f"{list(index)}: engine {have!r}, sent {want!r} "
                            "(rollout.verify_sync)"
                        )
            del scratch, like, compared
        failing = all_max([1 if problem else 0], group)[0]
        if failing and problem is None:
            problem = "weight sync verification failed on another rank (see its error)"
        stats.verify_s = time.perf_counter() - t0
        return stats, problem

    def _program(self, plan: ReshardPlan, local: int, chunk: list[str]):
        """`plan` restricted to `chunk` and its copy program on local rank `local`, compiled
        once per plan (every rank restricts the same plan to the same names alike)."""
        if self._programs is None or self._programs[0] is not plan:
            self._programs = (plan, {})
        cache = self._programs[1]
        key = tuple(chunk)
        if key not in cache:
            sub = restricted_plan(plan, set(chunk))
            cache[key] = (sub, compile_program(sub, local))
        return cache[key]

    @staticmethod
    def _chunks(plan: ReshardPlan, chosen: list[str]) -> list[list[str]]:
        """`chosen` cut into runs of at most one bucket of scratch (every rank alike: sizes
        are the largest over the plan's ranks)."""
        size = {n: 0 for n in chosen}
        for specs in plan.targets:
            for s in specs:
                if s.name in size:
                    size[s.name] = max(size[s.name], math.prod(s.shape) * plan.key.elem_size)
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
