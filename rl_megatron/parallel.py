"""The run's parallel layout: one object, built once from the config and the world size.

    layout = ParallelLayout.from_config(config.parallel, world_size)   # checks, one-line errors
    groups = ParallelGroups.from_megatron(layout)    # after distributed.init_megatron(layout)

`distributed.distributed_run` builds both once (`run.layout`, `run.groups`) and every
consumer is handed them: model builders, roles, checkpoints, exports, the launch line.
Nothing outside this module and `distributed.py` reads megatron-core's `parallel_state`
(tests/unit/test_parallel_context.py fails on it).

`ParallelLayout` holds the degrees (tp, pp, vpp, dp, cp, ep, etp) and sequence parallelism,
and answers every question of rank arithmetic the rest of the package asks: a rank's
coordinates, a replica's ranks, the sizes that losses are normalised and gradients averaged
over, the divisor of sequence lengths, the pipeline stages a rank's chunks are, the record
a checkpoint keeps of it. `ParallelGroups` holds the process groups
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
    for key in ("tp", "pp", "cp", "ep", "etp"):
        value = getattr(p, key)
        _require(value >= 1, f"parallel.{key}", f"must be >= 1, got {value}")
    if p.vpp is not None:
        _require(p.vpp >= 2, "parallel.vpp", f"must be >= 2 or null, got {p.vpp}")
        _require(p.pp >= 2, "parallel.vpp", "interleaved pipelining needs parallel.pp >= 2")
    _require(
        not p.sequence_parallel or p.tp > 1,
        "parallel.sequence_parallel",
        "needs parallel.tp > 1",
    )


def _check_expert_degrees(p, world_size: int) -> None:
    """What megatron-core's expert groups need (`initialize_model_parallel`): the experts'
    own mesh etp·ep·pp·edp covers the world, and with the rank order tp-cp-ep-pp-dp (not
    pp last) and pp > 1 its pipeline groups are the attention's only when etp·ep = tp·cp."""
    mesh = p.etp * p.ep * p.pp
    _require(
        world_size % mesh == 0,
        "parallel.ep",
        f"world size {world_size} is not divisible by etp·ep·pp = {p.etp}·{p.ep}·{p.pp} "
        "(megatron-core's expert mesh)",
    )
    _require(
        p.pp == 1 or p.etp * p.ep == p.tp * p.cp,
        "parallel.ep",
        f"with parallel.pp={p.pp} > 1 megatron-core needs etp·ep = tp·cp (rank order "
        f"{MEGATRON_RANK_ORDER}); got etp·ep = {p.etp}·{p.ep}, tp·cp = {p.tp}·{p.cp}",
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
    def from_config(cls, parallel, world_size: int, moe: bool = False) -> ParallelLayout:
        """The layout of `parallel` (a `ParallelConfig`) on `world_size` ranks.

        Raises ConfigError (one line naming the key) for what no model could run.

        moe: the model has experts. Without experts ep and etp must be 1 and the expert
            groups megatron-core makes anyway take its defaults (etp = tp), which never
            constrain the layout.
        """
        p = parallel
        check_degrees(p)
        replica = p.tp * p.pp * p.cp
        _require(
            world_size % replica == 0,
            "parallel",
            f"world size {world_size} is not divisible by tp·pp·cp = {p.tp}·{p.pp}·{p.cp}",
        )
        if moe:
            _check_expert_degrees(p, world_size)
        else:
            for key in ("ep", "etp"):
                _require(
                    getattr(p, key) == 1,
                    f"parallel.{key}",
                    f"splits the experts of an MoE model; this model has none (got "
                    f"{getattr(p, key)}), set it to 1",
                )
        return cls(
            tp=p.tp,
            pp=p.pp,
            dp=world_size // replica,
            cp=p.cp,
            vpp=p.vpp,
            ep=p.ep,
            etp=p.etp if moe else None,
            sequence_parallel=p.sequence_parallel,
        )

    @classmethod
    def from_megatron(cls, sequence_parallel: bool = False) -> ParallelLayout:
        """The layout megatron-core's `initialize_model_parallel` was called at, for code
        that initialised it by hand (tests, benchmarks); a run takes `run.layout` instead.
        Sequence parallelism is not megatron-core's to know: the caller says. megatron-core
        must use our rank order (`MEGATRON_RANK_ORDER`): the layout's arithmetic is checked
        against its coordinates."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        cp = ps.get_context_parallel_world_size()
        layout = cls(
            tp=tp,
            pp=pp,
            dp=dist.get_world_size() // (tp * pp * cp),
            cp=cp,
            vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            sequence_parallel=sequence_parallel,
        )
        _check_coordinates(layout)
        return layout

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
    def cp_chunks(self) -> int:
        """Chunks context parallelism cuts each sequence into: 2·cp (each rank takes two,
        for causal load balance), 1 without it; a packed row's own length is padded to it."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def sequence_divisor(self) -> int:
        """Sequence lengths are padded to a multiple of this: tp with sequence
        parallelism (each rank takes a slice) times `cp_chunks`."""
        return (self.tp if self.sequence_parallel else 1) * self.cp_chunks

    @property
    def expert_tp(self) -> int:
        """The expert-TP size megatron-core is given. A dense model (etp None) has no
        experts, but megatron-core builds their groups anyway and, with our rank order and
        pp > 1, needs their DP size to equal the attention's (etp·ep = tp·cp): they span
        tp·cp ranks, which is tp without context parallelism (its own default)."""
        return self.tp * self.cp if self.etp is None else self.etp

    # ---- ranks ------------------------------------------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """(tp, cp, pp, dp) ranks of a global rank, in MEGATRON_RANK_ORDER."""
        return {
            "tp": rank % self.tp,
            "cp": (rank // self.tp) % self.cp,
            "pp": (rank // (self.tp * self.cp)) % self.pp,
            "dp": rank // self.replica_size,
        }

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """(etp, ep, edp) ranks of a global rank in megatron-core's expert mesh, which orders
        etp-ep-pp-edp as MEGATRON_RANK_ORDER orders tp-cp-pp-dp (cp has no expert twin)."""
        etp = self.expert_tp
        return {
            "etp": rank % etp,
            "ep": (rank // etp) % self.ep,
            "edp": rank // (etp * self.ep * self.pp),
        }

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """The global ranks of data-parallel replica `dp_rank` (consecutive)."""
        start = dp_rank * self.replica_size
        return list(range(start, start + self.replica_size))

    def is_first_stage(self, rank: int, vp_stage: int | None = None) -> bool:
        """Whether chunk `vp_stage` (None: no VPP) of `rank` is the pipeline's first stage
        (it embeds the tokens): pipeline rank 0, and its first virtual chunk."""
        return self.coordinates(rank)["pp"] == 0 and not vp_stage

    def is_last_stage(self, rank: int, vp_stage: int | None = None) -> bool:
        """Whether chunk `vp_stage` (None: no VPP) of `rank` is the pipeline's last stage
        (it holds the output layer): the last pipeline rank, and its last virtual chunk."""
        last_chunk = vp_stage is None or vp_stage == (self.vpp or 1) - 1
        return self.coordinates(rank)["pp"] == self.pp - 1 and last_chunk

    def record(self) -> dict:
        """Every degree, as a checkpoint records it (`state_checks`) and the launch line
        shows it. etp is what megatron-core's expert mesh is given (`expert_tp`: tp·cp
        for a dense model, never None), as checkpoints have recorded it."""
        return {
            "world_size": self.world_size,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "dp": self.dp,
            "cp": self.cp,
            "ep": self.ep,
            "etp": self.expert_tp,
            "sequence_parallel": self.sequence_parallel,
        }

    def describe(self) -> str:
        """`tp=2 pp=1 dp=2 cp=1 ep=1 etp=2 vpp=None sp=off`: every degree, one line."""
        r = self.record()
        sp = "on" if self.sequence_parallel else "off"
        return " ".join(f"{k}={r[k]}" for k in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp")) + (
            f" sp={sp}"
        )


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of a layout, as megatron-core created them; passed explicitly
    to every collective of ours.

    layout: the layout they are the groups of (its sizes: `grad_dp`, `sequence_divisor`);
    tp, pp, cp: this rank's groups; dp: data parallel without context parallelism (the
    replicas: losses are normalised and rows shared over it); dp_cp: with it (gradients);
    replica: the ranks of this rank's replica (tp·cp·pp; the same rows, the same rewards);
    pp_first_rank, pp_last_rank: global ranks of this pipeline's first and last stage;
    ep, etp, expert_dp: the expert-parallel, expert-tensor-parallel and expert-data-parallel
    groups (MoE layers: tokens are exchanged over ep, an expert's weights split over etp,
    its gradients reduced over expert_dp by megatron-core's DDP).
    """

    layout: ParallelLayout
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    replica: dist.ProcessGroup
    pp_first_rank: int
    pp_last_rank: int
    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    expert_dp: dist.ProcessGroup | None = None
    # etp·ep ranks that exchange tokens in every MoE forward (megatron-core's expert
    # tensor-and-model-parallel group): a decode's forwards must match across it.
    expert_model: dist.ProcessGroup | None = None

    @property
    def is_pp_last(self) -> bool:
        return dist.get_rank() == self.pp_last_rank

    @classmethod
    def from_megatron(cls, layout: ParallelLayout | None = None) -> ParallelGroups:
        """megatron-core's groups of the current `initialize_model_parallel`, at `layout`
        (a run's; None: read from megatron-core, `ParallelLayout.from_megatron`). This
        rank's coordinates in them must be the layout's own (`_check_coordinates`).
        """
        from megatron.core import parallel_state as ps

        if layout is None:
            layout = ParallelLayout.from_megatron()
        _check_coordinates(layout)
        # megatron-core's model-parallel group (tp·pp) is a replica while cp = 1; with
        # context parallelism a replica is tp·cp·pp ranks, a group megatron-core does not
        # make (its rank order puts them in one block: MEGATRON_RANK_ORDER).
        replica = ps.get_model_parallel_group()
        if ps.get_context_parallel_world_size() > 1:
            replica = _replica_group(ps.get_data_parallel_world_size())
        return cls(
            layout=layout,
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp=ps.get_data_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            replica=replica,
            pp_first_rank=ps.get_pipeline_model_parallel_first_rank(),
            pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
            ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
            expert_dp=ps.get_expert_data_parallel_group(),
            expert_model=ps.get_expert_tensor_and_model_parallel_group(),
        )


def _check_coordinates(layout: ParallelLayout) -> None:
    """This rank's coordinates in megatron-core's groups are the layout's own: a mismatch
    (megatron-core initialised in another rank order) is an internal bug, not the user's."""
    from megatron.core import parallel_state as ps

    theirs = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }
    ours = layout.coordinates(dist.get_rank())
    if layout.etp is not None:  # an MoE layout: its expert mesh too
        theirs.update(
            etp=ps.get_expert_tensor_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
            edp=ps.get_expert_data_parallel_rank(),
        )
        ours.update(layout.expert_coordinates(dist.get_rank()))
    if theirs != ours:
        raise RuntimeError(
            f"rank {dist.get_rank()}: layout {ours} != megatron-core's {theirs} (rank order "
            f"{MEGATRON_RANK_ORDER}?)"
        )


def _replica_group(dp: int) -> dist.ProcessGroup:
    """This rank's replica, one block of world/dp consecutive ranks (`MEGATRON_RANK_ORDER`);
    collective: every rank creates every replica's group, in order."""
    size = dist.get_world_size() // dp
    mine = None
    for k in range(dp):
        group = dist.new_group(list(range(k * size, (k + 1) * size)))
        if k == dist.get_rank() // size:
            mine = group
    return mine
