"""What a weight sync reads of each tensor: read once per sync, compared whole.

    facts = TensorFacts.of(sources)          # the trainer's parameters, once per sync
    facts.shapes == plan_shapes_in_order     # the agreement's check (`agreement.py`)
    facts.placement == kept.placement        # the kept copy views' (`copy_program.KeptViews`)

A repeated sync checks every training parameter twice: its shape against the plan, and its
address, strides, dtype and device against what the kept copy views were bound to. For the
2 163 parameters of an MoE actor holding one tensor per expert, each read is a pass over
the tensors that cost 0.2–0.5 ms on an H200 host (benchmarks/runs/2026-12-02-h200-run12-moe-resharding.md, where a sync's host
checks took longer than its copies), and the two checks used to make their own passes
and dictionary lookups. Here each field is read once, in one C-level pass (`map`), in the
mapping's order; the checks compare lists whole against lists they keep in that order.

A sync after one whose facts are known reads only the addresses, then asks a C++ check
whether every tensor kept its shape, strides, dtype, device (and Python type and
`requires_grad`): torch's own `TensorGuards`, the check TorchDynamo built for its guards.
When nothing changed the last facts are reused as they are; otherwise (or where torch
has no such check, or the mapping holds one tensor twice) every field is read again. Dev
CPU, 2 163 tensors: 0.13 ms against 0.74 ms for reading them all; on the H200 host the MoE
sync's checks before its first copy went from 3.6 to 1.1–1.8 ms (the same file).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_megatron.resharding.shards import data_ptr_of, device_index_of, size_of, stride_of

try:  # private to torch: without it every sync reads every field
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - torch builds without dynamo
    _TensorGuards = None

_DTYPE = operator.attrgetter("dtype")


def unchanged_check(ts: Sequence[torch.Tensor]) -> Any | None:
    """A C++ check that `ts` keep their shapes, strides, dtypes, devices, Python types and
    `requires_grad` (`check(*ts)` → bool), or None where torch has none to offer."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*ts, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (TypeError, RuntimeError):  # another torch's signature
        return None


def placement_of(ts: Sequence[torch.Tensor], addresses: array | None = None) -> tuple:
    """Address, strides, device and dtype of each of `ts`, for equality only
    (`addresses`: theirs, if already read).

    A device is its index (-1: CPU or meta; a tensor moved to another device type also
    moves its address); dtypes are singletons. With the shape fixed (the agreement checks
    it against the plan on every sync), equal address and strides mean the same elements.
    """
    return (
        array("Q", map(data_ptr_of, ts)) if addresses is None else addresses,
        list(map(stride_of, ts)),
        array("q", map(device_index_of, ts)),
        list(map(_DTYPE, ts)),
    )


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    """Names, shapes and placement of a mapping's tensors, in its order."""

    names: tuple[str, ...]
    shapes: list[torch.Size]
    placement: tuple  # `placement_of` the tensors
    unchanged: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, tensors: Mapping[str, torch.Tensor], previous: TensorFacts | None = None
    ) -> TensorFacts:
        """The facts of `tensors`: `previous` itself if they still hold (same names and
        addresses, and its C++ check passes), else read afresh."""
        names, values = tuple(tensors), tuple(tensors.values())
        addresses = array("Q", map(data_ptr_of, values))
        if (
            previous is not None
            and previous.unchanged is not None
            and previous.names == names
            and previous.placement[0] == addresses
            and previous.unchanged.check(*values)
        ):
            return previous
        placement = placement_of(values, addresses)
        return cls(names, list(map(size_of, values)), placement, unchanged_check(values))

    @functools.cached_property
    def dtypes(self) -> frozenset[torch.dtype]:
        """The distinct dtypes (computed once: facts reused unchanged keep it)."""
        return frozenset(self.placement[3])


class ShapesInOrder:
    """The plan's shapes listed in the order of the last names asked for, kept while the
    plan's shapes and the names are the same (a kept source table's are, sync after sync).

    Args:
        want: name → shape, the plan's shard specs of one side (`shards.spec_shapes`).
    """

    def __init__(self, want: Mapping[str, tuple[int, ...]]) -> None:
        self.want = want
        self._names: tuple[str, ...] | None = None
        self._shapes: list[tuple[int, ...]] | None = None
        self._matched: TensorFacts | None = None  # facts reused unchanged match again

    def match(self, facts: TensorFacts) -> bool:
        """Whether `facts` hold exactly the plan's names, each with the plan's shape."""
        if facts is self._matched:
            return True
        if facts.names != self._names:
            self._names = facts.names
            shapes = list(map(self.want.get, facts.names))
            # Names are a mapping's keys, so distinct: as many, all known, is the same set.
            same_set = len(shapes) == len(self.want) and None not in shapes
            self._shapes = shapes if same_set else None
        if self._shapes is not None and facts.shapes == self._shapes:  # Size == tuple
            self._matched = facts
            return True
        return False
