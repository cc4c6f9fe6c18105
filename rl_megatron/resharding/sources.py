"""The training side of a weight sync: this rank's actor parameters by dist-checkpoint name.

    sources = megatron_sources(model_chunks, info)   # walks the modules every call
    table = SourceTable(info); sources = table(model_chunks)   # kept between syncs

Walking a Megatron chunk's modules and mapping their names takes ~1 ms on a 16-layer
model, paid on every sync; a check by identity shows that a table built once still holds.
An MoE actor without grouped GEMM holds one parameter per expert (2k on a 16-layer model of
64 experts), so the check runs as a few C-level passes (`map`), not a Python loop per
parameter. A `SourceTable` belongs to one weight sync (`weight_sync.py`).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence

import torch

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.checkpoint.hf_loader import iter_rule_params, unwrap
from rl_megatron.models.hf_config import HFModelInfo


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
        self._tables: weakref.WeakKeyDictionary[torch.nn.Module, tuple[dict, ParameterOwners]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
        tables = []
        for chunk in model_chunks:
            model = unwrap(chunk)
            table = self._tables.get(model)
            if table is None or not table[1].still_owned():
                table = (megatron_sources([model], self.info), ParameterOwners(model))
                self._tables[model] = table
            tables.append(table[0])
        if len(tables) == 1:
            return tables[0]  # read-only: no copy
        return {name: param for table in tables for name, param in table.items()}


class ParameterOwners:
    """Which module holds each parameter of a chunk, checkable in a few C-level passes.

    Holds each module's parameter dict (and the module weakly, its reference's callback
    recording that it was freed), so that a check reads one dict per parameter rather than
    module, its attributes, then its dict. A module whose `_parameters` dict itself is
    swapped for another (nn.Module never does) is not seen.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._freed: list[weakref.ref] = []
        self._refs, dicts, leaves, params = [], [], [], []
        for module in model.modules():
            self._refs.append(weakref.ref(module, self._freed.append))
            for leaf, param in module._parameters.items():
                if param is not None:
                    dicts.append(module._parameters)
                    leaves.append(leaf)
                    params.append(param)
        self._dicts, self._leaves, self._params = tuple(dicts), tuple(leaves), tuple(params)

    def still_owned(self) -> bool:
        """No module was freed, and each holds the same parameter object under its name."""
        if self._freed:
            return False
        current = map(dict.get, self._dicts, self._leaves)
        return all(map(operator.is_, current, self._params))
