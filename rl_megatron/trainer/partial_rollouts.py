"""Partial rollouts for `trainer.mode: colocated_async`: a step takes the groups that have
finished; the others keep their tokens and go on under the next step's weights.

    buffer = PartialRollouts(n, max_response_length, partial, max_staleness, on_stale)
    groups, metrics = buffer.phase(version, need, draw, generate)

A generation phase, once the engine holds the weights of policy `version`:
1. **Staleness.** A sample whose oldest token is more than `max_staleness` versions older
   than `version` (the step that would train on it) is restarted (its tokens dropped, the
   record kept) or its group dropped (`on_stale`), so no token older than the bound is
   ever trained on. Counted.
2. **Top up.** Groups in flight are topped up to `need + extra_groups` with new records,
   a local batch (`draw()`) at a time; each sample's seed is fixed when it is drawn.
3. **Chunks.** Every unfinished sample generates at most `chunk_tokens` more tokens (one
   `generate` call per distinct budget: prompt and tokens so far as its prompt, so the
   engine recomputes its KV cache under the current weights, never reusing one across a
   weight update); tokens, log-probs and the version that sampled each are appended. A
   sample is finished when it stops or reaches `max_response_length`. Chunks repeat until
   `need` groups have all n samples finished (at least one chunk while anything is
   unfinished).
4. The first `need` finished groups, in the order their records were drawn, leave the
   buffer for the step; the rest stay (finished ones wait for the next step, unfinished
   ones are partial).

With `extra_groups = 0`, `chunk_tokens = max_response_length` and nothing carried, a phase
is the synchronous loop's round: one local batch, every sample to its end, the same seeds
(tests/multirank/test_async_training.py checks batches, losses and weights agree).

The buffer is per data-parallel replica (every rank of a replica holds the same), and
`state_dict` is what a checkpoint needs to resume without skipping or repeating a record:
the groups in flight with their tokens, and the draw counter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rl_megatron.rollout.batch import RolloutBatch

__all__ = ["InFlightGroup", "InFlightSample", "PartialRollouts", "continuation_seed"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def continuation_seed(seed: int | None, restarts: int, tokens_so_far: int) -> int | None:
    """The seed of a sample's next chunk: its own seed for its first chunk of its first
    attempt (the synchronous loop's seed), a hash of (seed, attempt, position) after, so a
    continuation does not replay the uniforms of the chunk before it."""
    if seed is None:
        return None
    if restarts == 0 and tokens_so_far == 0:
        return seed
    mixed = (seed * _GOLDEN + restarts * 0x632BE59BD9B4E019 + tokens_so_far) & _MASK63
    mixed ^= mixed >> 31
    return (mixed * 0xBF58476D1CE4E5B9) & _MASK63


@dataclass
class InFlightSample:
    """One of a record's n samples, across the phases that generate it."""

    seed: int | None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] | None = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    finish_reason: str | None = None  # None: more to generate
    restarts: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def restart(self) -> None:
        self.tokens, self.versions, self.finish_reason = [], [], None
        self.log_probs = None if self.log_probs is None else []
        self.restarts += 1


@dataclass
class InFlightGroup:
    """A data record's n samples; `order` is its place in the draw order."""

    record: int  # dataset index
    order: int
    prompt: list[int]
    samples: list[InFlightSample]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class PhaseResult:
    groups: list[InFlightGroup]
    metrics: dict[str, float]


class PartialRollouts:
    """This replica's groups in flight (module docstring).

    n: samples per record; max_new_tokens: `rollout.max_response_length`; chunk_tokens:
    tokens a sample may generate per call; extra_groups: groups kept in flight beyond a
    step's need (the ones that may finish later without holding the step);
    max_staleness: policy versions; on_stale: "restart" or "drop".
    """

    def __init__(
        self,
        n: int,
        max_new_tokens: int,
        chunk_tokens: int,
        extra_groups: int,
        max_staleness: int,
        on_stale: str,
        with_log_probs: bool = True,
    ) -> None:
        if on_stale not in ("restart", "drop"):
            raise ValueError(f"rollout.on_stale must be 'restart' or 'drop', got {on_stale!r}")
        self.n, self.max_new_tokens = n, max_new_tokens
        self.chunk_tokens = min(chunk_tokens, max_new_tokens)
        self.extra_groups, self.max_staleness, self.on_stale = extra_groups, max_staleness, on_stale
        self.with_log_probs = with_log_probs
        self.groups: list[InFlightGroup] = []
        self.draws = 0  # local batches drawn so far (seeds and the resume depend on it)
        self._orders = 0

    # ---------------------------------------------------------------- one phase

    def phase(
        self,
        version: int,
        need: int,
        draw: Callable[[int], tuple[list[int], list[list[int]], int | None]],
        generate: Callable[[list[list[int]], int, list[int | None]], RolloutBatch],
    ) -> PhaseResult:
        """Generate until `need` groups are finished; returns them (taken out of the
        buffer) and the phase's `async/*` counts.

        draw(d): the d-th local batch: its records' dataset indices, their prompts and the
            seed of its first sample (record i's sample j draws with seed + i·n + j);
        generate(prompts, max_new_tokens, seeds): one sample per prompt, each with its seed.
        """
        counts = {
            "restarted": 0.0,
            "dropped": 0.0,
            "chunks": 0.0,
            "draws": 0.0,
            "generated_tokens": 0.0,  # by this phase, whichever step trains them
        }
        self._enforce_staleness(version, counts)
        while len(self.groups) < need + self.extra_groups:
            self._add_batch(*draw(self.draws))
            counts["draws"] += 1
        # At least one chunk whenever something is unfinished, even when groups finished
        # earlier already fill the step: the records drawn for later steps start now, and
        # no phase leaves the engine idle while the next one would wait for all of them.
        while sum(g.finished for g in self.groups) < need or (
            not counts["chunks"] and not all(g.finished for g in self.groups)
        ):
            if counts["chunks"] > self.max_new_tokens:  # each chunk adds a token or ends
                raise RuntimeError(
                    f"partial rollouts: {self.max_new_tokens} chunks and still fewer than "
                    f"{need} finished groups; the samples do not advance"
                )
            counts["generated_tokens"] += self._generate_chunk(version, generate)
            counts["chunks"] += 1
        taken: list[InFlightGroup] = []
        for group in list(self.groups):
            if group.finished and len(taken) < need:
                taken.append(group)
                self.groups.remove(group)
        counts["carried_groups"] = float(len(self.groups))
        counts["carried_partial_samples"] = float(
            sum(bool(s.tokens) and not s.finished for g in self.groups for s in g.samples)
        )
        return PhaseResult(taken, {f"async/{k}": v for k, v in counts.items()})

    def _enforce_staleness(self, version: int, counts: dict[str, float]) -> None:
        oldest = version - self.max_staleness  # the oldest version a token may carry
        for group in list(self.groups):
            stale = [s for s in group.samples if s.versions and s.versions[0] < oldest]
            if not stale:
                continue
            if self.on_stale == "drop":
                self.groups.remove(group)
                counts["dropped"] += 1
            else:
                for sample in stale:
                    sample.restart()
                    counts["restarted"] += 1

    def _add_batch(self, records: list[int], prompts: list[list[int]], seed: int | None) -> None:
        self.draws += 1
        for i, (record, prompt) in enumerate(zip(records, prompts, strict=True)):
            samples = [
                InFlightSample(
                    seed=None if seed is None else seed + i * self.n + j,
                    log_probs=[] if self.with_log_probs else None,
                )
                for j in range(self.n)
            ]
            self.groups.append(InFlightGroup(int(record), self._orders, list(prompt), samples))
            self._orders += 1

    def _generate_chunk(
        self,
        version: int,
        generate: Callable[[list[list[int]], int, list[int | None]], RolloutBatch],
    ) -> int:
        """One chunk of every unfinished sample; returns the tokens it generated."""
        generated = 0
        todo = [(g, s) for g in self.groups for s in g.samples if not s.finished]
        budgets: dict[int, list[tuple[InFlightGroup, InFlightSample]]] = {}
        for g, s in todo:
            budget = min(self.chunk_tokens, self.max_new_tokens - len(s.tokens))
            budgets.setdefault(budget, []).append((g, s))
        for budget in sorted(budgets, reverse=True):
            requests = budgets[budget]
            prompts = [g.prompt + s.tokens for g, s in requests]
            seeds = [continuation_seed(s.seed, s.restarts, len(s.tokens)) for _, s in requests]
            batch = generate(prompts, budget, seeds)
            sampled_by = batch.weight_version if batch.weight_version is not None else version
            for row, (_, sample) in enumerate(requests):
                _, tokens = batch.row_tokens(row)
                reason = batch.finish_reasons[row]
                if reason in ("rejected", "abort"):
                    raise RuntimeError(
                        f"partial rollouts: the engine returned {reason!r} for a continuation "
                        f"of {len(prompts[row])} tokens ({budget} new at most)"
                    )
                if not tokens and reason == "length":  # would loop for ever
                    raise RuntimeError(
                        f"partial rollouts: the engine returned no token for a continuation "
                        f"of {len(prompts[row])} tokens ({budget} new at most)"
                    )
                sample.tokens += tokens
                generated += len(tokens)
                sample.versions += [int(sampled_by)] * len(tokens)
                if sample.log_probs is not None:
                    sample.log_probs += batch.rollout_log_probs[row, : len(tokens)].tolist()
                cut = reason == "length" and len(sample.tokens) < self.max_new_tokens
                if not cut:
                    sample.finish_reason = reason
        return generated

    # ------------------------------------------------------------ rows for a step

    @staticmethod
    def to_rows(
        groups: Sequence[InFlightGroup], pad_token_id: int, version: int
    ) -> tuple[RolloutBatch, dict[str, torch.Tensor], list[int]]:
        """The groups as a step's rows (group-major), their per-row staleness facts and each
        row's dataset record."""
        rows = [(g, s) for g in groups for s in g.samples]
        with_lp = all(s.log_probs is not None for _, s in rows)
        batch = RolloutBatch.from_sequences(
            prompts=[g.prompt for g, _ in rows],
            responses=[s.tokens for _, s in rows],
            log_probs=[s.log_probs for _, s in rows] if with_lp else None,
            finish_reasons=[s.finish_reason for _, s in rows],
            group_index=[k for k, g in enumerate(groups) for _ in g.samples],
            pad_token_id=pad_token_id,
            weight_version=version,
        )
        versions = torch.full(tuple(batch.responses.shape), -1, dtype=torch.int64)
        for r, (_, s) in enumerate(rows):
            versions[r, : len(s.versions)] = torch.tensor(s.versions, dtype=torch.int64)
        per_row = {
            "async/token_versions": versions,
            "async/partial": torch.tensor(
                [float(len(set(s.versions)) > 1) for _, s in rows], dtype=torch.float64
            ),
            "async/record": torch.tensor([g.record for g, _ in rows], dtype=torch.int64),
        }
        return batch, per_row, [g.record for g, _ in rows]

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "orders": self._orders,
            "groups": [asdict(g) for g in self.groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws, self._orders = int(state["draws"]), int(state["orders"])
        self.groups = [
            InFlightGroup(
                int(g["record"]),
                int(g["order"]),
                list(g["prompt"]),
                [InFlightSample(**s) for s in g["samples"]],
            )
            for g in state["groups"]
        ]


def staleness_metrics(
    token_versions: torch.Tensor, response_mask: torch.Tensor, version: int, group: Any = None
) -> dict[str, float]:
    """`async/staleness_mean` and `_max` (policy versions) over the sampled tokens of the
    step's rows on every rank of `group` (DP), and the fraction of rows that are partial
    trajectories is the caller's (a per-row mean)."""
    import torch.distributed as dist

    sampled = response_mask.bool() & (token_versions >= 0)
    staleness = (version - token_versions[sampled]).to(torch.float64)
    sums = torch.tensor([float(staleness.sum()), float(staleness.numel())], dtype=torch.float64)
    top = torch.tensor([float(staleness.max()) if staleness.numel() else 0.0])
    if group is not None and dist.get_world_size(group) > 1:
        device = "cpu"
        if torch.cuda.is_available() and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        sums, top = sums.to(device), top.to(device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums, top = sums.cpu(), top.cpu()
    return {
        "async/staleness_mean": float(sums[0] / sums[1]) if sums[1] else 0.0,
        "async/staleness_max": float(top[0]),
    }


class ReplicaStates:
    """Per-replica state (each DP replica's buffer and data position) as one checkpoint
    entry: gathered over the DP group on save (every rank then holds the same), each
    replica takes its own back on load."""

    def __init__(self, owners: dict[str, Any], dp_rank: int, dp_group: Any) -> None:
        self.owners, self.dp_rank, self.dp_group = owners, dp_rank, dp_group

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed as dist

        local = {name: owner.state_dict() for name, owner in self.owners.items()}
        size = dist.get_world_size(self.dp_group) if dist.is_initialized() else 1
        gathered: list[Any] = [None] * size
        if size > 1:
            dist.all_gather_object(gathered, local, group=self.dp_group)
        else:
            gathered = [local]
        return {"replicas": gathered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch.distributed as dist

        replicas = state["replicas"]
        size = dist.get_world_size(self.dp_group) if dist.is_initialized() else 1
        if len(replicas) != size:
            raise ValueError(
                f"trainer.mode: the checkpoint's asynchronous rollouts belong to "
                f"{len(replicas)} data-parallel replicas, this run has {size}; resume an "
                f"asynchronous run at the same data-parallel size"
            )
        for name, owner in self.owners.items():
            owner.load_state_dict(replicas[self.dp_rank][name])
