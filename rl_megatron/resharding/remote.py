"""Weights to generation ranks of their own: split placement's sync (`trainer.mode:
split_async`, `trainer/split_rollouts.py`).

    key = RemoteKey(info, training, rollout_tp, engine_shard_specs, engine_vocab, bucket_mb)
    # a training rank (every one: the training side's vocabulary padding is agreed)
    sender = RemoteSender(key, transport=world.exchange, send_header=world.send,
                          peers=plan_ranks, local=rank_in_block, device=device)
    sender.send(actor_chunks, version)
    # a generation rank
    receiver = RemoteReceiver(engine_target, key, gen_tp=gen_tp, transport=world.exchange,
                              recv_header=world.recv, peers=plan_ranks, dtype=dtype,
                              device=device)
    receiver.receive()    # the version now in the engine, or None when told to stop

The plan is the colocated sync's, with its destinations on other ranks
(`plan.build_remote_plan`): one training plan block (t·p ranks) sends its rows straight
into one generation replica's engine (t_g ranks), so each row crosses once, the training
side holds no copy of the generation shards, and the generation ranks write each message
into the engine's own parameters in place through its `ReshardTarget` (begin, every
parameter as its last rows land, finish with the version), the API a colocated sync uses.
Both ends build the same plan from the same key: the generation side's layout and
vocabulary padding (which the training side learns at the handshake) and the training
side's vocabulary padding and element size (sent in each version's header).

A version starts with a header from the block's first training rank to each generation
rank of the replica: (version, stop, training padded vocabulary, element size). Every
message of the plan is a point-to-point pair over the bridge (`placement.SplitWorld`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.agreement import MIB, all_max, padded_vocab_of
from rl_megatron.resharding.copy_program import CopyProgram, compile_program
from rl_megatron.resharding.executor import SyncStats, Transport, execute
from rl_megatron.resharding.layouts import GenerationLayout, TrainingLayout
from rl_megatron.resharding.plan import PlanKey, ReshardPlan, TargetSpecs, build_remote_plan
from rl_megatron.resharding.shards import spec_shapes
from rl_megatron.resharding.sources import SourceTable
from rl_megatron.resharding.targets import ReshardTarget

# Sends or receives a version's header — int64 (version, stop, training padded vocabulary,
# element size) — to or from a launch rank (`SplitWorld.send` / `.recv`).
HeaderIO = Callable[[torch.Tensor, int], None]


@dataclasses.dataclass(frozen=True)
class RemoteKey:
    """What both ends must agree on to build the same plan."""

    info: HFModelInfo
    training: TrainingLayout
    rollout_tp: int
    shard_specs: TargetSpecs  # the engine's layout (`ReshardTarget.shard_specs`)
    generation_padded_vocab: int
    bucket_mb: float

    def plan_key(self, training_padded_vocab: int, elem_size: int) -> PlanKey:
        return PlanKey(
            info=self.info,
            training=self.training,
            generation=GenerationLayout(tp=self.rollout_tp, world_size=self.training.world_size),
            target=self.shard_specs,
            training_padded_vocab=training_padded_vocab,
            generation_padded_vocab=self.generation_padded_vocab,
            bucket_bytes=int(self.bucket_mb * MIB),
            elem_size=elem_size,
        )


class _Plans:
    """The last plan built and one rank's compiled program of it (plans are pure)."""

    def __init__(self) -> None:
        self._last: tuple[PlanKey, ReshardPlan, dict[int, CopyProgram]] | None = None

    def get(self, key: PlanKey, local: int, per_param: bool) -> tuple[ReshardPlan, CopyProgram]:
        if self._last is None or self._last[0] != key:
            self._last = (key, build_remote_plan(key), {})
        _, plan, programs = self._last
        if local not in programs:
            programs[local] = compile_program(plan, local, per_param=per_param)
        return plan, programs[local]


class _SendOnly(ReshardTarget):
    """A training rank's target in the remote plan: it holds no destination, so the
    executor never calls it (every method says so if it does)."""

    def _never(self, *args) -> None:
        raise AssertionError("split placement: a training rank holds no engine parameter")

    padded_vocab = check = begin = writable = finish = abort = _never


class RemoteSender:
    """A training rank's end (module docstring).

    Args:
        key: the plan's shared facts (`RemoteKey`).
        transport: posts a round's messages over the bridge (`SplitWorld.exchange`).
        send_header: sends an int64 header to a launch rank.
        peers: the launch rank of each local rank of this rank's plan (its block's training
            ranks, then its generation replica's ranks); None: this block's replica feeds
            no generation replica (it still takes part in agreeing the vocabulary).
        local: this rank's place in its block.
        device: where headers are made (the bridge's: a GPU with NCCL).
        group: the training side's group, over which the vocabulary is agreed.
    """

    def __init__(
        self,
        key: RemoteKey,
        *,
        transport: Transport,
        send_header: HeaderIO,
        peers: Sequence[int] | None,
        local: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.key, self.transport, self.send_header = key, transport, send_header
        self.peers, self.local, self.device, self.group = peers, local, device, group
        self._sources = SourceTable(key.info)
        self._plans = _Plans()
        self._vocab_elem: tuple[int, int] | None = None

    def _generation_ranks(self) -> list[int]:
        block = len(self.peers) - self.key.rollout_tp
        return list(self.peers[block:])

    def send(self, model_chunks, version: int) -> SyncStats:
        """This rank's part of version `version` (collective over the training side)."""
        t0 = time.perf_counter()
        sources = self._sources(model_chunks)
        vocab, elem = self._agree(sources)
        stats = SyncStats(rank=dist.get_rank())
        if self.peers is None:
            return stats
        plan, program = self._plans.get(self.key.plan_key(vocab, elem), self.local, False)
        if self.local == 0:
            self._header(version, 0, vocab, elem)
        t1 = time.perf_counter()
        stats = execute(
            plan,
            program,
            self.local,
            sources,
            _SendOnly(),
            peers=self.peers,
            transport=self.transport,
        )
        stats.prepare_s = t1 - t0
        return stats

    def stop(self, version: int) -> None:
        """Tell the generation replica to stop where version `version` would have come."""
        if self.peers is not None and self.local == 0:
            self._header(version, 1, 0, 0)

    def _header(self, *values: int) -> None:
        header = torch.tensor(values, dtype=torch.int64, device=self.device)
        for rank in self._generation_ranks():
            self.send_header(header, rank)

    def _agree(self, sources) -> tuple[int, int]:
        """The training padded vocabulary and element size, agreed once: a middle pipeline
        stage holds no vocabulary."""
        if self._vocab_elem is None:
            elem = next(iter(sources.values())).element_size() if sources else 0
            vocab, elem = all_max(
                [padded_vocab_of(sources, self.key.training.tp), elem], self.group
            )
            self._vocab_elem = (vocab, elem)
        return self._vocab_elem


class RemoteReceiver:
    """A generation rank's end: each version into the engine's own parameters in place.

    Args:
        target: the engine's `ReshardTarget` on this rank.
        key: the plan's shared facts (`RemoteKey`).
        gen_tp: this rank's TP rank in its generation replica.
        recv_header: receives an int64 header from a launch rank.
        peers: as `RemoteSender`'s: the block's training ranks, then the replica's ranks.
        dtype, device: of the messages (the training side's dtype; this rank's device).
    """

    def __init__(
        self,
        target: ReshardTarget,
        key: RemoteKey,
        *,
        gen_tp: int,
        transport: Transport,
        recv_header: HeaderIO,
        peers: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.target, self.key, self.transport = target, key, transport
        self.recv_header, self.peers = recv_header, list(peers)
        self.dtype, self.device = dtype, device
        self.local = len(self.peers) - key.rollout_tp + gen_tp
        self._plans = _Plans()

    def receive(self) -> int | None:
        """One version from the training side into the engine; its number, None on a stop."""
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.recv_header(header, self.peers[0])
        version, stop, vocab, elem = (int(x) for x in header)
        if stop:
            return None
        if elem != self.dtype.itemsize:
            raise RuntimeError(
                f"split_async: the training side sends {elem}-byte elements, this side "
                f"expects {self.dtype} (model.dtype)"
            )
        plan, program = self._plans.get(
            self.key.plan_key(vocab, elem), self.local, self.target.buffers_params
        )
        problems = self.target.check(spec_shapes(plan.targets[self.local]), self.key.info)
        if problems:
            raise RuntimeError(f"split_async: the engine does not fit the plan: {problems[0]}")
        self.target.begin(version)
        try:
            execute(
                plan,
                program,
                self.local,
                {},
                self.target,
                peers=self.peers,
                transport=self.transport,
                dtype=self.dtype,
                device=self.device,
            )
        except BaseException as exc:
            self.target.abort(f"transfer failed: {exc}")
            raise
        self.target.finish()
        return version
