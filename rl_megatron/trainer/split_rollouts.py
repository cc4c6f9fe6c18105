"""Split placement's two sides (`trainer.mode: split_async`, `placement.py`).

    schedule = SplitSchedule(max_staleness, start=step, total=total_steps)
    schedule.ops()        # ("weights", v) / ("batch", b): the order both sides run them in

The generation ranks generate batch b (every training replica's prompts of step b) with
the weights of version `schedule.version_for(b)` = max(start, b − max_staleness), so no
token is older than the bound, and send it to the training ranks while these train the
steps before it. At most one version is in flight: the generation side receives version v
just before it generates the first batch that may use it, and the training side sends it
as soon as it holds it and the generation side waits for it.

Both sides run the same list of operations in the same order (`SplitSchedule.ops`): the
generation side receives weights and sends batches, the training side sends weights and
receives batches. Every transfer is a blocking point-to-point pair, so two sides that
follow one order cannot deadlock whatever the transport buffers, and no transfer needs a
tag or a queue. The training side runs the list only as far as step k needs (batch k, and
version k where the list puts it before batch k), so batch k + 1 … is generated while step
k trains.

Weights. Training replica j (one plan block of t·p ranks) sends its weights straight into
generation replica j's engine with the resharding module's plan, its destinations on the
generation ranks (`resharding/remote.py`, `plan.build_remote_plan`): each row crosses the
bridge once, from a training rank that holds it, and lands in the engine's own parameter
through the engine's `ReshardTarget` (begin, each parameter in place as its last rows
land, finish with the version), the API a colocated sync uses. The training side holds
no copy of the generation shards. Training replicas beyond the G generation replicas send
nothing (G <= d, `config_checks`).

Data. Each generation replica serves the training replicas i with i mod G = j (G
generation replicas) and draws their prompts with their own `PromptSampler`s and seeds
(`sampling_seeds.step_sampling`), so a batch holds exactly the rows the synchronous loop
would generate for it under the same weights. The training side draws the same records
with its own sampler and refuses a batch of others. Its sampler is the run's data
position in checkpoints: a batch generated but not trained when the run stops is
generated again after the resume (from the checkpoint's sampler states, sent to the
generation side at the start), so no record of an epoch is lost or trained twice.

Stopping early (SIGTERM): the training side goes on down the list, receiving (and
dropping) batches up to the next weights operation, where it sends a stop instead of
weights; without one the generation side ends by itself after its last batch.
"""

from __future__ import annotations

import functools
import io
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rl_megatron.placement import SplitWorld
from rl_megatron.resharding.layouts import TrainingLayout
from rl_megatron.resharding.plan import plan_block

Op = tuple[str, int]  # ("weights", version) or ("batch", step)


@dataclass(frozen=True)
class SplitSchedule:
    """Which weights generate which batch, and the order both sides transfer them in."""

    max_staleness: int
    start: int  # the step the run starts (or resumes) at: version `start` is sent first
    total: int  # steps of the run

    def version_for(self, batch: int) -> int:
        """The weight version batch `batch` is generated with."""
        return max(self.start, batch - self.max_staleness)

    @functools.cached_property
    def _ops(self) -> tuple[Op, ...]:
        return tuple(self._make_ops())

    def ops(self) -> list[Op]:
        return list(self._ops)

    def _make_ops(self) -> list[Op]:
        if self.start >= self.total:
            return []  # a run resumed at its end: nothing to generate, no weights wanted
        out: list[Op] = [("weights", self.start)]
        for b in range(self.start, self.total):
            if b > self.start and self.version_for(b) != self.version_for(b - 1):
                out.append(("weights", self.version_for(b)))
            out.append(("batch", b))
        return out

    def needed_by_step(self, step: int) -> int:
        """How many of `ops()` the training side must have run before it trains `step`:
        through batch `step` and through the weights it holds then (version `step`),
        which the generation side takes only after the batches before it in the list."""
        return 1 + max(i for i, (_, index) in enumerate(self._ops) if index <= step)


# --------------------------------------------------------------------- the wire


def send_object(world: SplitWorld, obj, dst: int, device: torch.device) -> None:
    """A picklable object (CPU tensors inside) to launch rank `dst`: length, then bytes.

    Pickle crosses only between the ranks of one launch, as torch's own object
    collectives do; nothing read from disk is ever unpickled.
    """
    buffer = io.BytesIO()
    pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
    world.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst)
    world.send(payload, dst)


def recv_object(world: SplitWorld, src: int, device: torch.device):
    size = torch.zeros(1, dtype=torch.int64, device=device)
    world.recv(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    world.recv(payload, src)
    return pickle.loads(payload.cpu().numpy().tobytes())


@dataclass(frozen=True)
class Pairing:
    """Which generation replica serves which training replica, and who sends whom weights."""

    training: TrainingLayout  # the training side's layout (its own rank numbers)
    generation_tp: int
    generation_replicas: int  # G

    def served_by(self, gen_replica: int) -> list[int]:
        """Training replicas whose batches generation replica `gen_replica` generates."""
        return [i for i in range(self.training.dp) if i % self.generation_replicas == gen_replica]

    def generator_of(self, train_replica: int) -> int:
        return train_replica % self.generation_replicas

    def weight_block(self, gen_replica: int) -> tuple[list[int], list[int]]:
        """The ranks of generation replica `gen_replica`'s weight plan, each side in its
        own numbering: training replica `gen_replica`'s plan block (t·p consecutive ranks,
        the rank order's dp outermost), then the replica's t_g generation ranks."""
        block = plan_block(self.training)
        first = gen_replica * block
        return (
            list(range(first, first + block)),
            list(range(gen_replica * self.generation_tp, (gen_replica + 1) * self.generation_tp)),
        )

    def weight_peers(self, gen_replica: int, world: SplitWorld) -> list[int]:
        """`weight_block`'s ranks as launch ranks (the bridge's numbering)."""
        training, generation = self.weight_block(gen_replica)
        return [world.training_rank(r) for r in training] + [
            world.generation_rank(r) for r in generation
        ]


# ------------------------------------------------------------ training side


@dataclass
class ReceivedBatch:
    step: int
    version: int
    records: list[int]  # dataset indices of the replica's prompts, in draw order
    rollout: object  # RolloutBatch
    generator: dict[str, float] = field(default_factory=dict)  # the generation side's figures


class TrainingSide:
    """The training ranks' end: weights out (resharded), batches in, in schedule order."""

    def __init__(
        self,
        world: SplitWorld,
        pairing: Pairing,
        sender,
        dp_rank: int,
        device: torch.device,
        replica_group: dist.ProcessGroup,
    ) -> None:
        self.world, self.pairing, self.device = world, pairing, device
        self.replica_group = replica_group
        self.sender = sender  # resharding.remote.RemoteSender
        self.dp_rank = dp_rank
        self.rank = dist.get_rank()  # on the training side
        gen_replica = pairing.generator_of(dp_rank)
        self.generator = world.generation_rank(gen_replica * pairing.generation_tp)
        self.schedule: SplitSchedule | None = None
        self._ops: Iterator[Op] | None = None
        self._done = 0  # ops run
        self._batches: dict[int, ReceivedBatch] = {}

    def start(self, step: int, total: int, max_staleness: int, sampler_state: dict) -> None:
        """Tell this replica's generator where the run stands (its sampler's state)."""
        self.schedule = SplitSchedule(max_staleness, step, total)
        self._ops = iter(self.schedule.ops())
        if dist.get_rank(self.replica_group) == 0:  # one message per training replica
            hello = {"step": step, "dp_rank": self.dp_rank, "sampler": sampler_state}
            send_object(self.world, hello, self.generator, self.device)

    def rollout(self, step: int, actor_chunks, timer) -> tuple[ReceivedBatch, dict[str, float]]:
        """Batch `step` (from this replica's generator), after the weights the schedule
        sends before it; `timer(name)` times each side's part."""
        sync: dict[str, float] = {}
        needed = self.schedule.needed_by_step(step)
        while self._done < needed:
            kind, index = next(self._ops)
            self._done += 1
            if kind == "weights":
                with timer("reshard"):
                    sync = self._send_weights(actor_chunks, index)
            else:
                with timer("wait_rollout"):
                    self._batches[index] = self._receive(index)
        return self._batches.pop(step), sync

    def stop(self) -> None:
        """The run ends before the schedule's end: drain batches up to the next weights
        operation and send a stop there (module docstring)."""
        for kind, index in self._ops or ():
            if kind == "weights":
                self.sender.stop(index)
                return
            self._receive(index)  # generated, never trained: the resume generates it again

    def _receive(self, step: int) -> ReceivedBatch:
        batch = recv_object(self.world, self.generator, self.device)
        if batch.step != step:
            raise RuntimeError(
                f"split_async: expected batch {step}, the generator sent {batch.step}"
            )
        return batch

    def _send_weights(self, actor_chunks, version: int) -> dict[str, float]:
        """Version `version` into the generation replica this rank's block feeds (collective
        over the training side)."""
        stats = self.sender.send(actor_chunks, version)
        return {
            "reshard/send_s": stats.wall_s,
            "reshard/sent_gb": stats.bytes_sent / 1e9,
            "reshard/plan_prepare_s": stats.prepare_s,
        }


def training_side(config, info, run) -> TrainingSide:
    """The training rank's end, once the generation side has said its engine's layout
    (`GenerationSide.handshake`): the sender of its block's weights."""
    from rl_megatron.resharding.remote import RemoteSender

    world, t_g = run.split, config.rollout.tp
    facts = recv_object(world, world.generation_rank(0), run.device)
    pairing = Pairing(run.layout, t_g, config.placement.rollout_ranks // t_g)
    replica, local = divmod(dist.get_rank(), plan_block(run.layout))
    feeds = replica < pairing.generation_replicas
    sender = RemoteSender(
        remote_key(config, info, run.layout, facts["shard_specs"], facts["padded_vocab"]),
        transport=world.exchange,
        send_header=world.send,
        peers=pairing.weight_peers(replica, world) if feeds else None,
        local=local,
        device=run.device,
    )
    return TrainingSide(
        world, pairing, sender, run.coordinates["dp"], run.device, run.groups.replica
    )


def remote_key(config, info, training: TrainingLayout, shard_specs, padded_vocab: int):
    """What both sides build the weight plan from (`resharding.remote.RemoteKey`)."""
    from rl_megatron.resharding.remote import RemoteKey

    return RemoteKey(
        info=info,
        training=training,
        rollout_tp=config.rollout.tp,
        shard_specs=shard_specs,
        generation_padded_vocab=padded_vocab,
        bucket_mb=config.rollout.weight_sync_bucket_mb,
    )


# ---------------------------------------------------------- generation side


class GenerationSide:
    """A generation rank's loop: weights in, every served replica's batches out.

    Built on the generation ranks' own process groups (`run`: their `DistributedRun`,
    TP = rollout.tp, PP 1); `training` is the training side's layout.
    """

    def __init__(self, config, world: SplitWorld, run, training: TrainingLayout, logger) -> None:
        from rl_megatron.data.sampler import PromptSampler
        from rl_megatron.resharding.remote import RemoteReceiver
        from rl_megatron.rollout.engines import build_standalone_engine
        from rl_megatron.trainer.build import DTYPES, build_data, model_info

        self.config, self.world, self.log, self.device = config, world, logger, run.device
        self.data = build_data(config, logger)
        self.info = model_info(config)
        self.engine, self.target = build_standalone_engine(
            config, self.info, self.data.tokenizer, run.groups
        )
        t_g = config.rollout.tp
        self.pairing = Pairing(training, t_g, run.layout.world_size // t_g)
        self.replica, self.gen_tp = divmod(world.side_rank, t_g)
        self.served = self.pairing.served_by(self.replica)
        self.training = training
        self.samplers = {
            i: PromptSampler.from_config(config, len(self.data.train), i, training.dp)
            for i in self.served
        }
        self.total_steps = total_steps(config, len(self.data.train))
        self.receiver = RemoteReceiver(
            self.target,
            remote_key(
                config, self.info, training, self.target.shard_specs, self.target.padded_vocab()
            ),
            gen_tp=self.gen_tp,
            transport=world.exchange,
            recv_header=world.recv,
            peers=self.pairing.weight_peers(self.replica, world),
            dtype=DTYPES[config.model.dtype],
            device=run.device,
        )
        self._waited_to_send = 0.0  # the last batch's send: the training side was busy

    def handshake(self) -> None:
        """Generation rank 0 tells every training rank the engine's layout (parameter
        naming and vocabulary padding, which the training side's staging takes)."""
        if self.world.side_rank == 0:
            facts = {
                "shard_specs": self.target.shard_specs,
                "padded_vocab": self.target.padded_vocab(),
            }
            for rank in range(self.world.train_size):
                send_object(self.world, facts, self.world.training_rank(rank), self.device)

    def run(self) -> None:
        """Until the schedule's last batch, or a stop from the training side."""
        config, world = self.config, self.world
        first = {}
        for i in self.served:  # where the run stands, from each served replica
            src = world.training_rank(i * self.training.model_parallel_size)
            first[i] = recv_object(world, src, self.device)
            self.samplers[i].load_state_dict(first[i]["sampler"])
        steps = {hello["step"] for hello in first.values()}
        if len(steps) != 1:
            raise RuntimeError(f"split_async: training replicas start at different steps {steps}")
        schedule = SplitSchedule(config.rollout.max_staleness, steps.pop(), self.total_steps)
        waited = 0.0
        for kind, index in schedule.ops():
            if kind == "weights":
                t0 = time.perf_counter()
                if self.receiver.receive() is None:
                    self.log.info(
                        "split_async: stopped by the training side before batch %d", index
                    )
                    return
                waited = time.perf_counter() - t0
            else:
                self._generate_and_send(index, waited)
                waited = 0.0
        if schedule.ops():
            self.log.info("split_async: generated the run's last batch (%d)", schedule.total - 1)

    def _generate(self, prompts: list[list[int]], sampling):
        """The engine's samples (a benchmark wraps this, as it wraps the trainer's)."""
        return self.engine.generate(prompts, sampling, output_layout="full")

    def _generate_and_send(self, step: int, waited_for_weights: float) -> None:
        from rl_megatron.trainer.sampling_seeds import step_sampling

        eos = self.data.tokenizer.eos_token_id
        d = self.training.dp
        for i in self.served:
            records = self.samplers[i].next_batch()
            prompts = [self.data.train.input_ids[k] for k in records]
            sampling = step_sampling(self.config, eos, step, i, d, len(records))
            t0 = time.perf_counter()
            rollout = self._generate(prompts, sampling)
            generate_s = time.perf_counter() - t0
            if self.gen_tp != 0:
                continue  # the TP group's first rank sends what every rank of it sampled
            figures = {
                "split/generate_s": generate_s,
                "split/generator_wait_weights_s": waited_for_weights,
                "split/generator_wait_send_s": self._waited_to_send,
                "async/generated_tokens": float(rollout.response_mask.sum()),
            }
            rollout = _on_cpu(rollout)
            batch = ReceivedBatch(step, self.engine.weight_version, records, rollout, figures)
            t1 = time.perf_counter()
            first = i * self.training.model_parallel_size
            for rank in range(first, first + self.training.model_parallel_size):
                send_object(self.world, batch, self.world.training_rank(rank), self.device)
            self._waited_to_send = time.perf_counter() - t1


def total_steps(config, num_prompts: int) -> int:
    """`trainer.total_steps`, or the epochs' worth of batches (as the trainer counts)."""
    return config.trainer.total_steps or (
        config.trainer.total_epochs * (num_prompts // config.data.train_batch_size)
    )


def _on_cpu(rollout):
    """A `RolloutBatch` with every tensor on the CPU (what crosses the wire)."""
    from dataclasses import fields, replace

    moved = {
        f.name: getattr(rollout, f.name).cpu()
        for f in fields(rollout)
        if isinstance(getattr(rollout, f.name), torch.Tensor)
    }
    return replace(rollout, **moved)
