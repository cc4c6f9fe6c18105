"""Before a weight sync writes anything: agree on its inputs, check both sides, refuse together.

The plan depends on values that not every rank knows alone: the training padded vocabulary
(middle pipeline stages hold no embedding), the engine's, and the element size. Every rank
then checks its training shards and its target's parameters against the plan's shard
specs, and if any rank finds a problem, every rank raises, with its own reason or a
pointer to the rank that has one, before anything is written.

Done plainly that is three blocking collectives per sync (MAX, MIN, then refuse
together), each a host wait while the device idles. Here each rank guesses the agreed
values (its own, or the last agreed for what it lacks), checks against the plan of its
guess, and sends one all-reduce holding its values, its guess (as MAX and MIN) and
whether it found a problem. When every rank's guess is the agreed values, every rank has
checked against the right plan: the one all-reduce decides. Only when a guess was wrong
(the first sync of a pipeline with middle stages, or inputs that disagree) does a second
all-reduce follow, on the checks against the agreed plan. With one rank there is nothing
to agree on and no collective. The checks themselves run on every sync, not only when
something looks changed: for 99 tensors they cost ~0.1 ms of host time, about what a
fingerprint of their inputs would, and they stay right whatever changed (an engine's
weights reloaded, a trainer's parameters replaced). For the 2k parameters of an MoE actor
holding one tensor per expert they are one list comparison: the shapes read once per
sync (`tensor_facts.TensorFacts`, shared with the copy views' check) against the plan's,
listed in the same order once per plan and source table (`ShapesInOrder`).

A `PlanAgreement` belongs to one weight sync (`weight_sync.py`): it keeps the last agreed
values (what each rank guesses) and the plan built for them, which later syncs reuse as
long as the agreed inputs do not change.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.layouts import TrainingLayout
from rl_megatron.resharding.plan import PlanKey, ReshardPlan, build_plan
from rl_megatron.resharding.shards import check_tensors, spec_shapes
from rl_megatron.resharding.targets import ReshardTarget
from rl_megatron.resharding.tensor_facts import ShapesInOrder, TensorFacts

MIB = 1 << 20  # the unit of `rollout.weight_sync_bucket_mb`


def all_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Element-wise MAX of small integers over `group` (a MIN is the MAX of negated values)."""
    if dist.get_world_size(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        # From pinned memory the host does not wait for the copy; it waits once, for the
        # result.
        t = t.pin_memory().cuda(non_blocking=True)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def refuse(problems: list[str], rank: int, failing: bool) -> None:
    """Raise if `failing` (some rank found a problem); each rank names its own or the first."""
    if not failing:
        return
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"weight sync refused on rank {rank}: {problems[0]}{more}")
    raise ValueError("weight sync refused: another rank found a mismatch (see its error)")


def raise_together(problems: list[str], rank: int, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank found a problem (one all-reduce)."""
    refuse(problems, rank, bool(all_max([1 if problems else 0], group)[0]))


def padded_vocab_of(sources: Mapping[str, torch.Tensor], tp: int) -> int:
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in sources:
            return sources[name].shape[0] * tp
    return 0


class PlanAgreement:
    """The plan of one weight sync into `target`, agreed on by every rank before each sync.

    Args:
        target: the engine's parameters on this rank (its layout, vocabulary and checks).
        info: the model's HF facts (the trainer's; checked against the engine's).
        training: the training layout of the parameters synced from.
        bucket_mb: `rollout.weight_sync_bucket_mb`, the per-rank cap on transfer buffers.
        group: the whole world's process group (None: the default group).
    """

    def __init__(
        self,
        target: ReshardTarget,
        *,
        info: HFModelInfo,
        training: TrainingLayout,
        bucket_mb: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.target, self.info, self.training, self.group = target, info, training, group
        self.bucket_bytes = int(bucket_mb * MIB)
        # The last agreed (training padded vocabulary, engine padded vocabulary, element
        # size): a rank guesses it for what it does not hold itself. A stale guess costs one
        # more all-reduce, never a wrong plan: guesses are checked against the agreed values.
        self.agreed = [0, 0, 0]
        self.plan: ReshardPlan | None = None  # the plan of the last key asked for
        # (plan, local rank, name → shape of the rank's training shards, of its target
        # shards, the former in the sources' order): both sides are checked against them
        # every sync, built once per plan.
        self._shapes: tuple[ReshardPlan, int, dict, dict, ShapesInOrder] | None = None

    def _key(self, values: list[int]) -> PlanKey:
        return PlanKey(
            info=self.info,
            training=self.training,
            generation=self.target.layout,
            target=self.target.shard_specs,
            training_padded_vocab=values[0],
            generation_padded_vocab=values[1],
            bucket_bytes=self.bucket_bytes,
            elem_size=values[2],
        )

    def _checked(
        self, key: PlanKey, rank: int, sources: Mapping[str, torch.Tensor], facts: TensorFacts
    ) -> tuple[ReshardPlan | None, list[str]]:
        """The plan of `key` and this rank's problems with it (trainer's side, then target's)."""
        if self.plan is None or self.plan.key != key:
            try:
                self.plan = build_plan(key)
            except ValueError as exc:
                return None, [str(exc)]
        plan = self.plan
        local = plan.local_rank(rank)
        kept = self._shapes
        if kept is None or kept[0] is not plan or kept[1] != local:
            sides = (spec_shapes(plan.sources[local]), spec_shapes(plan.targets[local]))
            kept = self._shapes = (plan, local, *sides, ShapesInOrder(sides[0]))
        # The common case, every shape the plan's, is one list comparison; otherwise the
        # full check says what differs.
        problems = [] if kept[4].match(facts) else check_tensors(kept[2], sources, "trainer")
        return plan, problems + self.target.check(kept[3], self.info)

    def agree(
        self, sources: Mapping[str, torch.Tensor], facts: TensorFacts | None = None
    ) -> ReshardPlan:
        """Agree on the plan's inputs, build it (or keep the last), check both sides against it.

        sources: this rank's training parameters by name (`sources.py`).
        facts: `TensorFacts.of(sources)`, if the caller has read them (None: read here).
        Collective over `group` (one all-reduce when the guesses hold, two otherwise, none
        for one rank); raises on every rank, before anything is written, when the
        trainer's parameters, the target's parameters or the configs disagree with the plan.
        """
        rank = dist.get_rank()
        facts = facts if facts is not None else TensorFacts.of(sources)
        dtypes = facts.dtypes
        own = []  # problems found before any plan
        if len(dtypes) > 1:
            own.append(f"training parameters mix dtypes {sorted(map(str, dtypes))}")
        elem = next(iter(sources.values())).element_size() if sources else 0
        mine = [padded_vocab_of(sources, self.training.tp), self.target.padded_vocab(), elem]
        # The engine's vocabulary is never guessed: every rank must report one, and equal.
        guess = [mine[0] or self.agreed[0], mine[1], mine[2] or self.agreed[2]]

        plan, checked = (None, []) if own else self._checked(self._key(guess), rank, sources, facts)
        reduced = all_max(
            [*mine, -mine[1], *guess, *(-g for g in guess), 1 if own or checked else 0],
            self.group,
        )
        high, low_engine_vocab = reduced[:3], -reduced[3]
        guesses_high, guesses_low = reduced[4:7], [-g for g in reduced[7:10]]
        self.agreed = high
        if guesses_high == guesses_low == high:
            # Every rank checked against the agreed plan, and the values agree (a rank whose
            # own value differed would have guessed it).
            refuse(own or checked, rank, bool(reduced[10]))
            assert plan is not None
            return plan
        problems = own
        # Middle pipeline stages hold no vocabulary (0); everyone else must agree.
        if mine[0] and mine[0] != high[0]:
            problems.append(f"training padded vocabulary {mine[0]} != another rank's {high[0]}")
        if low_engine_vocab != high[1]:
            problems.append(
                f"engine padded vocabularies differ across ranks ({low_engine_vocab}…{high[1]})"
            )
        if elem and elem != high[2]:
            problems.append(f"training dtype has {elem}-byte elements, another rank {high[2]}")
        if not problems and guess != high:
            plan, checked = self._checked(self._key(high), rank, sources, facts)
        raise_together(problems or checked, rank, self.group)
        assert plan is not None
        return plan
