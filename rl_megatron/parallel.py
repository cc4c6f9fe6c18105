"""The run's parallel layout: one object, built once from the config and the world size.

    layout = ParallelLayout.from_config(config.parallel, world_size)   # checks, one-line errors
    groups = ParallelGroups.from_megatron(layout, rank)                # after initialize_model_parallel

`ParallelLayout` holds the degrees (tp, pp, vpp, dp, cp, ep, etp) and sequence parallelism,
and answers every question of rank arithmetic the rest of the package asks: a rank's
coordinates, a replica's ranks, the sizes that losses are normalised and gradients averaged
over, the divisor of sequence lengths. `ParallelGroups` holds the process groups
megatron-core created for it (checked against the layout's own arithmetic), and is what
code that communicates is given. Nothing else recomputes either.

Ranks are ordered `tp-cp-ep-pp-dp` (tp fastest; `MEGATRON_RANK_ORDER`), so each training
data-parallel replica is one block of tp·cp·pp consecutive ranks: vLLM's generation TP
groups (blocks of consecutive ranks) then always fall inside one replica.

On the ground floor of the package: imports nothing of rl_megatron but the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from rl_megatron.config_io import ConfigError

MEGATRON_RANK_ORDER = "tp-cp-ep-pp-dp"


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def check_degrees(p) -> None:
    """The degrees of `p` (a `ParallelConfig`) on their own; ConfigError naming the key."""
    for key in ("tp", "pp", "cp", "ep"):
        value = getattr(p, key)
        _require(value >= 1, f"parallel.{key}", f"must be >= 1, got {value}")
    _require(
        p.cp == 1,
        "parallel.cp",
        f"context parallelism is not supported yet; set it to 1 (got {p.cp})",
    )
    _require(
        p.ep == 1,
        "parallel.ep",
        f"expert parallelism needs an MoE model; none is supported yet (got {p.ep})",
    )
    if p.vpp is not None:
        _require(p.vpp >= 2, "parallel.vpp", f"must be >= 2 or null, got {p.vpp}")
        _require(p.pp >= 2, "parallel.vpp", "interleaved pipelining needs parallel.pp >= 2")
    _require(
        not p.sequence_parallel or p.tp > 1,
        "parallel.sequence_parallel",
        "needs parallel.tp > 1",
    )


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism of a training run, and the rank arithmetic they imply.

    tp, pp, dp, cp: tensor, pipeline, data and context parallel sizes
        (tp·cp·pp·dp = world size); vpp: virtual pipeline chunks per stage (None = off);
    ep, etp: expert-parallel and expert-tensor-parallel sizes (MoE layers only; etp None
        = tp, as megatron-core's default); sequence_parallel: activations outside the
        tensor-parallel regions split over tp.
    """

    tp: int
    pp: int
    dp: int
    cp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False

    @classmethod
    def from_config(cls, parallel, world_size: int) -> ParallelLayout:
        """The layout of `parallel` (a `ParallelConfig`) on `world_size` ranks.

        Raises ConfigError (one line naming the key) for what no model could run.
        """
        p = parallel
        check_degrees(p)
        replica = p.tp * p.pp * p.cp
        _require(
            world_size % replica == 0,
            "parallel",
            f"world size {world_size} is not divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp}",
        )
        return cls(
            tp=p.tp,
            pp=p.pp,
            dp=world_size // replica,
            cp=p.cp,
            vpp=p.vpp,
            ep=p.ep,
            sequence_parallel=p.sequence_parallel,
        )

    # ---- sizes ------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica (tp·cp·pp): they hold the same rows."""
        return self.tp * self.cp * self.pp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one copy of the weights (tp·pp)."""
        return self.tp * self.pp

    @property
    def grad_dp(self) -> int:
        """Ranks a gradient is averaged over (megatron-core's data-parallel group with
        context parallelism: dp·cp)."""
        return self.dp * self.cp

    @property
    def sequence_divisor(self) -> int:
        """Sequence lengths are padded to a multiple of this: tp with sequence
        parallelism (each rank takes a slice), 2·cp with context parallelism (each rank
        takes two chunks, for causal load balance)."""
        return (self.tp if self.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    # ---- ranks ------------------------------------------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """(tp, cp, pp, dp) ranks of a global rank, in MEGATRON_RANK_ORDER."""
        return {
            "tp": rank % self.tp,
            "cp": (rank // self.tp) % self.cp,
            "pp": (rank // (self.tp * self.cp)) % self.pp,
            "dp": rank // self.replica_size,
        }

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """The global ranks of data-parallel replica `dp_rank` (consecutive)."""
        start = dp_rank * self.replica_size
        return list(range(start, start + self.replica_size))

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp} ep={self.ep} vpp={self.vpp}"


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of a layout, as megatron-core created them; passed explicitly
    to every collective of ours.

    tp, pp, cp: this rank's groups; dp: data parallel without context parallelism (the
    replicas: losses are normalised and rows shared over it); dp_cp: with it (gradients);
    replica: the ranks of this rank's replica (tp·cp·pp; the same rows, the same rewards);
    pp_first_rank, pp_last_rank: global ranks of this pipeline's first and last stage.
    """

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    replica: dist.ProcessGroup
    pp_first_rank: int
    pp_last_rank: int

    @property
    def pp_size(self) -> int:
        return dist.get_world_size(self.pp)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp)

    @property
    def is_pp_last(self) -> bool:
        return dist.get_rank() == self.pp_last_rank

    @classmethod
    def from_megatron(cls, layout: ParallelLayout | None = None) -> ParallelGroups:
        """megatron-core's groups of the current `initialize_model_parallel`.

        With `layout`, this rank's coordinates in megatron-core's groups must be the
        layout's own (a mismatch is an internal bug, not the user's).
        """
        from megatron.core import parallel_state as ps

        if layout is not None:
            theirs = {
                "tp": ps.get_tensor_model_parallel_rank(),
                "cp": ps.get_context_parallel_rank(),
                "pp": ps.get_pipeline_model_parallel_rank(),
                "dp": ps.get_data_parallel_rank(),
            }
            ours = layout.coordinates(dist.get_rank())
            if theirs != ours:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: layout {ours} != megatron-core's {theirs}"
                )
        # megatron-core's model-parallel group (tp·pp) is a replica while cp = 1, which
        # `from_config` requires until context parallelism is supported.
        replica = ps.get_model_parallel_group()
        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp=ps.get_data_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            replica=replica,
            pp_first_rank=ps.get_pipeline_model_parallel_first_rank(),
            pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        )
