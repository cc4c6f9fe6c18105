"""Conversions between our rollout types and vLLM's request and response objects.

vLLM is imported inside the functions only, so this module imports where vLLM does not
(the CPU unit tests). Callers hold a built `VllmEngine`, whose construction has already
checked the import and its error message (`engine.import_vllm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_megatron.rollout.batch import FinishReason
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.vllm.core_loop import CoreSample


def to_vllm_sampling_params(
    sampling: SamplingParams,
    stop_token_ids: Sequence[int],
    seed: int | None,
    *,
    calculate_log_probs: bool = True,
    max_tokens: int | None = None,
) -> Any:
    """One vLLM `SamplingParams` for a prompt (its n samples get seed, seed+1, …).

    calculate_log_probs: ask for each sampled token's log-prob (`rollout.calculate_log_probs`).
    max_tokens: this prompt's cap on new tokens (`SamplingParams.prompt_max_new(i)`); None:
        `sampling.max_new_tokens`.
    """
    import vllm

    return vllm.SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=1.0 if sampling.greedy else sampling.top_p,
        # -1 disables top-k on every supported version (0.26 rejects 0).
        top_k=-1 if sampling.greedy or sampling.top_k == 0 else sampling.top_k,
        max_tokens=sampling.max_new_tokens if max_tokens is None else max_tokens,
        stop_token_ids=list(stop_token_ids),
        # Our stop ids already hold the EOS when wanted; vLLM's own EOS (none without a
        # tokenizer) must not add another rule.
        ignore_eos=True,
        seed=seed,
        # 0: the sampled token's log-prob only. None: none, so vLLM builds nothing for them
        # on each decode step (benchmarks/rollout_bench.py times both).
        logprobs=0 if calculate_log_probs else None,
        # Flat lists instead of a dict and a Logprob object per generated token, where
        # `LLM.generate` builds them (benchmarks' standalone; the trainer's `CoreLoop`
        # reads the engine core's arrays and builds neither).
        flat_logprobs=True,
        detokenize=False,
    )


def convert_sample(
    prompt_index: int, sample: CoreSample, *, calculate_log_probs: bool = True
) -> tuple[list[int], list[float] | None, FinishReason]:
    """One finished sample of `CoreLoop.run` as (tokens, sampled log-probs, finish reason).

    calculate_log_probs: whether they were requested; False: the log-probs are None.
    """
    tokens = sample.token_ids
    log_probs = None
    if calculate_log_probs:
        if sample.log_probs is None or len(sample.log_probs) != len(tokens):
            raise RuntimeError(
                f"vLLM returned no log-prob for every sampled token of prompt {prompt_index}"
            )
        log_probs = sample.log_probs
    if sample.finish_reason == "error":
        raise RuntimeError(
            f"vLLM failed the request of prompt {prompt_index} (finish reason 'error': an "
            f"internal error of the engine, e.g. a KV-cache load)"
        )
    return tokens, log_probs, FinishReason.parse(sample.finish_reason or "abort")


def sample_routing(prompt_index: int, c: CoreSample) -> torch.Tensor:
    """The experts vLLM routed a sample's tokens to (`enable_return_routed_experts`):
    `[n, L, k]` for the first n = prompt + response − 1 tokens (vLLM never forwards the
    last sampled token; vllm/distributed/aux_output_connector/connector.py), layers in
    model order."""
    routing = c.routed_experts
    if routing is None:
        raise RuntimeError(
            f"vLLM returned no routed experts for a sample of prompt {prompt_index}; this "
            f"vLLM build may not record them (the CPU build needs Model Runner V2)"
        )
    return torch.as_tensor(routing).to(torch.int16)
