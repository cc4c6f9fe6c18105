"""Split a batch of sequences into micro-batches: fixed size, or by a token budget.

A micro-batch is a list of row indices into the batch. Two ways to make them:

* `fixed_micro_batches`: consecutive rows, `micro_batch_size` at a time (the order the
  rows came in, so GRPO groups stay together when the size is a multiple of `n`).
* `dynamic_micro_batches`: as few micro-batches as hold every sequence under a token
  budget (`max_tokens`, counted as real tokens), sequences spread so that the
  micro-batches carry about the same number of tokens: longest-first greedy (LPT: each
  sequence goes to the lightest micro-batch that still has room), which keeps the largest
  micro-batch within 4/3 of the optimum (Graham 1969) and, unlike padding to the longest
  sequence in the batch, lets short sequences share a forward pass.

`restore_order` puts per-micro-batch outputs back into the batch's row order.
`trim_padding` drops the columns a micro-batch does not need: the left-padding columns
that no row of it uses (prompts are left-padded) and the right-padding columns past its
longest response (responses are right-padded), so a micro-batch of short sequences costs
short sequences. `left_align` lays a micro-batch out for the model: each row's real
tokens moved to the front, all padding at the end. `pad_responses` restores the full
response width afterwards. `schedule_micro_batches` puts it together: the micro-batches a
role hands to megatron-core's schedule, left-aligned or packed, on the device.

Pure functions of tensors and lists: no process groups, no megatron.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

import torch

from rl_megatron.trainer.packing import pack_micro_batch


def fixed_micro_batches(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive rows, `micro_batch_size` at a time; the last one may be smaller.

    num_rows: rows in the batch (this rank's part of the mini-batch).
    micro_batch_size: rows per micro-batch, > 0.
    """
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    return [
        list(range(i, min(i + micro_batch_size, num_rows)))
        for i in range(0, num_rows, micro_batch_size)
    ]


def dynamic_micro_batches(
    seq_lens: Sequence[int] | torch.Tensor,
    max_tokens: int,
    *,
    min_micro_batches: int = 1,
    multiple_of: int = 1,
) -> list[list[int]]:
    """Balanced micro-batches whose real-token count each stays within `max_tokens`.

    seq_lens: `[num_rows]` real tokens of each row (prompt + response, padding excluded).
    max_tokens: token budget of one micro-batch; every row must fit on its own.
    min_micro_batches: at least this many (e.g. agreed across DP ranks, or the pipeline
        size: the interleaved schedule needs at least `pp` micro-batches).
    multiple_of: round the count up to a multiple of this (the interleaved schedule wants
        a multiple of `pp`).

    Returns micro-batches as lists of row indices, each list ascending, every row in
    exactly one list, lists ordered by their first row; never an empty list unless there
    are fewer rows than `min_micro_batches` demands.
    """
    lens = [int(x) for x in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    too_long = [i for i, n in enumerate(lens) if n > max_tokens]
    if too_long:
        raise ValueError(
            f"{len(too_long)} sequence(s) are longer than the micro-batch token budget "
            f"({max_tokens}); the longest has {max(lens)} tokens (row {too_long[0]} is one). "
            f"Raise max_tokens_per_micro_batch to at least max prompt + response length"
        )
    if not lens:
        return []
    k = max(math.ceil(sum(lens) / max_tokens), min_micro_batches, 1)
    k = math.ceil(k / multiple_of) * multiple_of
    while True:
        bins = _longest_first(lens, k, max_tokens)
        if bins is not None:
            break
        # LPT can miss a packing that exists; one more micro-batch always helps, and k
        # cannot pass len(lens) since every row fits alone.
        k += multiple_of
    # Empty bins only when min_micro_batches exceeds the rows; keep them so ranks agree.
    bins = [sorted(b) for b in bins]
    return sorted(bins, key=lambda b: b[0] if b else math.inf)


def _longest_first(lens: list[int], k: int, max_tokens: int) -> list[list[int]] | None:
    """LPT into k bins under a cap; None when some row does not fit anywhere."""
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]  # (tokens, bin): the lightest bin on top
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    for i in order:
        load, b = heapq.heappop(heap)
        if load + lens[i] > max_tokens:
            # The lightest bin is full for this row, so every bin is.
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lens[i], b))
    return bins


def restore_order(chunks: Sequence[torch.Tensor], micro_batches: Sequence[Sequence[int]]):
    """Concatenate per-micro-batch outputs back into the batch's row order.

    chunks: one tensor per micro-batch, `[len(micro_batch), ...]`, same trailing shape.
    micro_batches: the row indices each chunk holds.
    Returns `[num_rows, ...]` with row `micro_batches[j][i]` = `chunks[j][i]`.
    """
    rows = [i for mb in micro_batches for i in mb]
    if len(set(rows)) != len(rows):
        raise ValueError("restore_order: a row appears in more than one micro-batch")
    stacked = torch.cat(list(chunks))
    return torch.empty_like(stacked).index_copy_(0, row_index(rows, stacked.device), stacked)


def trim_padding(
    prompts: torch.Tensor, responses: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[int, int]:
    """Columns of a micro-batch to keep: `(prompt_start, response_len)`.

    prompts: `[b, P]` left-padded; responses: `[b, R]` right-padded;
    attention_mask: `[b, P + R]` 1 on real tokens.
    Returns the first prompt column any row uses and the number of response columns up to
    the last real response token of any row (at least 1, so that shapes stay valid).
    Slice with `prompts[:, prompt_start:]`, `responses[:, :response_len]`.
    """
    p = prompts.shape[1]
    prompt_used = attention_mask[:, :p].bool().any(dim=0)
    response_used = attention_mask[:, p:].bool().any(dim=0)
    prompt_start = int(prompt_used.nonzero()[0]) if prompt_used.any() else p - 1
    response_len = int(response_used.nonzero()[-1]) + 1 if response_used.any() else 1
    return prompt_start, max(response_len, 1)


def pad_responses(x: torch.Tensor, response_len: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad `[b, r, ...]` per-token outputs back to `[b, response_len, ...]`."""
    if x.shape[1] == response_len:
        return x
    pad = x.new_full((x.shape[0], response_len - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def select_rows(batch: Mapping[str, torch.Tensor], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """The given rows of every `[batch, ...]` tensor of a dict batch."""
    on: dict[torch.device, torch.Tensor] = {}  # one index per device, not one per tensor
    out = {}
    for key, value in batch.items():
        if value.device not in on:
            on[value.device] = row_index(rows, value.device)
        out[key] = value.index_select(0, on[value.device])
    return out


def row_index(rows: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Row numbers as an int64 index on `device`, for `index_select` / `index_copy_`.

    Why not `tensor[rows]`: advanced indexing (`aten::index`) of a CPU tensor costs
    milliseconds in torch's multithreaded CPU kernel (5-8 ms for 16 rows of a `[64, 272]`
    mask, 2.13 CPU and 2.11 on the H200 host), where `index_select` takes microseconds;
    and a blocking host-to-device copy of the index is a stream sync, so a GPU index goes
    through pinned memory without one.
    """
    index = torch.tensor(list(rows), dtype=torch.long)
    device = torch.device(device)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def aligned_shape(
    attention_mask: torch.Tensor, prompt_width: int, multiple_of: int = 1
) -> tuple[int, int]:
    """`(width, response_len)` of these rows once left-aligned (`left_align`).

    attention_mask: `[b, P + R]` of the rows; prompt_width: P.
    width: the longest row's real tokens, rounded up to `multiple_of`; response_len: the
    response columns up to the last real response token of any row (at least 1).
    Each is a host sync on a GPU tensor: callers that align many micro-batches pass a
    host copy of the mask (one transfer for all of them).
    """
    width = int(attention_mask.sum(dim=1).max().clamp(min=1))
    used = attention_mask[:, prompt_width:].bool().any(dim=0).nonzero()
    response_len = int(used[-1]) + 1 if len(used) else 1
    return -(-width // multiple_of) * multiple_of, response_len


def left_align(
    batch: Mapping[str, torch.Tensor],
    *,
    width: int | None = None,
    multiple_of: int = 1,
    response_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """A micro-batch as the model reads it: `[prompt | response | padding]` in every row.

    Prompts are left-padded and responses right-padded; moving each row left by its
    prompt padding leaves padding only at the end of rows. A real token then never
    attends to padding under plain causal attention, so the forward needs no padding
    mask and SDPA keeps its fused causal kernel (an explicit `[b, 1, s, s]` mask costs
    ~8 % of a training step on an H200). Outputs at the padding columns are never read.

    batch: `prompts [b, P]`, `responses [b, R]`, `attention_mask [b, P + R]` and any
        per-row loss inputs (`[b, R]` ones are trimmed with the responses); an optional
        `routed_experts [b, P + R, L, k]` moves with the tokens (-1 on padding).
    width: the sequence length; None: the longest row's real tokens, rounded up to
        `multiple_of` (sequence parallelism splits the sequence over TP). A fixed width
        keeps the response width at R as well (one shape for an interleaved pipeline).
    response_len: with `width`, the response columns to keep (`aligned_shape` gives
        both from a host copy of the mask, so that aligning costs no device sync).
    Returns the per-row entries without `prompts` (responses trimmed to r columns) plus
        `input_ids`, `position_ids` (0, 1, …), `attention_mask` `[b, width]` and
        `gather_index [b, r]`: the column whose output predicts response token k.
    """
    prompts, responses, mask = batch["prompts"], batch["responses"], batch["attention_mask"]
    p, full_r = prompts.shape[1], responses.shape[1]
    if width is None:
        width, response_len = aligned_shape(mask, p, multiple_of)
    elif response_len is None:
        response_len = full_r
    device = prompts.device
    prompt_len = mask[:, :p].sum(dim=1)
    # Column c of a row reads column c + (its prompt padding) of `[prompts | responses]`.
    source = torch.arange(width, device=device)[None, :] + (p - prompt_len)[:, None]
    inside = source < p + full_r
    source = source.clamp(max=p + full_r - 1)
    ids = torch.cat([prompts, responses], dim=1)
    out = {
        key: value[:, :response_len] if value.dim() >= 2 and value.shape[1] == full_r else value
        for key, value in batch.items()
        if key not in ("prompts", "attention_mask", "position_ids", "routed_experts")
    }
    if "routed_experts" in batch:  # per token, like the ids: [b, width, L, k]
        routing = batch["routed_experts"]
        index = source.view(*source.shape, 1, 1).expand(-1, -1, *routing.shape[2:])
        out["routed_experts"] = routing.gather(1, index).masked_fill(~inside[..., None, None], -1)
    out["input_ids"] = ids.gather(1, source)
    out["attention_mask"] = mask.gather(1, source) * inside
    out["position_ids"] = torch.arange(width, device=device).expand(len(ids), width).contiguous()
    k = torch.arange(response_len, device=device)[None, :]
    out["gather_index"] = (prompt_len[:, None] - 1 + k).clamp(min=0, max=width - 1)
    return out


def schedule_micro_batches(
    batch: Mapping[str, torch.Tensor],
    split: Sequence[Sequence[int]],
    device: torch.device,
    *,
    pack: bool = False,
    one_shape: bool = False,
    multiple_of: int = 1,
    seq_multiple: int = 1,
    host_mask: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of `split` on `device`, laid out for the model.

    pack: each micro-batch's rows packed into one sequence (`packing.pack_micro_batch`);
        otherwise rows are left-aligned (`left_align`).
    one_shape: every micro-batch gets the same shape (megatron-core's interleaved
        schedule exchanges no shapes between stages).
    multiple_of: sequence lengths rounded up to it (sequence parallelism splits them;
        context parallelism cuts them into 2·cp chunks).
    seq_multiple: packed: each sequence's length rounded up to it (context parallelism
        splits every packed sequence into 2·cp chunks); rows are always padded at the end.
    host_mask: a host copy of `batch["attention_mask"]`, if the caller has one.
    """

    def rows_on_device(rows: Sequence[int]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in select_rows(batch, rows).items()}

    if pack:
        packs = [rows_on_device(rows) for rows in split]
        longest = max(int(m["attention_mask"].sum()) for m in packs) if one_shape else 0
        return [
            pack_micro_batch(
                m, multiple_of=multiple_of, min_length=longest, seq_multiple=seq_multiple
            )
            for m in packs
        ]
    if not one_shape:
        # Shapes from one host copy of the mask: computed on the device, each would be a
        # sync, and the GPU would idle while the next step's micro-batches are made.
        mask = batch["attention_mask"].cpu() if host_mask is None else host_mask
        prompt_width = batch["prompts"].shape[1]
        out = []
        for rows in split:
            width, response_len = aligned_shape(
                mask.index_select(0, row_index(rows)), prompt_width, multiple_of
            )
            out.append(left_align(rows_on_device(rows), width=width, response_len=response_len))
        return out
    # One shape for all: the batch's full width, and every micro-batch filled up to the
    # largest with copies of its first row that count nowhere (response_mask 0; callers
    # drop their outputs).
    num_rows = max(len(rows) for rows in split)
    width = -(-batch["attention_mask"].shape[1] // multiple_of) * multiple_of
    out = []
    for rows in split:
        extra = num_rows - len(rows)
        sub = rows_on_device(list(rows) + [rows[0]] * extra)
        if extra:
            sub["response_mask"] = sub["response_mask"].clone()
            sub["response_mask"][len(rows) :] = 0
        out.append(left_align(sub, width=width))
    return out
