"""The reference of a LoRA actor: the actor itself with its adapters disabled.

With `actor.lora.rank > 0` the base weights are frozen, so the base model *is* the
reference policy: no second copy is built (`trainer/build.py`), and its log-probs come from
the actor's modules with every adapter skipped (`models/lora.adapters_disabled`). Of
`reference.*`, `enable` and `micro_batch_size` apply; `offload_params` does not (there are
no weights of its own: the actor's `offload` settings move them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rl_megatron.models.lora import adapters_disabled
from rl_megatron.trainer.roles import Batch, MegatronRole


class BaseReference:
    """`forward_only` and `on_device` of a reference role, through the actor's modules."""

    name = "reference"

    def __init__(self, actor: MegatronRole, micro_batch_size: int) -> None:
        self.actor, self.micro_batch_size = actor, micro_batch_size

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The actor's weights on the device for the phase (its own offload settings)."""
        with self.actor.on_device():
            yield

    def forward_only(self, batch: Batch, **kwargs) -> dict[str, torch.Tensor]:
        """The actor's `forward_only` with every adapter off: the base model's outputs."""
        kwargs.setdefault("micro_batch_size", self.micro_batch_size)
        with adapters_disabled(self.actor.model):
            return self.actor.forward_only(batch, **kwargs)
