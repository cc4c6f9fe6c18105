"""Log-probs, entropy and the exact KL from tensor-parallel (vocabulary-sharded) logits.

Megatron's output layer leaves each TP rank with logits for a contiguous slice of the
(padded) vocabulary: rank r holds ids `[r * V_r, (r + 1) * V_r)` in `[..., V_r]`. The
softmax statistics a rank needs from the others are per token, not per vocabulary entry:
the max logit (all-reduce MAX), then the sum of exp, the label's logit and the sum of
p * logit (one all-reduce SUM of a stacked `[3, ...]` tensor). No rank ever holds the full
vocabulary.

Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * tp`; the
padded rows of the output layer produce logits for ids that are not tokens. Passing the
true `vocab_size` excludes them from the softmax (probability 0, no gradient).

The backward pass needs no communication: every per-token statistic is saved, and each rank
recomputes its own slice of the softmax from the logits it already holds, instead of
keeping a float32 copy of the probabilities alive between forward and backward.

The tensor-parallel group is an explicit argument. Outputs are float32 and replicated on
every rank of the group; the gradient of each rank's logit slice is its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Floor for log-probabilities and shifted logits where padding puts -inf. exp(-1e4) is 0 in
# every float type (the smallest positive fp64 is e^-745), so flooring changes no
# probability, and the floored value times a gradient stays finite (finfo.min would
# overflow to -inf, and -inf * 0 is NaN).
_LOG_FLOOR = -1.0e4


def _scaled_logits(
    logits: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int | None
) -> torch.Tensor:
    """logits / temperature in float32 or wider (a new tensor), padding entries at -inf."""
    # One pass over the vocabulary-sized tensor, not two: the copy is made once and
    # divided in place (not at all at temperature 1).
    x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    if temperature != 1.0:
        x.div_(temperature)
    if vocab_size is not None and vocab_start + x.shape[-1] > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device)
        x.masked_fill_(ids >= vocab_size, float("-inf"))
    return x


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _label_slot(labels: torch.Tensor, start: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels fall in this rank's ids [start, start + part), and their local index."""
    local = (labels >= start) & (labels < start + part)
    idx = (labels - start).clamp(0, part - 1).unsqueeze(-1)
    return local, idx


def _shifted_stats(
    z: torch.Tensor, labels: torch.Tensor | None, start: int, with_entropy: bool
) -> list[torch.Tensor]:
    """This rank's per-token [sum e^z, z of the label (0 elsewhere), sum e^z * z].

    z: `[..., V_r]` shifted logits (x - shift, <= 0 where shift is the max), float32 or
    wider; consumed (overwritten). The label and entropy terms are present only when asked.
    """
    e = torch.exp(z)
    stats = [e.sum(dim=-1)]
    if labels is not None:
        local, idx = _label_slot(labels, start, z.shape[-1])
        stats.append(torch.where(local, z.gather(-1, idx).squeeze(-1), 0.0))
    if with_entropy:
        # Padding sits at -inf with e = 0; a finite floor keeps e * z at 0 instead of NaN.
        # In place: z is no longer needed, so no third vocabulary-sized buffer.
        stats.append(z.clamp_(min=_LOG_FLOOR).mul_(e).sum(dim=-1))
    return stats


def _finish_stats(
    stats: torch.Tensor, has_labels: bool, with_entropy: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(log_prob, entropy, log sum e^z) from the group's summed `_shifted_stats`."""
    sum_exp = stats[0]
    log_sum_exp = sum_exp.log()
    log_prob = stats[1] - log_sum_exp if has_labels else None
    # H = log Z - E_p[z], with z the shifted logits: exact and cancellation-free.
    entropy = log_sum_exp - stats[-1] / sum_exp if with_entropy else None
    return log_prob, entropy, log_sum_exp


def _softmax_grad(
    x: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    labels: torch.Tensor | None,
    grad_log_prob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    start: int,
    temperature: float,
) -> torch.Tensor:
    """Gradient of sum(grad_log_prob * log_prob + grad_entropy * entropy) w.r.t. the raw
    logits of this rank's slice, float32 (or wider), built in `x`'s buffer.

    x: `[..., V_r]` the logits as `_scaled_logits` returns them (consumed).
    lse: `[...]` the log-partition of logits / temperature over the whole vocabulary.
    """
    log_p = x.sub_(lse.unsqueeze(-1))
    p = torch.exp(log_p)
    # d log p_y / d z_j = [j == y] - p_j;  d H / d z_j = -p_j (log p_j + H).
    # Both share -p_j * (...): build (...) in log_p's buffer, so the backward holds two
    # vocabulary-sized tensors (log_p, p) and no more.
    with_lp = labels is not None and grad_log_prob is not None
    if entropy is not None and grad_entropy is not None:
        log_p.clamp_(min=_LOG_FLOOR)  # padding: p = 0, log p = -inf
        log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
    else:
        log_p.zero_()
    if with_lp:
        log_p.add_(grad_log_prob.unsqueeze(-1))
    grad = log_p.mul_(p).neg_()
    del p
    if with_lp:
        local, idx = _label_slot(labels, start, grad.shape[-1])
        grad.scatter_add_(-1, idx, torch.where(local, grad_log_prob, 0.0).unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)  # z = logits / temperature
    return grad


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, temperature, vocab_size, with_entropy):
        tp_size, tp_rank = _group_info(group)
        start = tp_rank * logits.shape[-1]
        x = _scaled_logits(logits, temperature, start, vocab_size)
        shift = x.amax(dim=-1)
        if tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        x.sub_(shift.unsqueeze(-1))  # z = x - max <= 0: exp cannot overflow
        stats = torch.stack(_shifted_stats(x, labels, start, with_entropy))
        del x
        if tp_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        log_prob, entropy, log_sum_exp = _finish_stats(stats, labels is not None, with_entropy)
        lse = shift + log_sum_exp  # log-partition of logits / temperature
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.start, ctx.temperature, ctx.vocab_size = start, temperature, vocab_size
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        x = _scaled_logits(logits, ctx.temperature, ctx.start, ctx.vocab_size)
        grad = _softmax_grad(
            x, lse, entropy, labels, grad_log_prob, grad_entropy, ctx.start, ctx.temperature
        )
        return grad.to(logits.dtype), None, None, None, None, None


def _check(
    fn: str,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    temperature: float,
    vocab_size: int | None,
) -> None:
    if labels is not None and labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"{fn}: labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} "
            f"without its last (vocabulary) dimension"
        )
    if not temperature > 0:
        raise ValueError(f"{fn}: temperature must be > 0, got {temperature}")
    padded = logits.shape[-1] * _group_info(group)[0]
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(
            f"{fn}: vocab_size {vocab_size} must be in (0, {padded}] (the padded vocabulary "
            f"= {logits.shape[-1]} per rank x tp size)"
        )


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of softmax(logits / temperature), from TP shards.

    logits: `[..., vocab/tp]` this rank's vocabulary slice (bf16/fp16 are computed in fp32).
    labels: `[...]` int64 token ids in the full vocabulary (e.g. the next token of each
        position); must be < vocab_size (a padded id gives -inf).
    tp_group: the tensor-parallel group sharding the vocabulary; None means not sharded.
        Ranks are taken in group order: rank r holds ids [r * V_r, (r + 1) * V_r).
    temperature: the sampling temperature, so that log-probs match the rollout's.
    vocab_size: true vocabulary size; ids at or beyond it (padding) are excluded.
    Returns (log_prob, entropy) `[...]` in float32 (float64 for float64 logits),
    differentiable with respect to logits.
    """
    _check(
        "vocab_parallel_log_probs_and_entropy", logits, labels, tp_group, temperature, vocab_size
    )
    return _VocabParallelLogProbEntropy.apply(
        logits, labels, tp_group, temperature, vocab_size, True
    )


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Log-prob of each label only; arguments as `vocab_parallel_log_probs_and_entropy`."""
    _check("vocab_parallel_log_probs", logits, labels, tp_group, temperature, vocab_size)
    log_prob, _ = _VocabParallelLogProbEntropy.apply(
        logits, labels, tp_group, temperature, vocab_size, False
    )
    return log_prob


def vocab_parallel_entropy(
    logits: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Entropy only; arguments as `vocab_parallel_log_probs_and_entropy`."""
    _check("vocab_parallel_entropy", logits, None, tp_group, temperature, vocab_size)
    _, entropy = _VocabParallelLogProbEntropy.apply(
        logits, None, tp_group, temperature, vocab_size, True
    )
    return entropy


class _VocabParallelKL(torch.autograd.Function):
    """KL(softmax(x) || softmax(y)) per position, x with gradient, y a constant.

    With z = x - max x, w = y - max y (shifted, so exp cannot overflow) and Z, W their sums
    of exp: KL = sum_v e^z (z - w) / Z - log Z + log W. One all-reduce MAX of both shifts,
    one all-reduce SUM of [Z, W, sum e^z (z - w)]. The backward needs no communication:
    d KL / d x_j = p_j (log p_j - log q_j - KL), each rank's own slice.
    """

    @staticmethod
    def forward(ctx, logits, ref_logits, group, temperature, vocab_size):
        tp_size, tp_rank = _group_info(group)
        start = tp_rank * logits.shape[-1]
        x = _scaled_logits(logits, temperature, start, vocab_size)
        y = _scaled_logits(ref_logits.detach(), temperature, start, vocab_size)
        shifts = torch.stack([x.amax(dim=-1), y.amax(dim=-1)])
        if tp_size > 1:
            dist.all_reduce(shifts, op=dist.ReduceOp.MAX, group=group)
        x.sub_(shifts[0].unsqueeze(-1))
        y.sub_(shifts[1].unsqueeze(-1))
        ex = torch.exp(x)
        sums = [ex.sum(dim=-1), torch.exp(y).sum(dim=-1)]
        # Padding is -inf in both (e^z = 0): floored, its z - w is 0 instead of NaN.
        x.clamp_(min=_LOG_FLOOR)
        y.clamp_(min=_LOG_FLOOR)
        sums.append((ex * (x - y)).sum(dim=-1))
        del ex, x, y
        stats = torch.stack(sums)
        if tp_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        log_z, log_w = stats[0].log(), stats[1].log()
        kl = stats[2] / stats[0] - log_z + log_w
        ctx.save_for_backward(logits, ref_logits, shifts[0] + log_z, shifts[1] + log_w, kl)
        ctx.start, ctx.temperature, ctx.vocab_size = start, temperature, vocab_size
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        logits, ref_logits, lse_x, lse_y, kl = ctx.saved_tensors
        log_p = _scaled_logits(logits, ctx.temperature, ctx.start, ctx.vocab_size)
        log_p.sub_(lse_x.unsqueeze(-1)).clamp_(min=_LOG_FLOOR)
        log_q = _scaled_logits(ref_logits, ctx.temperature, ctx.start, ctx.vocab_size)
        log_q.sub_(lse_y.unsqueeze(-1)).clamp_(min=_LOG_FLOOR)
        p = torch.exp(log_p)
        grad = log_p.sub_(log_q).sub_(kl.unsqueeze(-1)).mul_(p)
        del p, log_q
        grad.mul_(grad_kl.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(logits.dtype), None, None, None, None


def vocab_parallel_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Exact KL(pi || pi_ref) at each position, from both models' TP shards of the logits.

    pi = softmax(logits / temperature), pi_ref = softmax(ref_logits / temperature) over the
    true vocabulary (`algorithms.kl.kl_full` for whole logits).
    logits: `[..., vocab/tp]` this rank's slice of the policy's logits (with gradient).
    ref_logits: `[..., vocab/tp]` the same slice of the reference's (no gradient).
    tp_group, temperature, vocab_size: as `vocab_parallel_log_probs_and_entropy`.
    Returns `[...]` float32 (float64 for float64 logits), replicated on the group's ranks.
    """
    _check("vocab_parallel_kl", logits, None, tp_group, temperature, vocab_size)
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"vocab_parallel_kl: ref_logits {tuple(ref_logits.shape)} must match logits "
            f"{tuple(logits.shape)}"
        )
    return _VocabParallelKL.apply(logits, ref_logits, tp_group, temperature, vocab_size)
