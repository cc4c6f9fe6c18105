"""Generation layouts, paired with the training layout (`rl_megatron.parallel.ParallelLayout`).

Training layout: the run's `ParallelLayout` (ranks ordered tp fastest, then cp, then pp,
then dp, so each training data-parallel replica is one block of tp·cp·pp consecutive ranks).

Generation layout: tp_g-sized tensor-parallel groups of consecutive ranks (how vLLM's
in-process engine forms them), PP = 1. A training replica (tp·cp·pp ranks, with cp = 1
wherever generation runs: `generation_layout_for` refuses context parallelism) holds
`micro_dp = tp·pp / tp_g` generation replicas (HybridFlow's micro-DP groups, arXiv
2409.19256 §5), each of which must end up holding every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout

__all__ = [
    "MEGATRON_RANK_ORDER",
    "GenerationLayout",
    "TrainingLayout",
    "format_layout_table",
    "generation_layout_for",
    "hybridflow_generation_layout",
    "micro_dp",
]

# The training side of a resharding pair is the run's own layout (`rl_megatron.parallel`).
TrainingLayout = ParallelLayout


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
    model_parallel = training.model_parallel_size
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
    return training.model_parallel_size // generation.tp


def format_layout_table(rows: list[dict], generation: GenerationLayout) -> str:
    """One line per rank: node, training coordinates, generation coordinates."""
    header = f"{'rank':>5} {'node':<20} {'tp':>3} {'pp':>3} {'dp':>3} {'cp':>3} | {'gen_tp':>6} {'gen_dp':>6}"
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: r["rank"]):
        gen = generation.coordinates(row["rank"])
        lines.append(
            f"{row['rank']:>5} {row['node'][:20]:<20} {row['tp']:>3} {row['pp']:>3} "
            f"{row['dp']:>3} {row['cp']:>3} | {gen['gen_tp']:>6} {gen['gen_dp']:>6}"
        )
    return "\n".join(lines)
