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

Weights. The training ranks reshard the actor into the generation layout with the
resharding module (`WeightSync` into a `TensorStoreTarget`: the engine's own parameter
naming and TP split, on the training ranks) and send each shard to the generation ranks
that hold it; the generation side writes them into its engine's parameters through the
engine's `ReshardTarget` (begin, each parameter in place, finish with the version), the
API a colocated sync uses. Generation replica j takes its weights from training replica
j mod d (micro-replica (j div d) mod m of it, `resharding/layouts.py`).

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
from rl_megatron.resharding.layouts import GenerationLayout, TrainingLayout, micro_dp

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

    def weight_source(self, gen_replica: int, gen_tp: int) -> int:
        """The training rank (training side's numbering) holding the generation shard
        `gen_tp` that generation replica `gen_replica` takes."""
        t = self.training
        m = micro_dp(t, self._staging_layout())
        replica, micro = gen_replica % t.dp, (gen_replica // t.dp) % m
        return replica * t.model_parallel_size + micro * self.generation_tp + gen_tp

    def weight_destinations(self, train_rank: int) -> list[tuple[int, int]]:
        """(generation replica, gen_tp) pairs that training rank `train_rank` sends to."""
        return [
            (j, r)
            for j in range(self.generation_replicas)
            for r in range(self.generation_tp)
            if self.weight_source(j, r) == train_rank
        ]

    def _staging_layout(self) -> GenerationLayout:
        return GenerationLayout(tp=self.generation_tp, world_size=self.training.world_size)


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
        weight_sync,
        staging,
        dp_rank: int,
        device: torch.device,
        replica_group: dist.ProcessGroup,
    ) -> None:
        self.world, self.pairing, self.device = world, pairing, device
        self.replica_group = replica_group
        self.weight_sync, self.staging = weight_sync, staging  # WeightSync → TensorStoreTarget
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
                self._send_header(index, stop=True)
                return
            self._receive(index)  # generated, never trained: the resume generates it again

    def _receive(self, step: int) -> ReceivedBatch:
        batch = recv_object(self.world, self.generator, self.device)
        if batch.step != step:
            raise RuntimeError(
                f"split_async: expected batch {step}, the generator sent {batch.step}"
            )
        return batch

    def _destinations(self) -> list[int]:
        """Launch ranks of the generation ranks that take their weights from this rank."""
        tp = self.pairing.generation_tp
        pairs = self.pairing.weight_destinations(self.rank)
        return [self.world.generation_rank(j * tp + r) for j, r in pairs]

    def _send_header(self, version: int, stop: bool = False) -> None:
        header = torch.tensor([version, int(stop)], dtype=torch.int64, device=self.device)
        for dst in self._destinations():
            self.world.send(header, dst)

    def _send_weights(self, actor_chunks, version: int) -> dict[str, float]:
        """Reshard into the staging store (collective over the training side), then each
        shard to the generation ranks that take it from this rank."""
        t0 = time.perf_counter()
        stats = self.weight_sync.sync(actor_chunks, version)
        t1 = time.perf_counter()
        sent = 0
        self._send_header(version)
        for dst in self._destinations():
            for spec in self.staging.specs:
                tensor = self.staging.tensors[spec.name]
                self.world.send(tensor, dst)
                sent += tensor.numel() * tensor.element_size()
        return {
            "reshard/stage_s": t1 - t0,
            "reshard/send_s": time.perf_counter() - t1,
            "reshard/sent_gb": sent / 1e9,
            "reshard/plan_prepare_s": stats.prepare_s,
        }


def training_side(config, info, run) -> TrainingSide:
    """The training rank's end, once the generation side has said its engine's layout
    (`GenerationSide.handshake`): the staging store at that layout and its weight sync."""
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.trainer.build import DTYPES

    world, t_g = run.split, config.rollout.tp
    facts = recv_object(world, world.generation_rank(0), run.device)
    staging = TensorStoreTarget(
        facts["shard_specs"],
        info,
        GenerationLayout(tp=t_g, world_size=run.layout.world_size),
        dist.get_rank(),
        facts["padded_vocab"],
        dtype=DTYPES[config.model.dtype],
        device=run.device,
    )
    weight_sync = WeightSync(
        staging, info=info, training=run.layout, bucket_mb=config.rollout.weight_sync_bucket_mb
    )
    pairing = Pairing(run.layout, t_g, config.placement.rollout_ranks // t_g)
    return TrainingSide(
        world, pairing, weight_sync, staging, run.coordinates["dp"], run.device, run.groups.replica
    )


# ---------------------------------------------------------- generation side


def receive_weights(world: SplitWorld, target, specs, src: int, device) -> int | None:
    """One version from training rank `src` into the engine through its `target`
    (begin, every parameter in place, finish); returns the version, None on a stop."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    world.recv(header, src)
    version, stop = int(header[0]), bool(header[1])
    if stop:
        return None
    target.begin(version)
    try:
        for spec in specs:
            storage = target.writable(spec.name)
            if tuple(storage.shape) != tuple(spec.shape):
                raise RuntimeError(
                    f"split_async: engine parameter {spec.name} has shape "
                    f"{list(storage.shape)}, the sync sends {list(spec.shape)}"
                )
            if storage.is_contiguous():
                world.recv(storage, src)
            else:
                staged = torch.empty(spec.shape, dtype=storage.dtype, device=storage.device)
                world.recv(staged, src)
                storage.copy_(staged)
            target.param_done(spec.name)
    except BaseException as exc:
        target.abort(f"transfer failed: {exc}")
        raise
    target.finish()
    return version


class GenerationSide:
    """A generation rank's loop: weights in, every served replica's batches out.

    Built on the generation ranks' own process groups (`run`: their `DistributedRun`,
    TP = rollout.tp, PP 1); `training` is the training side's layout.
    """

    def __init__(self, config, world: SplitWorld, run, training: TrainingLayout, logger) -> None:
        from rl_megatron.data.sampler import PromptSampler
        from rl_megatron.rollout.engines import build_standalone_engine
        from rl_megatron.trainer.build import build_data, model_info

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
        self.specs = self.target.shard_specs(
            self.info, t_g, self.gen_tp, self.target.padded_vocab()
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
        src = world.training_rank(self.pairing.weight_source(self.replica, self.gen_tp))
        waited = 0.0
        for kind, index in schedule.ops():
            if kind == "weights":
                t0 = time.perf_counter()
                if receive_weights(world, self.target, self.specs, src, self.device) is None:
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
