"""Resharding plan: which rows each training rank sends to each generation rank, in rounds.

Given the training layout (t, p, d, vpp), the generation layout (t_g, its rank map) and the
model, `build_plan` works out, for every parameter shard of every generation rank, where
each of its rows lives in the training layout (`shards.py` describes both sides as row
ranges of HF tensors) and turns that into

* local moves — rows a rank already holds, copied from its training parameter into its
  generation parameter (no communication);
* remote moves — rows another rank of the same training replica holds. The source is the
  receiver itself whenever it holds the rows, so no rank ever receives bytes it already
  has and no row is received twice: the bytes each rank receives are exactly its
  generation shard minus what it holds (tests/unit/test_reshard_plan.py checks this
  against row sets);
* fills — zero rows (vocabulary padding of the target layout);

and packs the remote moves into rounds such that in every round each rank's send plus
receive staging is at most `bucket_bytes` (a move larger than that is split by rows).

All training replicas are identical blocks of t·p consecutive ranks (cp = 1: generation
from a context-parallel layout is refused, `layouts.generation_layout_for`) and every generation
TP group lies inside one of them (t_g divides t·p), so the plan is made for one replica in
local rank numbers (0 … t·p−1) and every replica runs it with its own rank offset: traffic
never leaves a training replica, and the plan's size does not grow with d. With experts the
unit is the *plan block* (`plan_block`): expert parallelism may spread the experts over
data-parallel replicas (EP over DP), so a block is the fewest consecutive ranks holding
every dense row and every expert, lcm(t·cp·p, etp·ep·p); its replicas hold the same dense
rows and the plan still takes each row from the receiver itself where it can.

Split placement (`trainer.mode: split_async`) sends to generation ranks of their own:
`build_remote_plan` makes the same plan over one block's training ranks and one generation
replica's ranks appended to them as local ranks of their own (`resharding/remote.py`).

Plans are pure functions of their `PlanKey` (model, layout pair, target, vocab padding,
bucket, dtype); a weight sync keeps the one it runs (`agreement.PlanAgreement`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding import shards
from rl_megatron.resharding.layouts import GenerationLayout, TrainingLayout, micro_dp
from rl_megatron.resharding.shards import ShardSpec

# The generation side's parameter layout: `specs(info, tp, tp_rank, padded_vocab)` → every
# parameter shard one rank of a `tp`-way engine holds. Each engine supplies its own
# (`ReshardTarget.specs`: e.g. `rollout/vllm/specs.py`; `shards.megatron_generation_specs`
# for a Megatron model at PP 1); a plan knows no engine.
TargetSpecs = Callable[[HFModelInfo, int, int, int], list[ShardSpec]]


@dataclasses.dataclass(frozen=True)
class Move:
    """Rows `[src_offset, +rows)` of `src_param` on local rank `src` → rows
    `[dst_offset, +rows)` of `dst_param` on local rank `dst`, along `dim` of both."""

    src: int
    dst: int
    src_param: str
    dst_param: str
    dim: int
    src_offset: int
    dst_offset: int
    rows: int
    row_numel: int
    dst_slot_rows: int = 0  # a stacked destination (`ShardSpec.stack`): rows per slot

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel


@dataclasses.dataclass(frozen=True)
class Fill:
    """Zero rows `[dst_offset, +rows)` along `dim` of `dst_param` on local rank `dst`."""

    dst: int
    dst_param: str
    dim: int
    dst_offset: int
    rows: int
    row_numel: int

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel


@dataclasses.dataclass
class RankRound:
    """One rank's part of one round; messages to / from a peer are its moves packed in order."""

    index: int
    # Local moves (src == dst) and fills, in model order: a parameter then completes as
    # early as possible, so targets that buffer a parameter hold few at once.
    writes: list[Move | Fill] = dataclasses.field(default_factory=list)
    sends: dict[int, list[Move]] = dataclasses.field(default_factory=dict)  # peer → moves
    recvs: dict[int, list[Move]] = dataclasses.field(default_factory=dict)

    def staging_numel(self) -> int:
        """Elements of send + receive buffers this round allocates."""
        moves = [m for ms in (*self.sends.values(), *self.recvs.values()) for m in ms]
        return sum(m.numel for m in moves)


@dataclasses.dataclass(frozen=True)
class RankTraffic:
    """Elements one rank moves in a sync (multiply by the element size for bytes)."""

    sent: int
    received: int
    local: int  # copied from its own training shard
    filled: int  # zero padding rows written


@dataclasses.dataclass(frozen=True)
class PlanKey:
    info: HFModelInfo
    training: TrainingLayout
    generation: GenerationLayout
    target: TargetSpecs  # the engine's parameter layout (a module-level function)
    training_padded_vocab: int
    generation_padded_vocab: int
    bucket_bytes: int
    elem_size: int  # bytes per element of the transferred dtype


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    key: PlanKey
    replica_size: int  # ranks of one plan block (`plan_block`; t·p without experts)
    sources: tuple[tuple[ShardSpec, ...], ...]  # per local rank: its training shards
    targets: tuple[tuple[ShardSpec, ...], ...]  # per local rank: its generation shards
    rounds: tuple[tuple[RankRound, ...], ...]  # per local rank: rounds it takes part in
    # Per local rank: generation parameter → writes (local moves, fills, received moves)
    # that fill it; the executor counts them down to tell the target when one is complete.
    writes: tuple[dict[str, int], ...]
    num_rounds: int
    traffic: tuple[RankTraffic, ...]  # per local rank

    def local_rank(self, rank: int) -> int:
        return rank % self.replica_size

    def global_rank(self, local: int, rank: int) -> int:
        """Global rank of local rank `local` in the replica of global `rank`."""
        return rank - rank % self.replica_size + local

    def peak_staging_bytes(self, local: int) -> int:
        rounds = self.rounds[local]
        return max((r.staging_numel() for r in rounds), default=0) * self.key.elem_size

    def hybridflow_bytes(self) -> float:
        """HybridFlow's per-rank traffic for zero redundancy, (d_g − 1)/(t·p) · M, with M
        the model's bytes (HF shapes, no padding)."""
        t, p = self.key.training.tp, self.key.training.pp
        d_g = micro_dp(self.key.training, self.key.generation)
        return (d_g - 1) / (t * p) * model_numel(self.key.info) * self.key.elem_size


def plan_block(training: TrainingLayout) -> int:
    """Consecutive ranks one plan covers: every dense row lives in each block of t·cp·p
    ranks, every expert in each block of etp·ep·p (megatron-core's expert mesh, ordered
    etp-ep-pp-edp); the plan's block holds both. t·cp·p for a dense model."""
    experts = training.expert_tp * training.ep * training.pp
    return math.lcm(training.replica_size, experts)


def model_numel(info: HFModelInfo) -> int:
    """Elements of the causal LM in HF shapes (a tied head counted once)."""
    return sum(math.prod(shards.hf_tensor_shape(n, info)) for n in shards.hf_row_dims(info))


# ----------------------------------------------------------------------- specs


def source_specs(key: PlanKey) -> list[list[ShardSpec]]:
    """Training shards of each local rank of one plan block."""
    size = plan_block(key.training)
    return [
        shards.megatron_specs(key.info, key.training, r, key.training_padded_vocab)
        for r in range(size)
    ]


def target_specs(key: PlanKey) -> list[list[ShardSpec]]:
    """Generation shards of each local rank of one plan block."""
    size = plan_block(key.training)
    gen = key.generation
    out = []
    for r in range(size):
        gen_tp = gen.coordinates(r)["gen_tp"]
        out.append(key.target(key.info, gen.tp, gen_tp, key.generation_padded_vocab))
    return out


def _check_key(key: PlanKey) -> None:
    block = plan_block(key.training)
    if block % key.generation.tp:
        what = "tp·pp" if block == key.training.model_parallel_size else "the plan block"
        raise ValueError(f"rollout tp {key.generation.tp} does not divide {what} = {block}")
    if block % (key.generation.tp * key.generation.tp_stride):
        raise ValueError(
            f"generation TP groups of {key.generation.tp} ranks strided by "
            f"{key.generation.tp_stride} do not fit in a plan block of {block} ranks"
        )
    if key.training.world_size != key.generation.world_size:
        raise ValueError(
            f"training world {key.training.world_size} != generation world "
            f"{key.generation.world_size}"
        )
    if key.bucket_bytes <= 0:
        raise ValueError(f"rollout.weight_sync_bucket_mb must be > 0 (got {key.bucket_bytes} B)")


# ------------------------------------------------------------------------ plan


@dataclasses.dataclass(frozen=True)
class _Holding:
    hf_start: int
    hf_end: int
    rank: int
    param: str
    offset: int  # row of hf_start inside the parameter shard
    dim: int
    row_numel: int
    slot_rows: int  # a stacked training shard: rows per slot (0: a plain tensor)


def _index_holdings(sources: list[list[ShardSpec]]) -> dict[str, list[_Holding]]:
    """HF tensor name → the row ranges of it each local rank holds, sorted by start row."""
    index: dict[str, list[_Holding]] = defaultdict(list)
    for rank, specs in enumerate(sources):
        for spec in specs:
            for span in spec.spans:
                if span.hf_name is None:
                    continue
                index[span.hf_name].append(
                    _Holding(
                        span.hf_start,
                        span.hf_start + span.length,
                        rank,
                        spec.name,
                        span.offset,
                        spec.dim,
                        spec.row_numel,
                        spec.slot_rows if spec.stack else 0,
                    )
                )
    for holdings in index.values():
        holdings.sort(key=lambda h: (h.hf_start, h.rank))
    return index


def _assign_sources(
    dst: int,
    spec: ShardSpec,
    index: dict[str, list[_Holding]],
    sent: list[int],
) -> list[Move | Fill]:
    """Moves (and fills) that fill `spec` on local rank `dst`.

    Each row comes from `dst` itself when it holds it; otherwise from the holder that has
    sent the least so far (replicated norms, tied embeddings have several holders).
    """
    out: list[Move | Fill] = []
    for span in spec.spans:
        if span.hf_name is None:
            out.append(Fill(dst, spec.name, spec.dim, span.offset, span.length, spec.row_numel))
            continue
        holdings = index.get(span.hf_name, [])
        lo, hi = span.hf_start, span.hf_start + span.length
        cuts = {lo, hi}
        for h in holdings:
            if h.hf_start < hi and h.hf_end > lo:
                cuts.update(c for c in (h.hf_start, h.hf_end) if lo < c < hi)
        points = sorted(cuts)
        for u, w in zip(points, points[1:]):
            covering = [h for h in holdings if h.hf_start <= u and h.hf_end >= w]
            if not covering:
                raise AssertionError(f"no training rank holds rows [{u}, {w}) of {span.hf_name}")
            if h_self := [h for h in covering if h.rank == dst]:
                src = h_self[0]
            else:
                src = min(covering, key=lambda h: (sent[h.rank], h.rank))
            if src.slot_rows and src.dim:
                raise AssertionError(f"{src.param}: stacked training shards split along dim 0 only")
            if src.dim != spec.dim or src.row_numel != spec.row_numel:
                raise AssertionError(
                    f"{span.hf_name}: rows run along dim {src.dim} ({src.row_numel} elements) "
                    f"in training, dim {spec.dim} ({spec.row_numel}) in {spec.name}"
                )
            move = Move(
                src.rank,
                dst,
                src.param,
                spec.name,
                spec.dim,
                src.offset + (u - src.hf_start),
                span.offset + (u - lo),
                w - u,
                spec.row_numel,
                spec.slot_rows if spec.stack else 0,
            )
            if src.rank != dst:
                sent[src.rank] += move.numel
            prev = out[-1] if out else None
            if (
                isinstance(prev, Move)
                and (prev.src, prev.src_param, prev.dst_param)
                == (move.src, move.src_param, move.dst_param)
                and prev.src_offset + prev.rows == move.src_offset
                and prev.dst_offset + prev.rows == move.dst_offset
            ):
                out[-1] = dataclasses.replace(prev, rows=prev.rows + move.rows)
            else:
                out.append(move)
    return out


def _split_rows(move: Move, max_rows: int) -> list[Move]:
    return [
        dataclasses.replace(
            move,
            src_offset=move.src_offset + i,
            dst_offset=move.dst_offset + i,
            rows=min(max_rows, move.rows - i),
        )
        for i in range(0, move.rows, max_rows)
    ]


def build_plan(key: PlanKey) -> ReshardPlan:
    """The plan for one replica (pure). See the module docstring."""
    _check_key(key)
    return _build(key, source_specs(key), target_specs(key))


def build_remote_plan(key: PlanKey) -> ReshardPlan:
    """Split placement's plan (`trainer.mode: split_async`, pure): one training plan block
    straight into one generation replica on ranks of its own.

    Local ranks 0 … B−1 are the block's training ranks (sources, nothing to write), B …
    B+t_g−1 the generation replica's TP ranks in order (targets, no sources). So every move
    is a message from a training rank to a generation rank, each row crosses once, and the
    training side holds no copy of the generation shards. Rows that several training ranks
    hold (replicated norms, TP-replicated rows) are sent by the one that has sent least so
    far, as in `build_plan`. The plan's `replica_size` is B + t_g: its `global_rank` means
    nothing here, so the executor is handed each local rank's rank (`execute(peers=...)`).
    """
    _check_key(key)
    t_g = key.generation.tp
    sources = source_specs(key)
    targets = [[] for _ in sources] + [
        key.target(key.info, t_g, r, key.generation_padded_vocab) for r in range(t_g)
    ]
    return _build(key, sources + [[] for _ in range(t_g)], targets)


def _build(
    key: PlanKey, sources: list[list[ShardSpec]], targets: list[list[ShardSpec]]
) -> ReshardPlan:
    """The plan moving `sources` (per local rank) into `targets` (per local rank; a rank
    may have none): see the module docstring."""
    size = len(sources)
    receivers = [r for r in range(size) if targets[r]]
    names = [s.name for s in targets[receivers[0]]]
    for r in receivers:
        if [s.name for s in targets[r]] != names:
            raise AssertionError(
                f"generation rank {r} has different parameters than rank {receivers[0]}"
            )
    index = _index_holdings(sources)
    sent = [0] * size

    # Model order, then rank: rounds then complete parameters roughly front to back, so
    # targets that post-process a finished parameter see them arrive in order.
    items: list[Move | Fill] = []
    for p_idx in range(len(names)):
        for dst in receivers:
            items += _assign_sources(dst, targets[dst][p_idx], index, sent)

    bucket_numel = key.bucket_bytes // key.elem_size
    rank_rounds: list[dict[int, RankRound]] = [{} for _ in range(size)]
    writes: list[dict[str, int]] = [{} for _ in range(size)]
    load = [0] * size
    current = 0

    def part(rank: int) -> RankRound:
        return rank_rounds[rank].setdefault(current, RankRound(current))

    for item in items:
        count = writes[item.dst]
        if isinstance(item, Fill) or item.src == item.dst:
            part(item.dst).writes.append(item)
            count[item.dst_param] = count.get(item.dst_param, 0) + 1
        else:
            max_rows = bucket_numel // item.row_numel
            if max_rows == 0:
                raise ValueError(
                    f"rollout.weight_sync_bucket_mb ({key.bucket_bytes} B) is smaller than one "
                    f"row of {item.dst_param} ({item.row_numel * key.elem_size} B)"
                )
            for chunk in _split_rows(item, max_rows):
                n = chunk.numel
                if load[chunk.src] + n > bucket_numel or load[chunk.dst] + n > bucket_numel:
                    current += 1
                    load = [0] * size
                load[chunk.src] += n
                load[chunk.dst] += n
                part(chunk.src).sends.setdefault(chunk.dst, []).append(chunk)
                part(chunk.dst).recvs.setdefault(chunk.src, []).append(chunk)
                count[item.dst_param] = count.get(item.dst_param, 0) + 1

    traffic = []
    for rank in range(size):
        rounds = rank_rounds[rank].values()
        sent_n = sum(m.numel for r in rounds for ms in r.sends.values() for m in ms)
        recv_n = sum(m.numel for r in rounds for ms in r.recvs.values() for m in ms)
        local_n = sum(w.numel for r in rounds for w in r.writes if isinstance(w, Move))
        fill_n = sum(w.numel for r in rounds for w in r.writes if isinstance(w, Fill))
        traffic.append(RankTraffic(sent_n, recv_n, local_n, fill_n))
    return ReshardPlan(
        key=key,
        replica_size=size,
        sources=tuple(tuple(s) for s in sources),
        targets=tuple(tuple(t) for t in targets),
        rounds=tuple(tuple(sorted(rr.values(), key=lambda r: r.index)) for rr in rank_rounds),
        writes=tuple(writes),
        num_rounds=current + 1,
        traffic=tuple(traffic),
    )
