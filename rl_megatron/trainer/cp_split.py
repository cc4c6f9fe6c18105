"""Context parallelism (`parallel.cp`) of one micro-batch: its split, and its outputs' gather.

Each micro-batch's sequences are padded to a multiple of 2·cp (`micro_batches`) and split
for this CP rank into megatron-core's load-balanced chunks (`models/context_parallel.py`),
per sequence when packed, after the labels (next tokens) are taken from the full sequence.
The per-position outputs of the local tokens are gathered over CP into the full `[b, s]`,
from which the response columns are read as without CP (`heads.OutputHead`). Every CP rank
then computes the same loss; the DP group (losses, metrics) is without CP.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rl_megatron.models import context_parallel as cpo


def split_micro_batch(
    batch: Mapping[str, torch.Tensor], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """This CP rank's tokens of a micro-batch (the model's ids and positions), plus
    `cp_labels`, each local token's label: the next token of the full sequence, taken
    before the split. group: the CP group."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if "cu_seqlens" in batch:
        keys, bounds = ("packed_ids", "packed_position_ids"), batch["cu_seqlens"].tolist()

        def split(x):
            return cpo.split_packed_for_cp(x, bounds, size, rank)
    else:
        keys = ("input_ids", "position_ids")

        def split(x):
            return cpo.split_for_cp(x, size, rank)

    # The label of the last column wraps around; that column predicts nothing read.
    labels = split(batch[keys[0]].roll(-1, dims=1))
    return {**batch, **{key: split(batch[key]) for key in keys}, "cp_labels": labels}


def gather_outputs(
    local: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position outputs of this rank's tokens, each `[b, s/cp]`, gathered over CP in
    one collective: `[b, s, k]` float32, output i of `local`'s order in `[..., i]`.

    cu_seqlens: the full pack's boundaries for a packed (THD) micro-batch. The backward
    keeps each rank's own positions (`gather_from_cp`): every CP rank computes the same
    loss from the result.
    """
    stacked = torch.stack([x.float() for x in local.values()], dim=-1)  # [b, s/cp, k]
    return cpo.gather_from_cp(stacked, group, dim=1, cu_seqlens=cu_seqlens)
