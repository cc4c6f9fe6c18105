"""Context parallelism (CP) without Transformer Engine: the load-balanced split and its gathers.

With context parallelism each rank of a CP group holds a part of every sequence. Causal
attention makes late tokens dearer than early ones, so megatron-core cuts a sequence of
length s (a multiple of 2·cp) into 2·cp chunks of c = s / (2·cp) tokens and gives CP rank
r chunks r and 2·cp − 1 − r, in that order (`megatron.core.utils.get_batch_on_this_cp_rank`):

    cp = 2, s = 8:   rank 0 holds positions [0 1 | 6 7],  rank 1 holds [2 3 | 4 5]

megatron-core's RoPE assumes exactly this layout: `RotaryEmbedding` builds the table for
s = s_local · cp positions and keeps the rows of the same two chunks
(`rope_utils.get_pos_emb_on_this_cp_rank`), i.e. RoPE is by index in the sequence, not by
`position_ids`. Packed sequences (THD) are split the same way one sequence at a time, every
sequence padded to a multiple of 2·cp (`rope_utils._get_thd_freqs_on_this_cp_rank`), and the
local pieces concatenated in sequence order; `cu_seqlens` stay those of the full pack.

Here, as pure functions (no global state, groups passed in):

* `local_positions` / `packed_local_positions`: the global position of each local token;
* `split_for_cp` / `split_packed_for_cp`: this rank's tokens of a batch-first tensor;
* `gather_from_cp`: the autograd-aware inverse (all-gather + reorder); its backward keeps
  the gradient of this rank's own tokens, because every CP rank computes the same loss
  from the gathered tensor (the sum over CP ranks of the parameter gradients, which
  Megatron's DDP takes over the dp×cp group, is then the loss's gradient once);
* `gather_kv_from_cp`: the same for keys and values inside attention (sequence first), whose
  backward sums the gradient over the CP group (every rank's queries read every key).

Both gathers are one `all_gather_into_tensor` along the sequence (`_SeqAllGather`), the
collective of megatron-core's `gather_from_sequence_parallel_region`, whose backward
(reduce-scatter or slice) is the same; ours allocates on the tensor's own device, where
megatron-core's backward allocates on `torch.cuda.current_device()`, which the CPU shim
cannot redirect inside autograd's backward (its TorchFunctionMode is off there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "local_positions",
    "packed_local_positions",
    "split_for_cp",
    "split_packed_for_cp",
    "gather_from_cp",
    "gather_kv_from_cp",
    "chunk_starts",
    "gathered_order",
]


def _check_len(seq_len: int, cp_size: int, what: str) -> int:
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"{what} length {seq_len} is not a multiple of 2·cp = {2 * cp_size} "
            "(context parallelism cuts every sequence into 2·cp chunks)"
        )
    return seq_len // (2 * cp_size)


def chunk_starts(seq_len: int, cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Global start of this rank's two chunks of a sequence of `seq_len` tokens."""
    c = _check_len(seq_len, cp_size, "sequence")
    return cp_rank * c, (2 * cp_size - 1 - cp_rank) * c


def local_positions(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str = "cpu"
) -> Tensor:
    """`[seq_len / cp]` int64: the global position of each token CP rank `cp_rank` holds."""
    c = _check_len(seq_len, cp_size, "sequence")
    first, second = chunk_starts(seq_len, cp_size, cp_rank)
    steps = torch.arange(c, device=device)
    return torch.cat([first + steps, second + steps])


def _bounds(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    return cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else [int(x) for x in cu_seqlens]


def packed_local_positions(
    cu_seqlens: Tensor | Sequence[int],
    cp_size: int,
    cp_rank: int,
    device: torch.device | str = "cpu",
) -> Tensor:
    """`[T / cp]` int64: the packed (global) index of each local token of a THD pack.

    cu_seqlens: `[n + 1]` boundaries of the full pack (each length a multiple of 2·cp).
    Local tokens are sequence 0's two chunks, then sequence 1's, ... (megatron-core's order).
    """
    bounds = _bounds(cu_seqlens)
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            parts.append(start + local_positions(end - start, cp_size, cp_rank, device))
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(parts)


def split_for_cp(x: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """This CP rank's tokens of `x` (`[b, s, ...]` batch-first by default; `dim` = seq dim)."""
    if cp_size == 1:
        return x
    return x.index_select(dim, local_positions(x.shape[dim], cp_size, cp_rank, x.device))


def split_packed_for_cp(
    x: Tensor, cu_seqlens: Tensor | Sequence[int], cp_size: int, cp_rank: int, dim: int = 1
) -> Tensor:
    """This CP rank's tokens of a packed `[1, T, ...]` tensor, split sequence by sequence."""
    if cp_size == 1:
        return x
    bounds = _bounds(cu_seqlens)
    if bounds[-1] != x.shape[dim]:
        raise ValueError(f"cu_seqlens end at {bounds[-1]}, the pack has {x.shape[dim]} tokens")
    return x.index_select(dim, packed_local_positions(bounds, cp_size, cp_rank, x.device))


def gathered_order(
    seq_len: int,
    cp_size: int,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """`[seq_len]` index that puts a rank-ordered all-gather of a sequence (rank 0's
    tokens, then rank 1's, ...) into global order: `full = gathered.index_select(0, index)`.

    cu_seqlens: the full pack's boundaries for a packed (THD) sequence of `seq_len` tokens.
    """
    if cu_seqlens is None:
        held = [local_positions(seq_len, cp_size, r, device) for r in range(cp_size)]
    else:
        bounds = _bounds(cu_seqlens)
        held = [packed_local_positions(bounds, cp_size, r, device) for r in range(cp_size)]
    # held[j] = global position of gathered row j; its inverse permutation reorders.
    return torch.argsort(torch.cat(held))


class _SeqAllGather(torch.autograd.Function):
    """All-gather along dim 0 in rank order. Backward: the gradient summed over the group
    and this rank's rows (reduce-scatter), or only this rank's rows (`reduce_grad` False:
    every rank computed the same function of the gathered tensor)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, reduce_grad: bool) -> Tensor:
        ctx.group, ctx.reduce_grad = group, reduce_grad
        out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        rows = grad.shape[0] // group.size()
        if ctx.reduce_grad:
            out = grad.new_empty((rows, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
        else:
            out = grad[group.rank() * rows : (group.rank() + 1) * rows]
        return out, None, None


def _gather(x: Tensor, group: dist.ProcessGroup, dim: int, cu_seqlens, reduce_grad: bool):
    seq_first = x.movedim(dim, 0)
    full_len = seq_first.shape[0] * group.size()
    gathered = _SeqAllGather.apply(seq_first, group, reduce_grad)
    full = gathered.index_select(0, gathered_order(full_len, group.size(), cu_seqlens, x.device))
    return full.movedim(0, dim)


def gather_from_cp(
    x: Tensor, group: dist.ProcessGroup, dim: int = 1, cu_seqlens: Tensor | None = None
) -> Tensor:
    """The full sequence from every CP rank's tokens: `[b, s/cp, ...]` → `[b, s, ...]`.

    group: the CP group; dim: the sequence dim of `x` (1: batch-first);
    cu_seqlens: the full pack's boundaries when `x` is a packed THD row.
    Backward: each rank keeps the gradient of its own tokens (no sum over CP): use it when
    every CP rank computes the same loss from the result.
    """
    if group.size() == 1:
        return x
    return _gather(x, group, dim, cu_seqlens, reduce_grad=False)


def gather_kv_from_cp(x: Tensor, group: dist.ProcessGroup, cu_seqlens: Tensor | None = None):
    """Keys/values of the full sequence, sequence first: `[s/cp, ...]` → `[s, ...]`
    (`[t/cp, ...]` → `[t, ...]` for a THD pack with the full pack's `cu_seqlens`).

    Backward: the gradient summed over the CP group, then this rank's tokens
    (reduce-scatter): every rank's queries attend to every rank's keys.
    """
    return _gather(x, group, 0, cu_seqlens, reduce_grad=True)
