"""Padding-free micro-batches: the rows' real tokens packed into one sequence (THD layout).

A micro-batch of left-padded prompts and right-padded responses (`trainer/roles.py`'s dict
layout) becomes one row of `T = Σ L_i` tokens, `L_i` the real tokens of row i, with
`cu_seqlens = [0, L_0, L_0 + L_1, …]`; megatron-core's attention (our SDPA module, or TE's)
keeps every sequence causal and separate through `PackedSeqParams(qkv_format="thd")`, and
RoPE restarts at each boundary. No FLOP is spent on padding.

`gather_index[i, k]` is the packed position whose output predicts response token k of row
i (the last prompt token predicts the first response token); the output at token k's own
position is one further on. Columns past a row's response are clamped into the row and
masked by the caller.
"""

from __future__ import annotations

import torch

__all__ = ["pack_micro_batch", "PACKED_KEYS"]

# Keys `pack_micro_batch` adds; everything else keeps the per-row layout.
PACKED_KEYS = ("packed_ids", "packed_position_ids", "cu_seqlens", "max_seqlen", "gather_index")


def pack_micro_batch(
    batch: dict[str, torch.Tensor],
    *,
    multiple_of: int = 1,
    min_length: int = 0,
    seq_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """Pack one micro-batch's rows; per-row response tensors are cut to its longest response.

    batch: `prompts [b, P]`, `responses [b, R]`, `attention_mask [b, P + R]` and any
        per-row loss inputs (`[b, R]` ones are trimmed with the responses); an optional
        `routed_experts [b, P + R, L, k]` is packed like the ids (`[1, T, L, k]`, -1 on
        padding).
    multiple_of: pad the packed length to a multiple of this (sequence parallelism needs
        a multiple of the TP size); min_length: pad at least to this (one shape for all
        micro-batches of an interleaved pipeline). Padding forms a sequence of its own, so
        it attends only to itself and no real token sees it.
    seq_multiple: pad each row's sequence to a multiple of this (context parallelism cuts
        every sequence into 2·cp chunks): the padding follows the row's real tokens inside
        its sequence, so causal attention keeps it from every real token.
    Returns the per-row entries (trimmed) plus `PACKED_KEYS`:
        packed_ids, packed_position_ids `[1, T]`; cu_seqlens `[n + 1]` int32 (n = b, or
        b + 1 with a padding sequence); max_seqlen `[]` int; gather_index `[b, r]` int64.
    """
    prompts, responses, mask = batch["prompts"], batch["responses"], batch["attention_mask"]
    device = prompts.device
    p, big_r = prompts.shape[1], responses.shape[1]
    real = mask.bool()
    lengths = real.sum(dim=1)
    prompt_lengths = real[:, :p].sum(dim=1)
    response_lengths = real[:, p:].sum(dim=1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError("pack_micro_batch: a row has an empty prompt")

    ids = torch.cat([prompts, responses], dim=1)[real]  # row-major: row 0's tokens first
    routing = batch["routed_experts"][real] if "routed_experts" in batch else None
    if seq_multiple > 1:
        if routing is not None:
            routing, _ = _pad_each(routing, lengths, seq_multiple, fill=-1)
        ids, lengths = _pad_each(ids, lengths, seq_multiple)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(ids.numel(), device=device) - torch.repeat_interleave(starts, lengths)
    total = int(ids.numel())
    target = max(total, min_length)
    target = -(-target // multiple_of) * multiple_of
    bounds = [torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(lengths, 0)]
    if target > total:
        pad = target - total
        ids = torch.cat([ids, ids.new_zeros(pad)])
        if routing is not None:
            routing = torch.cat([routing, routing.new_full((pad, *routing.shape[1:]), -1)])
        positions = torch.cat([positions, torch.arange(pad, device=device)])
        bounds.append(torch.tensor([target], device=device))
    cu_seqlens = torch.cat(bounds).to(torch.int32)

    r = max(int(response_lengths.max()), 1)
    k = torch.arange(r, device=device)
    last = (response_lengths - 1).clamp(min=0)
    gather = (starts + prompt_lengths - 1).unsqueeze(1) + torch.minimum(k, last.unsqueeze(1))

    out = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids", "routed_experts"):
            continue  # the packed layout replaces them
        if value.dim() >= 2 and value.shape[1] == big_r and key != "prompts":
            out[key] = value[:, :r]
        else:
            out[key] = value
    out.update(
        packed_ids=ids.unsqueeze(0),
        packed_position_ids=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=torch.diff(cu_seqlens).max(),
        gather_index=gather,
    )
    if routing is not None:
        out["routed_experts"] = routing.unsqueeze(0)
    return out


def _pad_each(
    ids: torch.Tensor, lengths: torch.Tensor, multiple: int, fill: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed `ids` `[Σ L_i, ...]` with each row's sequence padded (`fill` at its end) to a
    multiple of `multiple`; returns the new ids and lengths."""
    padded = -(-lengths // multiple) * multiple
    starts = torch.cumsum(padded, 0) - padded
    # Row i's k-th real token goes to starts[i] + k.
    row = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
    offset = (
        torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(lengths, 0) - lengths)[row]
    )
    out = ids.new_full((int(padded.sum()), *ids.shape[1:]), fill)
    out[starts[row] + offset] = ids
    return out, padded
