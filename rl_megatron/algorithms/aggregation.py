"""Loss aggregation over tokens and sequences, normalised over the global mini-batch.

A mini-batch is split over DP ranks and, on each rank, over micro-batches. Each micro-batch
loss is computed as *its share* of the mini-batch loss: the per-token (or per-sequence) sum
of this micro-batch divided by the token (or sequence) count of the **whole** mini-batch.
Summing those shares over all micro-batches of all DP ranks then gives exactly the
mini-batch loss, and so the same gradient, however the mini-batch was split. Dividing by a
local count instead would weight a token of a short micro-batch more than one of a long one.

Callers count once per mini-batch with `batch_totals(response_mask, group=dp_group)` (the
mask of this rank's part of the mini-batch) and pass the result to every micro-batch.

Two scalings are the caller's business, not ours:
* Megatron's DDP averages gradients over DP ranks, so a rank's share must be multiplied by
  the DP size (or DDP configured to sum) for the shares to add up.
* `get_forward_backward_func` divides a returned loss by the number of micro-batches unless
  the loss function reports its own token count; undo that scaling or use per-token mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole mini-batch (all micro-batches, all DP ranks)."""

    num_tokens: torch.Tensor  # 0-d int64: valid (mask = 1) response tokens
    num_seqs: torch.Tensor  # 0-d int64: sequences with at least one valid token


def batch_totals(
    response_mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> BatchTotals:
    """Count valid tokens and sequences of a mini-batch, summed over `group` when given.

    response_mask: `[batch, response_len]` 0/1, this rank's part of the mini-batch.
    group: the data-parallel group holding the other parts; None counts locally only.
    """
    if response_mask.dim() != 2:
        raise ValueError(
            f"batch_totals: response_mask must be [batch, response_len], "
            f"got shape {tuple(response_mask.shape)}"
        )
    valid = response_mask.bool()
    counts = torch.stack([valid.sum(), valid.any(dim=-1).sum()]).to(torch.int64)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return BatchTotals(num_tokens=counts[0], num_seqs=counts[1])


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    totals: BatchTotals | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar, as this micro-batch's share of the mini-batch loss.

    loss_mat: `[batch, response_len]` per-token loss. Positions where `mask` is 0 are ignored,
        even if they hold NaN or inf, and receive zero gradient.
    mask: `[batch, response_len]` 0/1 response_mask.
    mode, with `N` = valid tokens and `S` = sequences with a valid token in the mini-batch:
        `token-mean`: sum over all valid tokens / N.
        `seq-mean-token-sum`: sum over sequences of the token sum / S.
        `seq-mean-token-mean`: sum over sequences of the token mean / S (each sequence
            weighs the same whatever its length, as in the GRPO paper, Shao et al. 2024 eq. 3).
        `seq-mean-token-sum-norm`: sum over all valid tokens / (S * norm_len); a constant
            length normaliser that removes the length bias of the token mean (Dr. GRPO,
            Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1).
    totals: mini-batch counts from `batch_totals`; None uses this micro-batch's own counts
        (right only when the micro-batch is the whole mini-batch).
    norm_len: the constant of `seq-mean-token-sum-norm`; pass the configured maximum response
        length, since the default (`loss_mat.shape[-1]`) changes with micro-batch padding.

    Returns a 0-d tensor. An all-masked micro-batch gives 0 (with zero gradient), not NaN.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"aggregate: loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must "
            f"both be [batch, response_len]"
        )
    if mode not in AGG_MODES:
        raise ValueError(f"aggregate: mode must be one of {', '.join(AGG_MODES)}; got {mode!r}")
    if totals is None:
        totals = batch_totals(mask)
    valid = mask.bool()
    # where, not multiply: 0 * NaN at padding would poison the sum and its gradient.
    masked = torch.where(valid, loss_mat, 0.0)
    dtype = loss_mat.dtype

    def per(count: torch.Tensor) -> torch.Tensor:
        # clamp: a global count of 0 only happens with an all-masked batch, whose sum is 0.
        return torch.as_tensor(count, device=loss_mat.device).clamp(min=1).to(dtype)

    if mode == "token-mean":
        return masked.sum() / per(totals.num_tokens)
    seq_sums = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / per(totals.num_seqs)
    if mode == "seq-mean-token-mean":
        seq_lens = valid.sum(dim=-1).clamp(min=1).to(dtype)
        return (seq_sums / seq_lens).sum() / per(totals.num_seqs)
    length = loss_mat.shape[-1] if norm_len is None else norm_len
    if length <= 0:
        raise ValueError(f"aggregate: norm_len must be positive, got {length}")
    return seq_sums.sum() / (per(totals.num_seqs) * length)
