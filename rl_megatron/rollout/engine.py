"""The one interface every rollout engine implements: sync weights, generate, sleep, wake.

SPMD contract: every rank of the torchrun world calls each method, in the same order; the
engine decides which ranks do what (generation replicas, gathers). Ranks that share
prompts (one training data-parallel replica) pass the same prompt list to `generate`.

What differs between engines stays behind the interface: `sync_from(model_chunks,
version)` gives the engine the trainer's weights however it takes them (vLLM: its
`WeightSync` reshards them into its parameters; the Megatron engine generates with the
trainer's own modules, so a sync only stamps the version), and
`generates_with_trainer_modules` tells the trainer whether it must keep those modules on
the device while the engine generates.

State the base class keeps, so that every engine refuses the same mistakes:

* `weight_version` — the training step the weights come from (None: not real weights,
  e.g. `load_format="dummy"` or after `sleep(level=2)` discarded them). Every
  `RolloutBatch` records it.
* a weight update in progress: `begin_weight_update(v)` … `load_weights(bucket)` …
  `finish_weight_update()` (or all three at once with `update_weights`). Between begin
  and a successful finish, or after a failed one, `generate` raises: sampling from a mix
  of two steps' weights is a silent bug in RL, so it is an error here.
* awake memory: `sleep(level)` releases the KV cache, and at level 1 or 2 the weights
  (GPU); `wake(tags)` brings them back; `generate` needs both, a weight update needs the
  weights.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rl_megatron.resharding.executor import SyncStats
    from rl_megatron.rollout.multi_turn import MultiTurnSession
    from rl_megatron.rollout.trajectory import Trajectory

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
OutputLayout = Literal["full", "replica"]
WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")


# Times a named piece of an engine's work: `with part("wake_weights"): ...`.
PartTimer = Callable[[str], AbstractContextManager]


def untimed(name: str) -> AbstractContextManager:
    return contextlib.nullcontext()


def iter_named_tensors(weights: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs from a state dict or from an iterable of pairs."""
    return weights.items() if isinstance(weights, Mapping) else weights


class RolloutEngine(abc.ABC):
    """Generation engine behind one interface (vLLM in-process, native Megatron)."""

    # True when the engine generates with the very modules it syncs from (the trainer's
    # actor): those must then stay on the device while it generates. False: it holds a
    # copy of its own, and the trainer may offload its modules once the sync is done.
    generates_with_trainer_modules: bool = False
    # True when `generate` is collective across training DP replicas (the Megatron engine
    # with expert parallelism): a replica without prompts must still call it, with none.
    needs_every_replica: bool = False

    # What a sleeping engine keeps while the roles train (`sleep`'s levels); its build sets
    # it from `rollout.sleep_level`.
    sleep_level: int = 1

    def __init__(self, weight_version: int | None = 0) -> None:
        self._weight_version = weight_version
        self._pending_version: int | None = None  # set between begin and finish
        self._failed_update: str | None = None  # why the last update did not finish
        self._awake: set[str] = set(WAKE_TAGS)

    # ---- state --------------------------------------------------------------------

    @property
    def weight_version(self) -> int | None:
        """Training step of the weights in the engine; None when they are not real."""
        return self._weight_version

    @property
    def updating(self) -> bool:
        """True between `begin_weight_update` and a successful `finish_weight_update`."""
        return self._pending_version is not None or self._failed_update is not None

    @property
    def awake_tags(self) -> frozenset[str]:
        return frozenset(self._awake)

    def _asleep(self, tags: Sequence[str] = WAKE_TAGS) -> list[str]:
        """Those of `tags` that sleep now, in their order."""
        return [t for t in tags if t not in self._awake]

    def mapped_bytes(self) -> int | None:
        """Device memory the engine's own allocator holds mapped now (weights, KV cache),
        where it has one that says (vLLM's, in sleep mode); None otherwise."""
        return None

    def unmapped_bytes(self) -> int | None:
        """Bytes of the engine's own allocations that are asleep now (allocated, but their
        device memory given back), where its allocator says (vLLM's, in sleep mode); None
        otherwise. PyTorch's allocator counts them allocated all the same."""
        return None

    def _check_can_generate(self) -> None:
        if self._failed_update is not None:
            raise RuntimeError(
                f"rollout engine holds a partial weight update ({self._failed_update}); "
                f"run a complete update_weights before generating"
            )
        if self._pending_version is not None:
            raise RuntimeError(
                f"rollout engine is in the middle of weight update to version "
                f"{self._pending_version}; call finish_weight_update() before generating"
            )
        if self._weight_version is None:
            raise RuntimeError(
                "rollout engine holds no real weights (dummy load or discarded by "
                "sleep(level=2)); call update_weights before generating"
            )
        missing = set(WAKE_TAGS) - self._awake
        if missing:
            raise RuntimeError(
                f"rollout engine is asleep ({', '.join(sorted(missing))} released); "
                f"call wake() before generating"
            )

    # ---- weights ------------------------------------------------------------------

    @abc.abstractmethod
    def sync_from(self, model_chunks: Sequence[torch.nn.Module], version: int) -> SyncStats | None:
        """Make the engine generate with `model_chunks`' weights, as training step `version`.

        Collective. model_chunks: this rank's trainer chunks (Megatron modules, one per
        virtual stage; wrappers allowed), on the device. Needs the engine's weights awake
        (`wake(["weights"])`). Returns what this rank moved, or None when nothing moved.
        """

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        """Load a full set of Hugging Face-named weights from training step `version`.

        weights: `{hf_name: tensor}` or `(hf_name, tensor)` pairs, full (unsharded) HF
            shapes; the engine shards and fuses them into its own layout.
        """
        self.begin_weight_update(version)
        self.load_weights(weights)
        self.finish_weight_update()

    def begin_weight_update(self, version: int) -> None:
        """Start a (possibly bucketed) update to `version`; `generate` refuses until finish."""
        if "weights" not in self._awake:
            raise RuntimeError("rollout engine weights are asleep; call wake(['weights']) first")
        if self._weight_version is not None and version < self._weight_version:
            raise ValueError(
                f"weight update version {version} is older than the engine's "
                f"version {self._weight_version}"
            )
        self._pending_version = version
        self._failed_update = None
        try:
            self._begin_update()
        except BaseException:
            self._mark_failed("begin failed")
            raise

    def load_weights(self, weights: NamedTensors) -> None:
        """Load one bucket of HF-named tensors of the update in progress."""
        if self._pending_version is None:
            raise RuntimeError("load_weights called without begin_weight_update")
        try:
            self._load_bucket(weights)
        except BaseException:
            self._mark_failed("a bucket failed to load")
            raise

    def finish_weight_update(self) -> None:
        """Complete the update; the engine then generates with the new version."""
        if self._pending_version is None:
            raise RuntimeError("finish_weight_update called without begin_weight_update")
        try:
            self._finish_update()
        except BaseException:
            self._mark_failed("finish failed")
            raise
        self._weight_version = self._pending_version
        self._pending_version = None

    def _mark_failed(self, why: str) -> None:
        self._failed_update = f"version {self._pending_version}: {why}"
        self._pending_version = None
        # The old weights are partly overwritten: they are no version any more.
        self._weight_version = None

    # ---- generation ---------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        output_layout: OutputLayout = "full",
    ) -> RolloutBatch:
        """Generate `sampling.n` responses per prompt (collective over the prompt group).

        prompt_token_ids: `num_prompts` token-id lists, identical on every rank that
            shares prompts (the engine's prompt group).
        output_layout: "full" — every rank of the group gets all `num_prompts * n` rows;
            "replica" — each rank gets only the rows its generation replica produced
            (`group_index` still numbers prompts in the group's list).
        Returns a `RolloutBatch`, prompt-major, on the CPU.
        """
        if output_layout not in ("full", "replica"):
            raise ValueError(f"output_layout must be 'full' or 'replica', got {output_layout!r}")
        self._check_can_generate()
        sampling.check_prompt_seeds(len(prompt_token_ids))
        batch = self._generate(prompt_token_ids, sampling, output_layout)
        batch.weight_version = self._weight_version
        return batch

    def generate_trajectories(
        self,
        samples: Sequence[Mapping[str, Any]],
        sampling: SamplingParams,
        session: MultiTurnSession,
        group: dist.ProcessGroup | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Multi-turn rollouts: `sampling.n` trajectories per data record (DESIGN.md §2).

        samples: the step's records, identical on every rank of `group` (the ranks that
            pass the same prompts; None: this rank alone). Every rank of it returns all
            `len(samples) * n` trajectories (record-major) and the `multi_turn/*` metrics.
        The environments run on one rank of each group of ranks that generate together;
        the default generates each wave of ready turns in one `generate` call
        (`rollout/turn_waves.py`); an engine that can take each turn as it comes overrides
        this (vLLM).
        """
        self._check_can_generate()
        from rl_megatron.rollout.turn_waves import generate_in_waves

        return generate_in_waves(self, samples, sampling, session, group)

    # ---- memory -------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release GPU memory while training runs.

        level 0: the KV cache discarded, the weights kept on the device (they cost their
            memory while the roles train; a sync then writes them without a wake).
        level 1: weights offloaded to host memory, KV cache discarded (wake restores both).
        level 2: weights discarded too; the next `update_weights` must bring a full set,
            and `generate` refuses until it has.
        """
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        if self._pending_version is not None:
            raise RuntimeError("cannot sleep in the middle of a weight update")
        self._sleep(level)
        self._awake.discard("kv_cache")
        if level >= 1:
            self._awake.discard("weights")
        if level == 2:
            self._weight_version = None

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Bring back `tags` (`weights`, `kv_cache`; None: both).

        Wake `weights` first, load the new weights, put the trainer's weights away, then
        wake `kv_cache`: peak memory then never holds two models plus a KV cache.
        """
        tags = list(WAKE_TAGS if tags is None else tags)
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad:
            raise ValueError(f"unknown wake tag {bad[0]!r}; expected one of {WAKE_TAGS}")
        todo = self._asleep(tags)
        if todo:
            self._wake(todo)
            self._awake.update(todo)

    def make_room(self, tags: Sequence[str]) -> None:
        """Free device memory for waking `tags` (those asleep), where the engine must: vLLM
        gives torch's cached memory back when the driver's free memory is short of them.
        `wake` does it too; the trainer calls this first, timed apart, so that its memory
        figures see the release and the wake in intervals of their own (`PhaseTimer`)."""
        todo = self._asleep(tags)
        if todo:
            self._make_room(todo)

    def wake_if_room(self, tags: Sequence[str]) -> bool:
        """`wake(tags)` if the device has room for them now, beside what PyTorch's caching
        allocator holds (nothing of it is given back); True when `tags` are awake after.

        For a wake ahead of its time, while the device still runs other work: the trainer
        maps the engine's weights back while the actor's last optimizer step runs, so that
        the weight sync has nothing left to wake. Giving torch's cache back (`wake` does
        when memory is short) would wait for that work, so without room nothing happens
        here and the wake waits for its turn."""
        todo = self._asleep(tags)
        if todo and not self._has_room(todo):
            return False
        self.wake(todo)
        return True

    # ---- the trainer's phases -----------------------------------------------------
    # The loop says where it is; the engine decides what to wake, free or keep. `part(name)`
    # times a piece of the work (the loop's `PhaseTimer.part` for its phase): waking a tag
    # is two pieces, `make_room_for_<tag>` (torch's cached memory given back where the
    # device is short) and `wake_<tag>`, so that memory figures see each on its own.

    def prepare_for_sync(self, part: PartTimer = untimed) -> None:
        """Before `sync_from`: the weights awake (nothing to do where they stayed)."""
        self._wake_timed("weights", part)

    def prepare_for_generation(self, part: PartTimer = untimed) -> None:
        """Before `generate`: whatever sleeps back, the weights first (after a sleep that
        kept them on the host, between rounds of one step), then the KV cache. Call it
        once the trainer's own modules are put away: peak memory then never holds two
        models plus a KV cache."""
        if "weights" not in self._awake:
            self._wake_timed("weights", part)
        self._wake_timed("kv_cache", part)

    def release_for_training(self, keep_weights: bool = False) -> None:
        """The roles train next: sleep at `sleep_level` (`rollout.sleep_level`). With
        `keep_weights` (another round generates with these weights, no sync between) at
        most level 1, which keeps a copy."""
        self.sleep(level=min(self.sleep_level, 1) if keep_weights else self.sleep_level)

    def prefetch_weights(self) -> bool:
        """While the device still runs the trainer's last optimizer step: the weights
        awake if they fit beside what it holds now (`wake_if_room`); True when they are."""
        return self.wake_if_room(["weights"])

    def _wake_timed(self, tag: str, part: PartTimer) -> None:
        with part(f"make_room_for_{tag}"):
            self.make_room([tag])
        with part(f"wake_{tag}"):
            self.wake([tag])

    # ---- engine hooks -------------------------------------------------------------

    @abc.abstractmethod
    def _begin_update(self) -> None: ...

    @abc.abstractmethod
    def _load_bucket(self, weights: NamedTensors) -> None: ...

    @abc.abstractmethod
    def _finish_update(self) -> None: ...

    @abc.abstractmethod
    def _generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        output_layout: OutputLayout,
    ) -> RolloutBatch: ...

    @abc.abstractmethod
    def _sleep(self, level: int) -> None: ...

    @abc.abstractmethod
    def _wake(self, tags: list[str]) -> None: ...

    def _make_room(self, tags: list[str]) -> None:
        """Free what waking `tags` needs (`make_room`); nothing, where a sleep freed none."""
        return None

    def _has_room(self, tags: list[str]) -> bool:
        """Whether waking `tags` fits beside what is on the device now (`wake_if_room`);
        engines whose sleep frees no device memory always have room."""
        return True
