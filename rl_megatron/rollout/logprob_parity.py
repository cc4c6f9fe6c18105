"""Recompute sampled tokens' log-probs with the Megatron actor and compare with the engine's.

A mismatch between the engine's log-probs (what the rollout was sampled from) and the
trainer's (what PPO's ratio uses as π_old) is a known source of RL instability: large
values point at a weight-sync bug, a different temperature, or a numerics gap
(bf16 kernels, top-k/top-p filtering that the trainer does not apply). The metric is
logged every step; the recomputed values are the trainer's old log-probs anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.hf_loader import unwrap
from rl_megatron.models.sdpa_attention import causal_padding_mask
from rl_megatron.models.vocab_parallel import vocab_parallel_log_probs
from rl_megatron.rollout.batch import RolloutBatch


@torch.no_grad()
def recompute_log_probs(
    model_chunks: Sequence[torch.nn.Module],
    batch: RolloutBatch,
    *,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    micro_batch_size: int = 8,
) -> torch.Tensor:
    """`[B, R]` fp32 log-probs of `batch.responses` under the model (0 on padding).

    model_chunks: `[GPTModel]` of this rank (PP = 1), vocabulary-parallel logits.
    tp_group: the group sharding the vocabulary (None: not sharded).
    temperature: the rollout's temperature (use 1.0 for greedy rollouts).
    vocab_size: true vocabulary size (padding ids excluded from the softmax).
    """
    if len(model_chunks) != 1:
        raise ValueError(f"recompute_log_probs needs pp=1 (one chunk), got {len(model_chunks)}")
    model = unwrap(model_chunks[0])
    model.eval()
    device = next(model.parameters()).device
    p = batch.prompt_width
    out = []
    for mb in batch.chunk(micro_batch_size):
        mb = mb.to(device)
        logits = model(mb.input_ids, mb.position_ids, causal_padding_mask(mb.attention_mask))
        # Column P-1+k predicts response token k.
        resp_logits = logits[:, p - 1 : -1]
        lp = vocab_parallel_log_probs(resp_logits, mb.responses, tp_group, temperature, vocab_size)
        out.append((lp * mb.response_mask).float().cpu())
    return torch.cat(out, 0)


def log_prob_mismatch(
    rollout_log_probs: torch.Tensor, recomputed: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Max and mean |engine − trainer| over response tokens (all `[B, R]`)."""
    valid = response_mask.bool()
    diff = (rollout_log_probs.float() - recomputed.float()).abs()[valid]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_max": 0.0, "rollout/logprob_diff_mean": 0.0}
    return {
        "rollout/logprob_diff_max": diff.max().item(),
        "rollout/logprob_diff_mean": diff.mean().item(),
    }
