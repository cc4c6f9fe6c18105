"""Log-probs and entropy from the final hidden states, without materialising the logits.

`vocab_parallel.py` takes `[..., V/tp]` logits: for a micro-batch of N response tokens the
output layer's logits (model dtype), their float32 copy and the exp buffers are
several times N x V/tp — at Qwen2.5's 152k vocabulary, 32k tokens and tp=1 that is tens
of GB. Here the output layer's matmul is folded into the log-prob function and done
`chunk_tokens` rows at a time:

    forward   for each chunk: logits = hidden_c @ weight.T (model dtype, as megatron's
              ColumnParallelLinear computes them), then this rank's per-token statistics
              (`vocab_parallel._shifted_stats`); only `[N]` vectors survive the chunk.
    backward  for each chunk: recompute the logits, d(loss)/d(logits) by
              `vocab_parallel._softmax_grad`, cast to the model dtype (what the output
              layer's backward would receive), then grad_hidden_c = g @ weight and
              grad_weight += g.T @ hidden_c, accumulated in float32 over chunks.

Peak memory is O(chunk_tokens x V/tp) in both passes (about 12 bytes per entry), plus the
float32 weight-gradient accumulator (V/tp x h x 4 bytes) in the backward.

Tensor parallelism: the statistics are the same as `vocab_parallel`'s (max, then sum of
exp, the label's logit and sum p * z, excluding padded ids), but each chunk shifts by this
rank's own max and the group's max is applied afterwards (e^{x - M} = e^{x - m} e^{m - M}),
so the whole call costs two collectives on `[N]` / `[3, N]` tensors, not two per chunk.
The gradient of `hidden` returned here is this rank's contribution only: the sum over the
TP ranks is left to the caller, who passes the hidden states through `tp_region_input`
(an all-reduce of the gradient, or megatron's sequence-parallel gather) as
ColumnParallelLinear does to its input, so the backward reduction happens once.

From a megatron-core GPTModel: `output_hidden_states(model)` makes the model return its
final hidden states `[b, s, h]` (already passed through `tp_region_input`) instead of
logits, and `output_weight(model)` is the weight to use (the output layer's, or the
embedding when tied). This module imports megatron-core only inside those functions, so
the autograd function runs with plain PyTorch (benchmarks/chunked_logprobs_memory.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rl_megatron.models.vocab_parallel import (
    _LOG_FLOOR,
    _finish_stats,
    _group_info,
    _label_slot,
    _scaled_logits,
    _shifted_stats,
    _softmax_grad,
)


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


def _add_weight_grad(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """acc += g.T @ h, with acc float32 (or wider) and g, h in the model dtype."""
    if acc.dtype == g.dtype:
        acc.addmm_(g.t(), h)
    elif g.is_cuda:
        # cuBLAS accumulates bf16/fp16 products in fp32: keep that sum unrounded.
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    else:
        # CPU has no mixed-dtype addmm (tests only): one rounding per chunk.
        acc.add_(torch.mm(g.t(), h))


class _ChunkedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, labels, group, temperature, vocab_size, chunk_tokens, with_entropy
    ):
        tp_size, tp_rank = _group_info(group)
        n, part = hidden.shape[0], weight.shape[0]
        start = tp_rank * part
        wide = torch.promote_types(hidden.dtype, torch.float32)
        shift = torch.empty(n, dtype=wide, device=hidden.device)
        rows = 1 + (labels is not None) + with_entropy
        stats = torch.empty(rows, n, dtype=wide, device=hidden.device)
        for lo in range(0, n, chunk_tokens):
            hi = min(lo + chunk_tokens, n)
            # The model-dtype logits die inside this expression: only the float32 copy lives.
            x = _scaled_logits(hidden[lo:hi] @ weight.t(), temperature, start, vocab_size)
            # This rank's max; floored, so a slice that is all padding (-inf) shifts by a
            # finite amount and contributes e^z = 0.
            m = x.amax(dim=-1).clamp_(min=_LOG_FLOOR)
            x.sub_(m.unsqueeze(-1))
            shift[lo:hi] = m
            stats[:, lo:hi] = torch.stack(
                _shifted_stats(x, _rows(labels, lo, hi), start, with_entropy)
            )
            del x
        if tp_size > 1:
            local_shift = shift
            shift = local_shift.clone()
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            # Re-base from this rank's max m to the group's M: e^{x-M} = e^{x-m} e^{m-M},
            # x - M = (x - m) + (m - M). d <= 0, so nothing overflows.
            d = local_shift - shift
            scale = torch.exp(d)
            if with_entropy:  # sum e^{x-M} (x-M) = e^{d} (sum e^{x-m} (x-m) + d sum e^{x-m})
                stats[-1] = scale * (stats[-1] + d * stats[0])
            if labels is not None:  # only the rank holding the label has a non-zero entry
                local, _ = _label_slot(labels, start, part)
                stats[1] += torch.where(local, d, 0.0)
            stats[0] *= scale
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        log_prob, entropy, log_sum_exp = _finish_stats(stats, labels is not None, with_entropy)
        lse = shift + log_sum_exp  # log-partition of logits / temperature
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.start, ctx.temperature, ctx.vocab_size = start, temperature, vocab_size
        ctx.chunk_tokens = chunk_tokens
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None
        if need_weight:
            wide = torch.promote_types(weight.dtype, torch.float32)
            grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device)
        n, step = hidden.shape[0], ctx.chunk_tokens
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            h = hidden[lo:hi]
            x = _scaled_logits(h @ weight.t(), ctx.temperature, ctx.start, ctx.vocab_size)
            g = _softmax_grad(
                x,
                lse[lo:hi],
                _rows(entropy, lo, hi),
                _rows(labels, lo, hi),
                _rows(grad_log_prob, lo, hi),
                _rows(grad_entropy, lo, hi),
                ctx.start,
                ctx.temperature,
            )
            # The output layer's backward sees d loss / d logits in the logits' dtype.
            g = g.to(hidden.dtype)
            del x
            if need_hidden:
                torch.mm(g, weight, out=grad_hidden[lo:hi])
            if need_weight:
                _add_weight_grad(grad_weight, g, h)
            del g
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    tp_group: dist.ProcessGroup | None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = 1024,
    with_entropy: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of each label and entropy of softmax(hidden @ weight.T / temperature).

    Equal to `vocab_parallel_log_probs_and_entropy(hidden @ weight.T, labels, ...)` (values
    and gradients, up to rounding) without ever holding more than `chunk_tokens` rows of
    logits.

    hidden: `[..., h]` the final-norm output at the positions that predict `labels`,
        identical on every rank of `tp_group` (see `tp_region_input`: the gradient
        returned for it is this rank's share, to be summed over TP by the caller).
    weight: `[V/tp, h]` this rank's rows of the output layer (or of the tied embedding),
        same dtype as `hidden`; rank r holds ids [r * V/tp, (r + 1) * V/tp).
    labels: `[...]` int64 token ids < vocab_size, or None for the entropy only.
    tp_group: the tensor-parallel group sharding the vocabulary; None: not sharded.
    temperature: the sampling temperature (the rollout's).
    vocab_size: true vocabulary size; ids at or beyond it (padding) are excluded.
    chunk_tokens: rows of logits computed at once (peak ~12 bytes x chunk_tokens x V/tp).
    with_entropy: also return the entropy (one more pass over each chunk).
    Returns (log_prob, entropy), each `[...]` float32 (float64 for float64 inputs) and
    replicated over the group, or None where not asked (no labels / no entropy).
    """
    fn = "chunked_log_probs_and_entropy"
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{fn}: hidden {tuple(hidden.shape)} must be [..., h] and weight "
            f"{tuple(weight.shape)} [vocab/tp, h] with the same h"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{fn}: hidden is {hidden.dtype} but weight is {weight.dtype}")
    if labels is not None and labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{fn}: labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} "
            f"without its last (hidden) dimension"
        )
    if labels is None and not with_entropy:
        raise ValueError(f"{fn}: nothing to compute (no labels and with_entropy=False)")
    if not temperature > 0:
        raise ValueError(f"{fn}: temperature must be > 0, got {temperature}")
    padded = weight.shape[0] * _group_info(tp_group)[0]
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(
            f"{fn}: vocab_size {vocab_size} must be in (0, {padded}] (the padded vocabulary "
            f"= {weight.shape[0]} rows per rank x tp size)"
        )
    if chunk_tokens < 1:
        raise ValueError(f"{fn}: chunk_tokens must be >= 1, got {chunk_tokens}")
    lead = hidden.shape[:-1]
    flat_labels = None if labels is None else labels.reshape(-1)
    log_prob, entropy = _ChunkedLogProbEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        flat_labels,
        tp_group,
        float(temperature),
        vocab_size,
        int(chunk_tokens),
        bool(with_entropy),
    )
    return (
        None if log_prob is None else log_prob.view(lead),
        None if entropy is None else entropy.view(lead),
    )


# --------------------------------------------------------------- megatron-core GPTModel


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (a copy).

    megatron's `copy_to_tensor_model_parallel_region` does the same but all-reduces
    `grad.contiguous()` and returns `grad`: when the gradient arrives non-contiguous (it
    does here — GPTModel transposes its output `[s, b, h]` → `[b, s, h]`) the reduced copy
    is dropped and each rank silently keeps its own share.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_region_input(
    hidden: torch.Tensor, tp_group: dist.ProcessGroup | None, sequence_parallel: bool = False
) -> torch.Tensor:
    """`hidden` as the output layer's input: full on every TP rank, gradient summed over TP.

    What megatron's ColumnParallelLinear does to its input before the matmul:
    with sequence parallelism `[s/tp, b, h]` is all-gathered along the sequence (backward:
    reduce-scatter, megatron's `gather_from_sequence_parallel_region`); without, `[s, b, h]`
    is passed through (backward: all-reduce). Apply it once to the hidden states that feed
    `chunked_log_probs_and_entropy`.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return hidden
    if sequence_parallel:
        from megatron.core import tensor_parallel

        return tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=tp_group
        )
    return _SumGradOverTP.apply(hidden, tp_group)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's `[V/tp, h]` output weight of a last-stage GPTModel (tied: the embedding)."""
    from rl_megatron.models.lora import head_weight

    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return head_weight(gpt, gpt.output_layer.weight)  # with a LoRA head: W + (alpha/r)·B·A


@contextlib.contextmanager
def output_hidden_states(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model returns its final hidden states instead of logits.

    A last-stage GPTModel called with `labels=None` then returns `[b, s, h]` (batch-first,
    like its logits; packed: `[1, T, h]`), already through `tp_region_input` — gathered
    over the sequence with sequence parallelism — so it is replicated on the TP ranks and
    its TP gradient reduction happens once in the backward. Other stages are unaffected.

    Only the output layer's `forward` is replaced, on the instance, for the duration of the
    block: parameters, names, state dicts and the module hooks (megatron DDP's parameter
    all-gather pre-hook) stay as they are. Refused where GPTModel feeds the output layer
    anything but the final hidden states: multi-token prediction, and deferred embedding
    wgrad (its schedule expects the layer's activation buffers).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear

    gpt = _unwrap(model)
    if not getattr(gpt, "post_process", False):
        yield
        return
    layer = gpt.output_layer
    if not isinstance(layer, ColumnParallelLinear):
        raise ValueError(
            f"output_hidden_states: the output layer is {type(layer).__name__}, not the LM "
            f"head (ColumnParallelLinear); value heads return values, use them as they are"
        )
    if getattr(gpt.config, "mtp_num_layers", None):
        raise ValueError("output_hidden_states: multi-token prediction is not supported")
    if getattr(gpt.config, "defer_embedding_wgrad_compute", False):
        raise ValueError("output_hidden_states: defer_embedding_wgrad_compute is not supported")
    if layer.bias is not None:
        raise ValueError("output_hidden_states: an output layer with a bias is not supported")
    if "forward" in vars(layer):
        raise RuntimeError("output_hidden_states: already active on this model")

    def forward(input_, weight=None, runtime_gather_output=None):
        # Read at call time: GPTModel's inference path toggles it around a manual gather.
        return tp_region_input(input_, layer.tp_group, layer.sequence_parallel), None

    layer.forward = forward
    layer.returns_hidden_states = True  # a LoRA head's hook adds nothing (models/lora.py)
    try:
        yield
    finally:
        del layer.forward
        del layer.returns_hidden_states
