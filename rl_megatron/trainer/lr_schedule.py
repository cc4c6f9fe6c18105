"""The learning-rate schedule of a role's optimizer: linear warm-up, then constant, linear or
cosine decay (Megatron-LM's `OptimizerParamScheduler`, without its weight-decay schedule)."""

from __future__ import annotations

import math

from rl_megatron.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int | None) -> float:
    """Learning rate of optimizer step `step` (0-based).

    Linear warm-up over `lr_warmup_steps` reaching `lr` at the last warm-up step (the
    first step trains at lr / warmup, not 0), then `constant`, or `linear` / `cosine`
    decay to `min_lr` over `lr_decay_steps` (default `total_steps`) counted after warm-up.
    """
    warmup = optim.lr_warmup_steps
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    if optim.lr_decay_style == "constant":
        return optim.lr
    decay_steps = optim.lr_decay_steps or total_steps
    if not decay_steps:
        raise ValueError(
            f"lr_decay_style={optim.lr_decay_style!r} needs optim.lr_decay_steps or the "
            f"run's total steps"
        )
    frac = min(max(step - warmup, 0) / max(decay_steps - warmup, 1), 1.0)
    if optim.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    return optim.min_lr + (optim.lr - optim.min_lr) * coeff
