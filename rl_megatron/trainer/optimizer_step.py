"""A role's optimizer: megatron-core's distributed optimizer, its learning rate, its step.

`build_optimizer` makes it from `OptimConfig`, `set_lr` sets a step's learning rate and
weight decay, and `step_if_finite` steps it with a finiteness gate before any parameter
changes.

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

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.transformer import TransformerConfig

from rl_megatron.checkpoint.mcore_compat import precision_aware_without_te
from rl_megatron.config import OptimConfig


def build_optimizer(model: list[torch.nn.Module], config: TransformerConfig, optim: OptimConfig):
    """megatron-core's distributed Adam over the role's DDP chunks `model` (`config`: their
    TransformerConfig), with `optim`'s settings; its learning rate is set per step
    (`set_lr`). With `optim.cpu_offload_fraction` > 0 that share of the optimizer state
    lives in host memory and is stepped there (`_cpu_offload_fields`)."""
    dtype = config.params_dtype
    offload_fields = _cpu_offload_fields(optim, dtype)
    with precision_aware_without_te() if offload_fields else contextlib.nullcontext():
        optimizer_config = OptimizerConfig(
            optimizer="adam",  # the distributed optimizer supports Adam only
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            **offload_fields,
        )
    return get_megatron_optimizer(optimizer_config, model)


def _cpu_offload_fields(optim: OptimConfig, dtype: torch.dtype) -> dict:
    """megatron-core's optimizer CPU offload (`HybridDeviceOptimizer`) for
    `optim.cpu_offload_fraction` > 0, as `OptimizerConfig` fields; none when it is 0, so that
    the default optimizer is built exactly as without the key."""
    if optim.cpu_offload_fraction <= 0:
        return {}
    if dtype != torch.bfloat16:
        # fp32: megatron-core fails ("can't optimize a non-leaf Tensor"); fp16: its steps
        # did not match the default optimizer's (config_checks refuses both, by key).
        raise ValueError(f"optim.cpu_offload_fraction needs bf16 weights, got {dtype}")
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": optim.cpu_offload_fraction,
        # Required with the offload (Megatron-LM refuses it otherwise): the hybrid optimizer
        # then holds the fp32 master weights itself, on the host for its offloaded share,
        # and the distributed optimizer keeps no fp32 copy of the weights on the device.
        "use_precision_aware_optimizer": True,
        "decoupled_weight_decay": True,  # megatron-core's CPU Adam is AdamW (as by default)
        "overlap_cpu_optimizer_d2h_h2d": optim.cpu_offload_overlap,
    }


def set_lr(optimizer, lr: float, weight_decay: float) -> None:
    """This step's learning rate and weight decay in every parameter group of `optimizer`.

    megatron-core marks biases and 1-D parameters (norms) with `wd_mult` 0 but leaves
    applying it to its `OptimizerParamScheduler`, which we do not use: without the
    multipliers here the norms would be decayed towards 0. With the optimizer CPU
    offload these are the `HybridDeviceOptimizer`'s groups, which it copies into its
    CPU and device optimizers at every step.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


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
