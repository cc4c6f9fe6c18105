"""The sync probe (`rollout/sync_probe.py`): its figures against hand computations, its prompts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rl_megatron.rollout.sync_probe import probe_metrics, probe_prompts, probe_sampling
from tests.spawn import run_on_ranks


def test_figures_cover_masked_tokens_only():
    # |d| = 0, 1, ..., 100 on the tokens kept; a masked token differs by 1000.
    engine = torch.zeros(1, 102)
    trainer = torch.cat([torch.arange(101.0), torch.tensor([1000.0])])[None]
    mask = torch.ones(1, 102)
    mask[0, -1] = 0
    got = probe_metrics(engine, trainer, mask)
    assert got["sync_probe/tokens"] == 101
    assert got["sync_probe/logprob_diff_mean"] == 50.0
    assert got["sync_probe/logprob_diff_max"] == 100.0
    # The 99th percentile of 0..100, interpolated between order statistics: 99.
    assert got["sync_probe/logprob_diff_p99"] == pytest.approx(99.0)
    # exp|d| is capped at exp(20): 0..20 as they are, 80 tokens at e^20.
    want = (sum(math.exp(k) for k in range(21)) + 80 * math.exp(20)) / 101
    assert got["sync_probe/token_mult_prob_error"] == pytest.approx(want, rel=1e-12)


def test_agreement_is_zero_and_one_and_signs_do_not_cancel():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    same = probe_metrics(lp, lp.clone(), mask)
    assert same["sync_probe/logprob_diff_max"] == 0.0
    assert same["sync_probe/token_mult_prob_error"] == 1.0
    # +0.1 and -0.1: the mean of |d| is 0.1, not 0.
    shifted = probe_metrics(lp, lp + torch.tensor([[0.1, -0.1, 0.1, 9.0]]), mask)
    assert shifted["sync_probe/logprob_diff_mean"] == pytest.approx(0.1)
    assert shifted["sync_probe/token_mult_prob_error"] == pytest.approx(math.exp(0.1))


def test_non_finite_values_are_mismatches_not_skips():
    engine = torch.tensor([[-1.0, -float("inf"), -1.0]])
    trainer = torch.tensor([[float("nan"), -1.0, -1.0]])
    got = probe_metrics(engine, trainer, torch.ones(1, 3))
    assert got["sync_probe/tokens"] == 3
    assert got["sync_probe/logprob_diff_max"] == float("inf")
    # Both non-finite tokens count at the cap, the equal one at 1: the mean stays finite.
    assert got["sync_probe/token_mult_prob_error"] == pytest.approx((2 * math.exp(20) + 1) / 3)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="must agree"):
        probe_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def _two_replicas(rank, world_size):
    import torch.distributed as dist

    # Rank 0's tokens differ by 0..49, rank 1's by 50..100 (one padded column masked out).
    values = torch.arange(50.0) if rank == 0 else torch.arange(50.0, 101.0)
    width = 51
    trainer = torch.zeros(1, width)
    trainer[0, : len(values)] = values
    mask = torch.zeros(1, width)
    mask[0, : len(values)] = 1
    got = probe_metrics(torch.zeros(1, width), trainer, mask, group=dist.group.WORLD)
    # Over both replicas' tokens, as one process would see them all (not a mean of means).
    assert got["sync_probe/tokens"] == 101
    assert got["sync_probe/logprob_diff_mean"] == 50.0
    assert got["sync_probe/logprob_diff_p99"] == pytest.approx(99.0)
    assert got["sync_probe/logprob_diff_max"] == 100.0


def test_figures_span_the_data_parallel_replicas():
    run_on_ranks(_two_replicas, world_size=2)


def test_prompts_are_the_first_held_out_ones_else_the_training_ones():
    train, val = [[1, 2], [3], [4, 5, 6]], [[7], [8, 9]]
    assert probe_prompts(train, val, 2) == [[7], [8, 9]]
    assert probe_prompts(train, None, 2) == [[1, 2], [3]]
    assert probe_prompts(train, [], 3) == [[1, 2], [3], [4, 5, 6]]
    with pytest.raises(
        ValueError, match=r"^rollout\.sync_probe_prompts: 3 prompts asked, the data has 2"
    ):
        probe_prompts(train, val, 3)


def test_sampling_is_the_rollouts_temperature_unfiltered_and_seeded():
    rollout = SimpleNamespace(
        temperature=0.7, top_p=0.9, top_k=20, sync_probe_tokens=5, max_prompt_length=16
    )
    sampling = probe_sampling(rollout, seed=11, eos_token_id=2)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.7, 1.0, 0)
    assert (sampling.max_new_tokens, sampling.n, sampling.seed) == (5, 1, 11)
    assert sampling.stop_token_ids == (2,) and sampling.max_prompt_len == 16
