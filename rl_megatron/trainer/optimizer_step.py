"""megatron-core's optimizer step with a finiteness gate before any parameter changes.

megatron-core's `optimizer.step()` checks for inf/NaN only when an fp16 grad scaler is in
use; with bf16 or fp32 a NaN loss on one rank becomes NaN gradients after the DP
reduction, a NaN gradient norm, and NaN weights on every rank, which the next rollout
would then reshard into the engine. `step_if_finite` runs the same pieces as megatron-core's
`ChainedOptimizer.step` (prepare the grads, one global gradient norm, clip, step), but
looks first: the gradient norm is already reduced over every rank that holds gradients,
and one more all-reduce tells every rank whether any rank's loss was non-finite. Either
one non-finite and no rank steps, so every rank's weights stay as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32


class NonFiniteUpdateError(RuntimeError):
    """A NaN/inf loss or gradient norm stopped an optimizer step (`trainer.on_nonfinite`)."""


@dataclass(frozen=True)
class StepOutcome:
    stepped: bool  # the parameters changed
    grad_norm: float  # before clipping; NaN/inf when that was the problem
    nonfinite: str | None  # what was not finite ("loss on rank 3", "grad norm"), or None


def step_if_finite(
    optimizer, local_loss: torch.Tensor, group: dist.ProcessGroup | None = None
) -> StepOutcome:
    """Clip and step `optimizer` only when every rank's loss and the gradient norm are finite.

    optimizer: megatron-core's optimizer (`get_megatron_optimizer`: a `ChainedOptimizer`).
    local_loss: 0-d, this rank's summed micro-batch losses (0 off the last pipeline stage).
    group: every rank taking part in this step (None: the default group).
    Collective over `group`. An fp16 grad scaler's overflow is megatron-core's business:
    it skips the step and lowers the scale, as its own `step()` does (not an error).
    """
    if optimizer.prepare_grads():
        return StepOutcome(stepped=False, grad_norm=math.nan, nonfinite=None)
    grad_norm = float(optimizer.get_grad_norm())
    # The lowest rank whose loss is not finite (world size if none): built on the device,
    # one all-reduce, one read.
    first_bad = (
        torch.where(
            torch.isfinite(local_loss).all(), float(dist.get_world_size()), float(dist.get_rank())
        )
        .to(torch.float64)
        .reshape(1)
    )
    dist.all_reduce(first_bad, op=dist.ReduceOp.MIN, group=group)
    bad_rank = int(first_bad.item())
    if bad_rank < dist.get_world_size():
        return StepOutcome(False, grad_norm, f"loss on rank {bad_rank}")
    if not math.isfinite(grad_norm):
        return StepOutcome(False, grad_norm, "gradient norm")
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if opt.config.clip_grad > 0.0 and params:
            clip_grad_by_total_norm_fp32(
                params,
                max_norm=opt.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return StepOutcome(optimizer.step_with_ready_grads(), grad_norm, None)
