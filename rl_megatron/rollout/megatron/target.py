"""A Megatron engine model as a weight-sync target.

`MegatronEngineTarget` writes resharded rows into a `GPTModel` at its own TP size (PP 1),
through the engine's begin / finish API. A colocated run needs none (its Megatron engine
generates with the trainer's own modules, at the training layout); split placement's
generation ranks (`trainer/split_rollouts.py`) write what they receive through it, and the
resharding tests check plans into a Megatron layout at another TP size with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.resharding import shards
from rl_megatron.resharding.layouts import GenerationLayout
from rl_megatron.resharding.shards import check_tensors
from rl_megatron.resharding.sources import megatron_sources
from rl_megatron.resharding.targets import ReshardTarget, config_mismatch


class MegatronEngineTarget(ReshardTarget):
    """The Megatron rollout engine's `GPTModel` (PP 1) at its own TP size, written in place.

    Its TP groups are parallel_state's when the engine model was built, i.e. blocks of
    t_g consecutive ranks (`layout` says otherwise when the model was built with other
    groups).
    """

    shard_specs = staticmethod(shards.megatron_generation_specs)

    def __init__(self, engine: Any, layout: GenerationLayout | None = None) -> None:
        import torch.distributed as dist

        self.engine = engine
        tp = engine.model.config.tensor_model_parallel_size
        self.layout = layout or GenerationLayout(tp=tp, world_size=dist.get_world_size())
        if self.layout.tp != tp:
            raise ValueError(f"megatron engine model has tp={tp}, layout says {self.layout.tp}")
        self.params = megatron_sources([engine.model], engine.info)

    def padded_vocab(self) -> int:
        return self.params["embedding.word_embeddings.weight"].shape[0] * self.layout.tp

    def check(self, shapes: Mapping[str, tuple[int, ...]], info: HFModelInfo) -> list[str]:
        problems = config_mismatch(info, self.engine.info, "megatron engine")
        return problems + check_tensors(shapes, self.params, "megatron engine")

    def begin(self, version: int) -> None:
        self.engine.begin_weight_update(version)

    def writable(self, name: str) -> torch.Tensor:
        return self.params[name].data

    def finish(self) -> None:
        # Nothing buffered in the engine: finishing only records the version.
        self.engine.finish_weight_update()

    def abort(self, why: str) -> None:
        self.engine._mark_failed(why)
