"""Training and generation layouts as small frozen dataclasses (rank arithmetic lives here).

Training layout: Megatron's (tp, pp, dp, cp), ranks ordered tp fastest, then cp, then pp,
then dp (`order="tp-cp-ep-pp-dp"`), so each training data-parallel replica is one block of
tp·cp·pp consecutive ranks.

Generation layout: tp_g-sized tensor-parallel groups of consecutive ranks (how vLLM's
in-process engine forms them), PP = 1. A training replica of tp·pp ranks holds
`micro_dp = tp·pp / tp_g` generation replicas (HybridFlow's micro-DP groups, arXiv
2409.19256 §5), each of which must end up holding every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON_RANK_ORDER = "tp-cp-ep-pp-dp"


@dataclass(frozen=True)
class TrainingLayout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    vpp: int | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def coordinates(self, rank: int) -> dict[str, int]:
        """(tp, cp, pp, dp) ranks of a global rank, in MEGATRON_RANK_ORDER."""
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        pp_rank = (rank // (self.tp * self.cp)) % self.pp
        dp_rank = rank // (self.tp * self.cp * self.pp)
        return {"tp": tp_rank, "cp": cp_rank, "pp": pp_rank, "dp": dp_rank}


@dataclass(frozen=True)
class GenerationLayout:
    tp: int  # t_g
    world_size: int
    # 1: TP groups are blocks of t_g consecutive ranks (vLLM's in-process engine).
    # s > 1: TP groups strided by s inside blocks of t_g·s consecutive ranks, so that with
    # s = t/t_g each rank's training shard is a slice of its generation shard (HybridFlow
    # §5); realisable only by an engine whose TP groups we create ourselves.
    tp_stride: int = 1

    @property
    def replicas(self) -> int:
        """Generation data-parallel size over the whole world."""
        return self.world_size // self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        block, offset = divmod(rank, self.tp * self.tp_stride)
        return {
            "gen_tp": offset // self.tp_stride,
            "gen_dp": block * self.tp_stride + offset % self.tp_stride,
        }

    def tp_group(self, rank: int) -> list[int]:
        """The global ranks of `rank`'s generation TP group, in gen_tp order."""
        block_start = rank - rank % (self.tp * self.tp_stride)
        first = block_start + rank % self.tp_stride
        return [first + i * self.tp_stride for i in range(self.tp)]


def generation_layout_for(training: TrainingLayout, rollout_tp: int) -> GenerationLayout:
    """The generation layout paired with a training layout; checks t_g divides tp·pp."""
    model_parallel = training.tp * training.pp
    if model_parallel % rollout_tp:
        raise ValueError(f"rollout tp {rollout_tp} does not divide tp·pp = {model_parallel}")
    if training.cp != 1:
        raise ValueError("generation from a context-parallel training layout is not supported")
    return GenerationLayout(tp=rollout_tp, world_size=training.world_size)


def hybridflow_generation_layout(training: TrainingLayout, rollout_tp: int) -> GenerationLayout:
    """HybridFlow's zero-redundancy layout (arXiv 2409.19256 §5): when t_g divides t,
    generation TP groups strided by t/t_g inside each training TP group; otherwise the
    consecutive layout (no strided layout puts a training shard inside a generation one).
    """
    plain = generation_layout_for(training, rollout_tp)
    if training.tp % rollout_tp:
        return plain
    return GenerationLayout(rollout_tp, plain.world_size, tp_stride=training.tp // rollout_tp)


def micro_dp(training: TrainingLayout, generation: GenerationLayout) -> int:
    """Generation replicas per training replica: d_g = tp·pp / t_g."""
    return training.tp * training.pp // generation.tp
