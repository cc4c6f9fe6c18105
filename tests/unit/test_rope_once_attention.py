"""`RopeOnceSelfAttention` decodes exactly as megatron-core's `SelfAttention` does.

The local layer spec's attention caches keys rotated once; megatron-core's own rotates
its whole (unrotated) cache again at every step. Both rotate each key with the same
embedding row and the same call, so the Megatron engine must produce the same tokens and
the very same log-probs (bitwise: `torch.equal`) with either class, over a prefill of
left-padded prompts and every decode step after it, greedy and sampled. A key rotated at
the wrong position, or twice, changes the logits of every step after the prefill.

One single-rank spawn on CPU (fp32); the stock behaviour is the same modules with their
class set back to `SelfAttention`, so the weights are shared by construction.
"""

from __future__ import annotations

import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.rollout_refs import tiny_llama
from tests.spawn import run_on_ranks

PROMPTS = [[5, 9, 3], [7] * 11, [4, 8, 15, 16, 23, 42, 6], [12]]
MAX_NEW = 16


def _generate(chunks, info, sampling):
    from rl_megatron.rollout.megatron.engine import MegatronEngine

    engine = MegatronEngine(chunks, info, eos_token_ids=[2], max_model_len=64, seed=0)
    batch = engine.generate(PROMPTS, sampling)
    return batch.responses.clone(), batch.rollout_log_probs.clone()


def _body(rank: int, world_size: int, ckpt: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.attention import SelfAttention

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.models.rope_once_attention import RopeOnceSelfAttention
    from rl_megatron.rollout.sampling import SamplingParams

    parallel_state.initialize_model_parallel(1, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    info = load_hf_config(ckpt)
    chunks = build_actor(ckpt, ParallelLayout.from_megatron(), dtype=torch.float32)
    attentions = [layer.self_attention for layer in chunks[0].decoder.layers]
    assert all(type(a) is RopeOnceSelfAttention for a in attentions)
    samplings = [
        SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0.8, n=2, max_new_tokens=MAX_NEW, ignore_eos=True, seed=3),
    ]
    ours = [_generate(chunks, info, s) for s in samplings]
    for attention in attentions:
        attention.__class__ = SelfAttention  # megatron-core's cache: rotated every step
    stock = [_generate(chunks, info, s) for s in samplings]
    for (tokens, log_probs), (want_tokens, want_log_probs) in zip(ours, stock, strict=True):
        assert torch.equal(tokens, want_tokens)
        assert torch.equal(log_probs, want_log_probs), (log_probs - want_log_probs).abs().max()
    parallel_state.destroy_model_parallel()


def test_rope_once_decodes_as_megatron_core(tmp_path):
    tiny_llama(0).save_pretrained(tmp_path, safe_serialization=True)
    run_on_ranks(_body, world_size=1, ckpt=str(tmp_path))
