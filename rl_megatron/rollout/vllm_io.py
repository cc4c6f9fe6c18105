"""Conversions between our rollout types and vLLM's request and response objects.

vLLM is imported inside the functions only, so this module imports where vLLM does not
(the CPU unit tests). Callers hold a built `VllmEngine`, whose construction has already
checked the import and its error message (`vllm_engine.import_vllm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_megatron.rollout.batch import FinishReason
from rl_megatron.rollout.sampling import SamplingParams


def to_vllm_sampling_params(
    sampling: SamplingParams,
    stop_token_ids: Sequence[int],
    seed: int | None,
    *,
    calculate_log_probs: bool = True,
) -> Any:
    """One vLLM `SamplingParams` for a prompt (its n samples get seed, seed+1, …).

    calculate_log_probs: ask for each sampled token's log-prob (`rollout.calculate_log_probs`).
    """
    import vllm

    return vllm.SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=1.0 if sampling.greedy else sampling.top_p,
        # -1 disables top-k on every supported version (0.26 rejects 0).
        top_k=-1 if sampling.greedy or sampling.top_k == 0 else sampling.top_k,
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(stop_token_ids),
        # Our stop ids already hold the EOS when wanted; vLLM's own EOS (none without a
        # tokenizer) must not add another rule.
        ignore_eos=True,
        seed=seed,
        # 0: the sampled token's log-prob only. None: none, so vLLM builds nothing for them
        # on each decode step (benchmarks/rollout_bench.py times both).
        logprobs=0 if calculate_log_probs else None,
        # Flat lists instead of a dict and a Logprob object per generated token: vLLM
        # builds these in Python on every decode step.
        flat_logprobs=True,
        detokenize=False,
    )


def convert_sample(
    prompt_index: int, c: Any, *, calculate_log_probs: bool = True
) -> tuple[list[int], list[float] | None, FinishReason]:
    """One vLLM `CompletionOutput` as (tokens, sampled log-probs, finish reason).

    calculate_log_probs: whether they were requested; False: the log-probs are None.
    """
    tokens = list(c.token_ids)
    log_probs = None
    if calculate_log_probs:
        if c.logprobs is None or len(c.logprobs) != len(tokens):
            raise RuntimeError(
                f"vLLM returned no log-prob for every sampled token of prompt {prompt_index}"
            )
        log_probs = sampled_log_probs(c.logprobs, tokens)
    reason = c.finish_reason or "abort"
    return tokens, log_probs, FinishReason.parse(reason)


def sampled_log_probs(logprobs: Any, tokens: list[int]) -> list[float]:
    """Each sampled token's log-prob, from vLLM's per-position log-probs of the sample."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: each position's entries begin with the sampled one
        ids, values = logprobs.token_ids, logprobs.logprobs
        if all(ids[start] == token for start, token in zip(starts, tokens)):
            return [float(values[start]) for start in starts]
    return [float(step[token].logprob) for step, token in zip(logprobs, tokens)]


def sample_routing(prompt_index: int, c: Any) -> torch.Tensor:
    """The experts vLLM routed a sample's tokens to (`enable_return_routed_experts`):
    `[n, L, k]` for the first n = prompt + response − 1 tokens (vLLM never forwards the
    last sampled token; vllm/distributed/aux_output_connector/connector.py), layers in
    model order."""
    routing = getattr(c, "routed_experts", None)
    if routing is None:
        raise RuntimeError(
            f"vLLM returned no routed experts for a sample of prompt {prompt_index}; this "
            f"vLLM build may not record them (the CPU build needs Model Runner V2)"
        )
    return torch.as_tensor(routing).to(torch.int16)
