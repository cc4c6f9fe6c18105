"""Micro-batches through megatron-core's pipeline schedules, one forward step each.

`get_forward_backward_func` picks the schedule from megatron-core's pipeline state: no
pipelining, 1F1B, or interleaved when there is one model chunk per virtual stage.
`forward_step` is the schedule's `forward_step_func`: one micro-batch (the dict of
`micro_batches.schedule_micro_batches`) through one chunk, and the function that turns the
chunk's output into the loss (or, forward only, into per-token outputs).

The model reads left-aligned rows `input_ids` / `position_ids` `[b, s]` (padding only at
the ends of rows, so plain causal attention, with no mask, is exact for every real token),
or, packed, one `[1, T]` row of sequences (`packed_ids`, `packed_position_ids`, THD with
`cu_seqlens`). GPTModel works sequence-first inside and returns batch-first outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from rl_megatron.checkpoint.hf_loader import unwrap
from rl_megatron.models.chunked_logprobs import output_hidden_states, output_weight
from rl_megatron.trainer import cp_split


def run(
    model: list[torch.nn.Module],
    micro: list[dict],
    forward_step: Callable,
    *,
    pack: bool,
    forward_only: bool,
) -> list:
    """All micro-batches through the schedule; returns what the loss funcs reported.

    model: the role's chunks, one per virtual pipeline stage. pack: the micro-batches are
    packed (`packed_ids`). With forward_only, `collect_non_loss_data` makes the schedule
    store loss_func's return value as is (our per-token dict), instead of treating it as a
    loss.
    """
    if pack:
        seq, mbs = max(m["packed_ids"].shape[1] for m in micro), 1
    else:
        seq = max(m["input_ids"].shape[1] for m in micro)
        mbs = max(m["input_ids"].shape[0] for m in micro)
    iters = [iter(micro) for _ in model]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if len(iters) > 1 else iters[0],
        model=model,
        num_microbatches=len(micro),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def forward_step(
    data_iterator: Iterator,
    model: torch.nn.Module,
    *,
    loss_func: Callable,
    cp: dist.ProcessGroup | None,
    from_hidden: bool,
    routing: Callable[
        [torch.nn.Module, Mapping[str, torch.Tensor]], contextlib.AbstractContextManager
    ],
    kl_model: torch.nn.Module | None,
):
    """megatron-core's forward_step_func (bind the keywords with `partial`): the next
    micro-batch through `model`, one chunk.

    loss_func: `(micro_batch, output) -> ...`, given the micro-batch as the loss reads it.
    cp: the context-parallel group (None without CP): the chunk gets this rank's tokens
        (`cp_split.split_micro_batch`).
    from_hidden: the last stage returns its final hidden states, not the logits; the
        micro-batch then carries the `output_weight` to make them from
        (`models/chunked_logprobs.py`).
    routing: `(model, micro_batch)` → the context the forward runs in (`routing.py`).
    kl_model: another role's chunk, run on the same inputs without gradient: its logits go
        to the loss as `kl_ref_logits` (the exact KL).
    """
    batch = next(data_iterator)
    if cp is not None:
        batch = cp_split.split_micro_batch(batch, cp)
    args, kwargs = _model_inputs(batch, cp)
    with (
        output_hidden_states(model) if from_hidden else contextlib.nullcontext(),
        routing(model, batch),
    ):
        output = model(*args, **kwargs)
    if from_hidden and unwrap(model).post_process:
        batch = {**batch, "output_weight": output_weight(model)}
    if kl_model is not None:
        with torch.no_grad():  # a constant of the loss
            batch = {**batch, "kl_ref_logits": kl_model(*args, **kwargs)}
    return output, partial(loss_func, batch)


def _model_inputs(
    batch: Mapping[str, torch.Tensor], cp: dist.ProcessGroup | None
) -> tuple[tuple, dict]:
    """GPTModel's positional and keyword arguments for a micro-batch."""
    if "cu_seqlens" not in batch:
        return (batch["input_ids"], batch["position_ids"], None), {}
    cu = batch["cu_seqlens"]
    max_len = int(batch["max_seqlen"])
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        **({"cp_group": cp} if cp is not None else {}),
    )
    return (batch["packed_ids"], batch["packed_position_ids"], None), {"packed_seq_params": params}
