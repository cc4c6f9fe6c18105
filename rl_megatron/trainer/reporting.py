"""What a training step reports: batch statistics, throughput and MFU, the console line.

Functions of the step's tensors and metrics only, so `ppo_trainer.py` keeps to the loop.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.utils.flops import TransformerShape, device_peak_tflops, flops_per_token


def batch_stats(
    batch: dict[str, torch.Tensor], entropy: torch.Tensor, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Advantage, entropy, KL-to-reference and value statistics over the valid tokens of
    the whole batch: sums over `group` (data parallel), one all-reduce."""
    valid = batch["response_mask"].bool()
    columns = {
        "advantages": batch["advantages"],
        "entropy": entropy,
        "kl": batch["old_log_prob"] - batch["ref_log_prob"] if "ref_log_prob" in batch else None,
        "values": batch.get("values"),
        "returns": batch["returns"] if "values" in batch else None,
    }
    present = [k for k, v in columns.items() if v is not None]
    x = torch.stack([torch.where(valid, columns[k], 0.0).double() for k in present])
    adv = x[0]
    sums = torch.cat([valid.sum().double()[None], x.sum(dim=(1, 2)), adv.square().sum()[None]])
    if group is not None:
        dist.all_reduce(sums, group=group)
    count = max(sums[0].item(), 1.0)
    mean = dict(zip(present, (sums[1:-1] / count).tolist()))
    # Population std over all tokens, E[a^2] - E[a]^2 in float64 (whitened: ~1).
    std = math.sqrt(max(sums[-1].item() / count - mean["advantages"] ** 2, 0.0))
    stats = {
        "advantages/mean": mean["advantages"],
        "advantages/std": std,
        "actor/entropy_rollout": mean["entropy"],
    }
    if "kl" in mean:
        stats["actor/kl_to_ref"] = mean["kl"]
    if "values" in mean:
        stats["critic/values_mean"] = mean["values"]
        stats["critic/returns_mean"] = mean["returns"]
    return stats


# The phases that train on the step's batch (forward-only passes included): what
# `perf/train_tokens_per_s_per_device` divides by. Generation is `timing_s/generate`.
TRAINING_PHASES = ("old_log_probs", "reference", "values", "update_critic", "update_actor")


def throughput(metrics: dict[str, float], info: HFModelInfo, ppo_epochs: int) -> dict[str, float]:
    """Tokens per second per device over the step, over its generation and over its
    training phases apart (the two sides an asynchronous run overlaps or interleaves), and
    the actor update's MFU."""
    # num_samples is summed over DP: the global count of sequences this step.
    seq = metrics["rollout/prompt_length_mean"] + metrics["rollout/response_length_mean"]
    tokens = metrics["rollout/num_samples"] * seq
    step_s = sum(v for k, v in metrics.items() if k.startswith("timing_s/"))
    world = dist.get_world_size()
    out = {"perf/tokens_per_s_per_device": tokens / max(step_s, 1e-9) / world}
    # Generated: what this step's generation sampled (asynchronous runs count their own,
    # carried and restarted samples included); else the responses trained on.
    generated = metrics.get(
        "async/generated_tokens",
        metrics["rollout/num_samples"] * metrics["rollout/response_length_mean"],
    )
    generate_s = metrics.get("timing_s/generate", 0.0)
    if generate_s > 0:
        out["perf/generate_tokens_per_s_per_device"] = generated / generate_s / world
    train_s = sum(metrics.get(f"timing_s/{phase}", 0.0) for phase in TRAINING_PHASES)
    if train_s > 0:
        out["perf/train_tokens_per_s_per_device"] = tokens / train_s / world
    peak = device_peak_tflops()
    update_s = metrics.get("timing_s/update_actor", 0.0)
    if peak and update_s > 0:
        flops = tokens * ppo_epochs * flops_per_token(TransformerShape.of(info), int(seq))
        out["perf/mfu_update_actor"] = flops / update_s / dist.get_world_size() / (peak * 1e12)
    return out


def console_line(step: int, total_steps: int, m: dict[str, float]) -> str:
    """The one line per step the launcher prints."""
    line = (
        f"step {step}/{total_steps} | reward {m['reward/mean']:.3f}"
        f"±{m.get('reward/std', 0.0):.3f} | len {m['rollout/response_length_mean']:.1f}"
        f" | entropy {m['actor/entropy_rollout']:.2f}"
        f" | clip {m.get('actor/pg_clipfrac', 0.0):.3f}"
        f" | gnorm {m.get('actor/grad_norm', math.nan):.2f}"
    )
    if "critic/loss" in m:
        line += f" | vloss {m['critic/loss']:.4f} ev {m['critic/explained_variance']:.2f}"
    if "actor/kl_to_ref" in m:
        line += f" | kl {m['actor/kl_to_ref']:.4f}"
    if "multi_turn/turns_mean" in m:  # multi-turn: turns and tool calls per trajectory
        line += f" | turns {m['multi_turn/turns_mean']:.2f}"
        if "env/tool_calls_per_traj" in m:
            line += f" tools {m['env/tool_calls_per_traj']:.2f}"
    if "val/reward_mean" in m:
        line += f" | val {m['val/reward_mean']:.3f}"
    line += (
        f" | {m['timing_s/step']:.1f}s (gen {m.get('timing_s/generate', 0):.1f}"
        f", upd {m.get('timing_s/update_actor', 0):.1f})"
        f" | {m['perf/tokens_per_s_per_device']:.0f} tok/s/dev"
    )
    return line
