"""The training side of a weight sync: this rank's actor parameters by dist-checkpoint name.

    sources = megatron_sources(model_chunks, info)   # walks the modules every call
    table = SourceTable(info); sources = table(model_chunks)   # kept between syncs

Walking a Megatron chunk's modules and mapping their names takes ~1 ms on a 16-layer
model, paid on every sync; a check by identity, ~0.3 µs a parameter, shows that a table
built once still holds. A `SourceTable` belongs to one weight sync (`weight_sync.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.checkpoint.hf_loader import iter_rule_params, unwrap
from rl_megatron.models.hf_config import HFModelInfo

Owners = list[tuple[weakref.ref, str, torch.nn.Parameter]]  # (module, leaf, parameter)


def megatron_sources(model_chunks: Sequence[torch.nn.Module], info: HFModelInfo) -> dict:
    """This rank's training parameters by dist-checkpoint name (global layer numbers)."""
    rules = hm.rules_for(info, "lm")
    out: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        for rule, layer, param in iter_rule_params(unwrap(chunk), rules):
            out[rule.megatron.format(layer=layer)] = param
    return out


class SourceTable:
    """`megatron_sources`, kept per chunk while each parameter is its module's same object.

    Parameters replaced since the last call (`module.weight = ...`, `load_state_dict(...,
    assign=True)`) or modules freed rebuild a chunk's table; in-place changes (training,
    offload and reload of storages) keep it. A module *added* to a chunk after its first
    sync is not seen: build a new chunk instead. Chunks are held weakly: a dropped actor
    is freed. Treat the result as read-only.
    """

    def __init__(self, info: HFModelInfo) -> None:
        self.info = info
        self._tables: weakref.WeakKeyDictionary[torch.nn.Module, tuple[dict, Owners]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for chunk in model_chunks:
            model = unwrap(chunk)
            table = self._tables.get(model)
            if table is None or not _still_owned(table[1]):
                table = (megatron_sources([model], self.info), _owners(model))
                self._tables[model] = table
            out.update(table[0])
        return out


def _owners(model: torch.nn.Module) -> Owners:
    return [
        (weakref.ref(module), leaf, param)
        for module in model.modules()
        for leaf, param in module._parameters.items()
        if param is not None
    ]


def _still_owned(owners: Owners) -> bool:
    for ref, leaf, param in owners:
        module = ref()
        if module is None or module._parameters.get(leaf) is not param:
            return False
    return True
