"""One engine's weight sync: the actor's weights resharded into the engine, in place.

    weight_sync = WeightSync(VllmEngineTarget(engine), info=info, training=layout,
                             bucket_mb=config.rollout.weight_sync_bucket_mb)
    stats = weight_sync.sync(actor_chunks, version=step)      # every rank, every step

Made once per engine, with it (`trainer/build.py`), and called on every rank of the world
(SPMD). Before anything is written, the ranks agree on the plan's inputs (vocabulary
padding, dtype) and check the trainer's parameters and the target's against the plan's
shard specs (`agreement.py`); any mismatch raises on every rank, with the first rank's
reason, and leaves the engine untouched. The engine's acceptance (`begin`) is agreed on
the same way. Then the rank's compiled copy program runs (`executor.py`), and the engine
finishes the update and records `version`.

Fixed cost. Until the first copy is issued the device idles, so host work per sync adds
to every sync whatever its size. A repeated sync keeps what did not change and checks,
per tensor, only that it did not, reading each parameter's shape and placement once
(`tensor_facts.TensorFacts`) for every check — all of it state of this object, none of it
global:

* the actor's name → parameter table, while each parameter is the same object
  (`sources.SourceTable`);
* the agreed plan inputs and the plan (`agreement.PlanAgreement`: one all-reduce to agree
  and check, the engine's acceptance one more, none on one rank);
* the rank's compiled copy program, while the plan is the same;
* the copies from the rank's own shards, bound to views of their tensors while those keep
  their address, shape, strides, dtype and device (`copy_program.KeptViews`), and on a GPU
  captured into a CUDA graph on the first sync that reuses them: later syncs replay it,
  one launch instead of a multi-tensor copy's per-tensor host work.

Drop the object and all of it goes with it.

A LoRA actor (`models/lora.py`) is sent its merged weights, W + (alpha/r)·B·A for every
adapted weight (`lora_merge.LoraMerge`): the source table stays the parameter table, and
just before the sync reads it the adapted entries are replaced by merges made for this
sync and freed when it returns. Extra memory: this rank's adapted weights (plus one B·A
product), during the sync only. Such a sync binds its copies afresh every time (no kept
views, no copy graph): see `sync`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.agreement import PlanAgreement, raise_together
from rl_megatron.resharding.copy_program import CopyProgram, KeptViews, compile_program
from rl_megatron.resharding.executor import SyncStats, execute
from rl_megatron.resharding.layouts import TrainingLayout
from rl_megatron.resharding.lora_merge import LoraMerge
from rl_megatron.resharding.plan import ReshardPlan
from rl_megatron.resharding.sources import SourceTable
from rl_megatron.resharding.targets import ReshardTarget
from rl_megatron.resharding.tensor_facts import TensorFacts
from rl_megatron.resharding.verify import SyncVerifier, abort_on


class WeightSync:
    """Reshards an actor's weights into one engine's parameters, sync after sync.

    Args:
        target: the engine's parameters on this rank (`targets.py`), built on every rank.
        info: the model's HF facts (the trainer's; checked against the engine's).
        training: the training layout (t, p, d, vpp) of the chunks synced from.
        bucket_mb: `rollout.weight_sync_bucket_mb`, the per-rank cap on transfer buffers.
        group: the whole world's process group (None: the default group); transfers
            name global ranks.
        copy_graphs: issue the kept copies from the rank's own shards as CUDA graphs
            (`copy_program.KeptViews`; None: when the tensors are on a GPU).
        measure_peak: record each sync's CUDA allocator peak above its start
            (`SyncStats.device_peak_extra_bytes`; benchmarks and tests; see `execute`).
        verifier: reads the engine's parameters back after the syncs it is due on and
            compares them with what was sent (`verify.py`, `rollout.verify_sync`); None
            (`off`): nothing is read or allocated.
    """

    def __init__(
        self,
        target: ReshardTarget,
        *,
        info: HFModelInfo,
        training: TrainingLayout,
        bucket_mb: float,
        group: dist.ProcessGroup | None = None,
        copy_graphs: bool | None = None,
        measure_peak: bool = False,
        verifier: SyncVerifier | None = None,
    ) -> None:
        self.target, self.info, self.training, self.group = target, info, training, group
        self.measure_peak, self.verifier = measure_peak, verifier
        self.version: int | None = None  # training step of the last complete sync
        self._sources = SourceTable(info)
        self._merge = LoraMerge()  # a LoRA actor's adapted weights, merged per sync
        self._agreement = PlanAgreement(
            target, info=info, training=training, bucket_mb=bucket_mb, group=group
        )
        self._program: tuple[ReshardPlan, CopyProgram] | None = None
        self._facts: TensorFacts | None = None  # of the actor's parameters, last sync
        # Buffering targets get new buffers every sync: nothing to keep bound.
        self._views = None if target.buffers_params else KeptViews(graphs=copy_graphs)

    @property
    def plan(self) -> ReshardPlan | None:
        """The plan of the last sync (None before the first)."""
        return self._program[0] if self._program else None

    def sync(self, model_chunks: Sequence[torch.nn.Module], version: int) -> SyncStats:
        """Put `model_chunks`' weights into the engine as training step `version` (collective).

        Args:
            model_chunks: this rank's actor chunks (one per virtual stage; wrappers allowed);
                LoRA adapters in them are merged into the weights sent (module docstring).
            version: training step of these weights; recorded by the engine.
        Returns:
            this rank's `SyncStats` (`prepare_s`, `begin_s`, `wall_s`, `finish_s`: host time
            of each phase).
        """
        rank = dist.get_rank()
        t0 = time.perf_counter()
        table = self._sources(model_chunks)
        # With adapters: the same names, each adapted weight W + (alpha/r)·B·A, new tensors
        # that live until this call returns (the copies and the verifier read them).
        sources = self._merge(model_chunks, table)
        # Kept views are bound to the addresses of the tensors they view and hold those
        # tensors alive: views of this sync's merges would keep them (the adapted weights'
        # bytes) between syncs, and could never be reused, as the next sync's merges are
        # new tensors at other addresses (a graph replaying them would read freed memory,
        # were the views not holding it). So a merged sync binds its copies afresh, the
        # pre-`KeptViews` path: a Python loop over the program's ops, small beside the
        # merges' products and allocations, which every such sync pays anyway.
        views = self._views if sources is table else None
        # Read once (or the last sync's, if a C++ check says they hold), for the agreement
        # and the kept views alike.
        facts = self._facts = TensorFacts.of(sources, self._facts)
        plan = self._agreement.agree(sources, facts)
        program = self._program_of(plan, rank)
        t1 = time.perf_counter()
        self._begin(version, rank)
        self.version = None  # the engine holds a partial update until it finishes
        t2 = time.perf_counter()
        try:
            stats = execute(
                plan,
                program,
                rank,
                sources,
                self.target,
                views=views,
                source_facts=facts,
                group=self.group,
                measure_peak=self.measure_peak,
            )
        except BaseException as exc:
            self.target.abort(f"transfer failed: {exc}")
            raise
        t3 = time.perf_counter()
        self.target.finish()
        self.version = version
        stats.prepare_s, stats.begin_s, stats.finish_s = t1 - t0, t2 - t1, time.perf_counter() - t3
        stats.target_staging_bytes = self.target.staging_peak_bytes()
        stats.lora_merged_bytes = self._merge.merged_bytes
        if self.verifier is not None and self.verifier.due():
            stats.verify, problem = self.verifier.verify(plan, rank, sources, group=self.group)
            if problem is not None:
                self.version = None
                abort_on(problem, self.target)  # raises: the run stops before generating
        return stats

    def _program_of(self, plan: ReshardPlan, rank: int) -> CopyProgram:
        """This rank's compiled program of `plan` (compiled when the plan changes)."""
        if self._program is None or self._program[0] is not plan:
            local = plan.local_rank(rank)
            per_param = self.target.buffers_params
            self._program = (plan, compile_program(plan, local, per_param=per_param))
        return self._program[1]

    def _begin(self, version: int, rank: int) -> None:
        """The engine begins the update on every rank, or on none (one all-reduce)."""
        refused = []
        try:
            self.target.begin(version)
        except (RuntimeError, ValueError) as exc:  # asleep, older version, ...
            refused.append(f"the engine refused the update: {exc}")
        try:
            raise_together(refused, rank, self.group)
        except ValueError:
            if not refused:
                self.version = None
                self.target.abort("another rank's engine refused the update")
            raise
