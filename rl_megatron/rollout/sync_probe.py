"""After each weight sync: how far the engine's policy is from the trainer's, on a fixed batch.

    prompts = probe_prompts(data, config.rollout.sync_probe_prompts)   # the same every step
    probe = engine.generate(prompts, probe_sampling(config.rollout, seed, eos))
    ...                                                  # later, with the actor on the device
    metrics = probe_metrics(probe_batch["rollout_log_prob"], actor_log_prob, mask, group)

The step's own mismatch metrics (`rollout/logprob_diff_*`, `algorithms/rollout_correction.py`)
are measured on whatever the step sampled, so they move with the data and the policy; a
probe of the same prompts, sampled with the same seed after every sync, separates a sync or
numerics regression (FP8 weights, a repacked layout the sync missed, a new kernel) from the
training's drift. NeMo-RL logs the same kind of figure after each refit
(`token_mult_prob_error`: the mean of exp|Δ| over tokens).

With d = log pi_trainer - log pi_engine per sampled token (mask 1):
    sync_probe/logprob_diff_mean, _p99, _max: of |d| over every replica's probe tokens;
    sync_probe/token_mult_prob_error: mean of exp(|d|) (1 when the two agree);
    sync_probe/tokens: how many tokens the figures cover.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rl_megatron.rollout.sampling import SamplingParams

# exp|d| of a token whose log-probs differ by more than this is counted as exp(20): one
# token at -inf (a probability the other side gives 0) must not make the mean inf.
_MAX_ABS_LOG_RATIO = 20.0


def probe_prompts(train_ids: Sequence[Sequence[int]], val_ids, count: int) -> list[list[int]]:
    """The first `count` held-out prompts (the training set's when there are none): the
    same on every replica and at every step, so consecutive syncs are compared on equal
    terms."""
    source = val_ids if val_ids is not None and len(val_ids) else train_ids
    if len(source) < count:
        raise ValueError(
            f"rollout.sync_probe_prompts: {count} prompts asked, the data has {len(source)}"
        )
    return [list(source[i]) for i in range(count)]


def probe_sampling(rollout, seed: int, eos_token_id: int | None) -> SamplingParams:
    """Sampled at the rollout's temperature (the trainer's log-probs use it too), without
    top-k / top-p (the trainer does not filter), one response per prompt, a fixed seed."""
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=rollout.sync_probe_tokens,
        n=1,
        seed=seed,
        prompt_overflow="truncate_left",
        max_prompt_len=rollout.max_prompt_length,
        stop_token_ids=None if eos_token_id is None else (eos_token_id,),
    )


def probe_metrics(
    engine_log_prob: torch.Tensor,
    trainer_log_prob: torch.Tensor,
    mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The probe's figures (module docstring) over the tokens of every rank of `group`
    (each a `[rows, width]` of its own; None: this rank's only)."""
    if not engine_log_prob.shape == trainer_log_prob.shape == mask.shape:
        raise ValueError(
            f"probe_metrics: engine {tuple(engine_log_prob.shape)}, trainer "
            f"{tuple(trainer_log_prob.shape)} and mask {tuple(mask.shape)} must agree"
        )
    valid = mask.bool()
    diff = (trainer_log_prob.double() - engine_log_prob.double())[valid].abs().cpu()
    diff = torch.nan_to_num(diff, nan=float("inf"))  # a NaN is a mismatch, not a skip
    if group is not None and dist.get_world_size(group) > 1:
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, diff, group=group)  # a few hundred values each
        diff = torch.cat(parts)
    if diff.numel() == 0:
        return {"sync_probe/tokens": 0.0}
    capped = diff.clamp(max=_MAX_ABS_LOG_RATIO)
    return {
        "sync_probe/logprob_diff_mean": diff.mean().item(),
        "sync_probe/logprob_diff_p99": torch.quantile(diff, 0.99).item(),
        "sync_probe/logprob_diff_max": diff.max().item(),
        "sync_probe/token_mult_prob_error": capped.exp().mean().item(),
        "sync_probe/tokens": float(diff.numel()),
    }
