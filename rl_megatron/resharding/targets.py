"""Where resharded weights go: `ReshardTarget`, the one interface a weight sync writes
through, and `TensorStoreTarget`, a layout's shards as plain tensors (no engine: tests,
benchmarks).

A target names the generation layout it holds (`shard_specs`: the engine's parameter
naming and fusion, a `plan.TargetSpecs`; `layout`: t_g and the rank map), checks — before
anything is written — that its parameters and model config agree with the plan, and
exposes each parameter's storage to the executor. Each engine's own target lives in its
package (`rollout/vllm/target.py`) and goes through the engine's begin / finish API, so the
engine records the weight version and refuses to generate on a partial update. A target is
driven by one `WeightSync` (`weight_sync.py`) for its life.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import torch

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding.layouts import GenerationLayout
from rl_megatron.resharding.plan import TargetSpecs
from rl_megatron.resharding.shards import check_tensors

# Fields that must agree between the trainer's model and the engine's: a difference in
# any of them means the engine computes another function, even where shapes match.
AGREEING_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "ffn_hidden_size",
    "qkv_bias",
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_type",
    "rope_factor",
    "num_experts",
    "moe_topk",
    "moe_ffn_hidden_size",
    "moe_norm_topk_prob",
)


def config_mismatch(trainer: HFModelInfo, engine: HFModelInfo, what: str) -> list[str]:
    """One line per architecture field where the engine's config differs from the trainer's."""
    return [
        f"{what} config has {field}={getattr(engine, field)!r}, the trainer's "
        f"{getattr(trainer, field)!r}"
        for field in AGREEING_FIELDS
        if getattr(trainer, field) != getattr(engine, field)
    ]


class ReshardTarget(abc.ABC):
    """A generation engine's parameters on this rank, as a weight sync sees them.

    A sync calls, on every rank: `padded_vocab` and `check` (agreement, before any
    write), `begin(version)`, `writable(name)` for each parameter it writes and
    `param_done(name)` once its last rows are written, then `finish()` — or `abort(why)`
    when the transfer fails after `begin`.
    """

    # The engine's parameter layout (`plan.TargetSpecs`, a module-level function): plans
    # are keyed by it, so two targets of one layout share plans.
    shard_specs: TargetSpecs
    layout: GenerationLayout

    @abc.abstractmethod
    def padded_vocab(self) -> int:
        """Rows of the whole (unsplit) embedding in the engine's layout; the first thing
        every sync asks (`PlanAgreement.agree`), before `check` and `begin`."""

    @abc.abstractmethod
    def check(self, shapes: Mapping[str, tuple[int, ...]], info: HFModelInfo) -> list[str]:
        """Problems (one line each) if the engine disagrees with the plan or the trainer.

        shapes: name → shape of this rank's target shards (`shards.spec_shapes` of the
            plan's specs, which the agreement keeps per plan)."""

    @abc.abstractmethod
    def begin(self, version: int) -> None: ...

    @abc.abstractmethod
    def writable(self, name: str) -> torch.Tensor:
        """Storage of parameter `name` to write this rank's shard into."""

    # True for targets that hold a buffer per parameter until it is complete: the sync's
    # copy program then reports each parameter as soon as its last rows land, instead of
    # once per round, so that few buffers are alive at once.
    buffers_params: bool = False

    def param_done(self, name: str) -> None:  # noqa: B027 (optional hook)
        """Every row of `name` is written (targets that post-process act here)."""

    @abc.abstractmethod
    def finish(self) -> None: ...

    @abc.abstractmethod
    def abort(self, why: str) -> None:
        """The transfer failed after `begin`: the engine must refuse to generate."""

    def staging_peak_bytes(self) -> int:
        """Peak bytes of the target's own buffers during the last update."""
        return 0


# ------------------------------------------------------------------- tensor store


class TensorStoreTarget(ReshardTarget):
    """This rank's shards of a generation layout as plain tensors (NaN until written)."""

    def __init__(
        self,
        shard_specs: TargetSpecs,
        info: HFModelInfo,
        layout: GenerationLayout,
        rank: int,
        padded_vocab: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shard_specs, self.layout, self._padded_vocab = shard_specs, layout, padded_vocab
        gen_tp = layout.coordinates(rank)["gen_tp"]
        self.specs = shard_specs(info, layout.tp, gen_tp, padded_vocab)
        # NaN marks rows nobody wrote, so a bit-exact comparison catches them.
        self.tensors = {
            s.name: torch.full(s.shape, float("nan"), dtype=dtype, device=device)
            for s in self.specs
        }
        self.version: int | None = None
        self.done: set[str] = set()

    def padded_vocab(self) -> int:
        return self._padded_vocab

    def check(self, shapes: Mapping[str, tuple[int, ...]], info: HFModelInfo) -> list[str]:
        return check_tensors(shapes, self.tensors, "tensor store")

    def begin(self, version: int) -> None:
        self.done = set()

    def writable(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def param_done(self, name: str) -> None:
        self.done.add(name)

    def finish(self) -> None:
        missing = set(self.tensors) - self.done
        if missing:
            raise RuntimeError(f"tensor store: {len(missing)} parameters never completed")
        self.version = -1 if self.version is None else self.version

    def abort(self, why: str) -> None:
        self.version = None
