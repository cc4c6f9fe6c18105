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
weights reloaded, a trainer's parameters replaced).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.layouts import GenerationLayout, TrainingLayout
from rl_megatron.resharding.plan import PlanKey, ReshardPlan, build_plan
from rl_megatron.resharding.shards import ShardSpec

MIB = 1 << 20


class CheckedTarget(Protocol):
    """The part of `targets.ReshardTarget` that the agreement reads."""

    kind: str
    layout: GenerationLayout

    def padded_vocab(self) -> int: ...

    def check(self, specs: Sequence[ShardSpec], info: HFModelInfo) -> list[str]: ...


def check_tensors(specs: Sequence[ShardSpec], tensors: Mapping[str, Any], what: str) -> list[str]:
    """Problems (one line each) if `tensors` (name → tensor or shape) do not match `specs`."""
    problems = []
    want = {s.name: s.shape for s in specs}
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"{what} lacks parameter '{name}' (plan shape {list(shape)})")
            continue
        have = tuple(getattr(tensors[name], "shape", tensors[name]))
        if have != tuple(shape):
            problems.append(f"{what} '{name}' has shape {list(have)}, the plan {list(shape)}")
    problems += [
        f"{what} parameter '{name}' is not in the plan" for name in tensors if name not in want
    ]
    return problems


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


def _padded_vocab_of(sources: Mapping[str, torch.Tensor], tp: int) -> int:
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in sources:
            return sources[name].shape[0] * tp
    return 0


# The last agreed (training padded vocabulary, engine padded vocabulary, element size):
# a rank guesses it for what it does not hold itself. A stale guess costs one more
# all-reduce, never a wrong plan: guesses are checked against the agreed values.
_last_agreed = [0, 0, 0]


def _checked(
    key: PlanKey, rank: int, sources, target: CheckedTarget, info: HFModelInfo
) -> tuple[ReshardPlan | None, list[str]]:
    """The plan of `key` and this rank's problems with it (trainer's side, then target's)."""
    try:
        plan = build_plan(key)
    except ValueError as exc:
        return None, [str(exc)]
    local = plan.local_rank(rank)
    problems = check_tensors(plan.sources[local], sources, "trainer")
    return plan, problems + target.check(plan.targets[local], info)


def prepare_plan(
    sources: Mapping[str, torch.Tensor],
    target: CheckedTarget,
    *,
    info: HFModelInfo,
    training: TrainingLayout,
    bucket_mb: float,
    group: dist.ProcessGroup | None = None,
) -> ReshardPlan:
    """Agree on the plan's inputs, build (or fetch) it, and check both sides against it.

    Collective over `group` (one all-reduce when the guesses hold, two otherwise, none
    for one rank); raises on every rank, before anything is written, when the trainer's
    parameters, the target's parameters or the configs disagree with the plan.
    """
    rank = dist.get_rank()
    dtypes = {t.dtype for t in sources.values()}
    own = []  # problems found before any plan
    if len(dtypes) > 1:
        own.append(f"training parameters mix dtypes {sorted(map(str, dtypes))}")
    elem = next(iter(sources.values())).element_size() if sources else 0
    mine = [_padded_vocab_of(sources, training.tp), target.padded_vocab(), elem]
    # The engine's vocabulary is never guessed: every rank must report one, and equal.
    guess = [mine[0] or _last_agreed[0], mine[1], mine[2] or _last_agreed[2]]

    def key(values: list[int]) -> PlanKey:
        return PlanKey(
            info=info,
            training=training,
            generation=target.layout,
            target=target.kind,
            training_padded_vocab=values[0],
            generation_padded_vocab=values[1],
            bucket_bytes=int(bucket_mb * MIB),
            elem_size=values[2],
        )

    plan, checked = (None, []) if own else _checked(key(guess), rank, sources, target, info)
    reduced = all_max(
        [*mine, -mine[1], *guess, *(-g for g in guess), 1 if own or checked else 0], group
    )
    high, low_engine_vocab = reduced[:3], -reduced[3]
    guesses_high, guesses_low = reduced[4:7], [-g for g in reduced[7:10]]
    _last_agreed[:] = high
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
        plan, checked = _checked(key(high), rank, sources, target, info)
    raise_together(problems or checked, rank, group)
    assert plan is not None
    return plan
