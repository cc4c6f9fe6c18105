"""Conversions to and from vLLM's objects (rollout/vllm/io.py), on the real vLLM classes.

In-process and quick (no engine): `vllm.SamplingParams` validates what we build, and
`CoreSample` is what the trainer's `CoreLoop` hands back.
"""

from __future__ import annotations

import pytest
import vllm

from rl_megatron.rollout.batch import FinishReason
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.vllm.core_loop import CoreSample
from rl_megatron.rollout.vllm.io import convert_sample, to_vllm_sampling_params

# No skip when vLLM is missing (as test_vllm_engine.py): `make test` installs the CPU build.
pytestmark = pytest.mark.vllm


def test_sampling_params_ask_for_log_probs_only_when_calculated():
    sampling = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, n=3)
    on = to_vllm_sampling_params(sampling, [2], seed=11)
    assert isinstance(on, vllm.SamplingParams)
    assert on.logprobs == 0 and on.flat_logprobs  # the sampled token's only, flat
    off = to_vllm_sampling_params(sampling, [2], seed=11, calculate_log_probs=False)
    assert off.logprobs is None
    # Nothing else changes: the same tokens are sampled either way.
    for name in ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed"):
        assert getattr(off, name) == getattr(on, name), name
    assert (off.n, off.top_k, off.max_tokens, off.seed) == (3, 5, 9, 11)
    # A prompt's own cap (prompt_max_new_tokens) becomes its request's max_tokens.
    assert to_vllm_sampling_params(sampling, [2], seed=11, max_tokens=4).max_tokens == 4


def test_convert_sample_with_and_without_log_probs():
    sample = CoreSample([5, 7, 2], [-0.5, -1.25, -2.0], "stop")
    tokens, log_probs, reason = convert_sample(0, sample)
    assert (tokens, log_probs, reason) == ([5, 7, 2], [-0.5, -1.25, -2.0], FinishReason.STOP)

    # Not requested: vLLM returns none, and none are needed.
    out = convert_sample(3, CoreSample([5, 7], None, "length"), calculate_log_probs=False)
    assert out == ([5, 7], None, FinishReason.LENGTH)
    out = convert_sample(3, CoreSample([], None, None), calculate_log_probs=False)
    assert out == ([], None, FinishReason.ABORT)
    # Requested but missing, or one short, is vLLM's bug, named with the prompt.
    with pytest.raises(RuntimeError, match="no log-prob for every sampled token of prompt 3"):
        convert_sample(3, CoreSample([5, 7], None, "length"))
    with pytest.raises(RuntimeError, match="no log-prob for every sampled token of prompt 3"):
        convert_sample(3, CoreSample([5, 7], [-0.5], "length"))
    # The engine's own failure of a request is an error, not a short response.
    with pytest.raises(RuntimeError, match="vLLM failed the request of prompt 4"):
        convert_sample(4, CoreSample([5], None, "error"), calculate_log_probs=False)
