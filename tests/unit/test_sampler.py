"""The prompt sampler: sharding over DP, determinism, epochs, mid-epoch resume."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from rl_megatron.config import Config
from rl_megatron.data.datasets import DataError
from rl_megatron.data.sampler import PromptSampler, epoch_permutation, eval_batches


def global_batches(steps: int, **kwargs) -> list[list[int]]:
    sampler = PromptSampler(**kwargs)
    return [sampler.next_global_batch() for _ in range(steps)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_dp_shards_are_disjoint_and_cover_each_global_batch(drop_last):
    n, batch, dp, steps = 103, 12, 4, 30  # 30 steps cross three epoch ends
    reference = global_batches(
        steps, num_samples=n, global_batch_size=batch, seed=7, drop_last=drop_last
    )
    # One sampler per (tp, pp, dp) rank of a 2·2·4 grid: it is given the dp rank only.
    samplers = {
        (tp, pp, rank): PromptSampler(n, batch, rank, dp, seed=7, drop_last=drop_last)
        for tp in range(2)
        for pp in range(2)
        for rank in range(dp)
    }
    for step in range(steps):
        slices = {key: s.next_batch() for key, s in samplers.items()}
        for tp in range(2):
            for pp in range(2):
                parts = [slices[(tp, pp, rank)] for rank in range(dp)]
                assert all(len(part) == batch // dp for part in parts)
                assert sum(parts, []) == reference[step]  # disjoint, covering, in order
                assert parts == [slices[(0, 0, rank)] for rank in range(dp)]  # same in replica


def test_epoch_visits_each_prompt_once_and_drops_the_remainder(caplog):
    n, batch = 50, 8  # 6 batches per epoch, 2 prompts dropped each epoch
    sampler = PromptSampler(n, batch, seed=3)
    assert (sampler.steps_per_epoch, sampler.dropped_per_epoch) == (6, 2)
    with caplog.at_level(logging.INFO, logger="rl_megatron"):
        epoch0 = sum((sampler.next_global_batch() for _ in range(6)), [])
        assert sampler.state_dict()["epoch"] == 0  # not ended until a batch is asked for
        epoch1 = sampler.next_global_batch()
    assert len(set(epoch0)) == 48 and set(epoch0) <= set(range(n))
    dropped = set(range(n)) - set(epoch0)
    assert dropped == set(epoch_permutation(n, 3, 0)[48:].tolist())
    assert "epoch 0 ended; the last 2 prompts (fewer than a batch of 8) dropped" in caplog.text
    assert epoch1 == epoch_permutation(n, 3, 1)[:8].tolist()
    assert sampler.metrics()["data/dropped_prompts"] == 2.0
    assert sampler.steps_for_epochs(3) == 18


def test_carry_keeps_every_prompt_across_epoch_ends():
    n, batch = 50, 8
    batches = global_batches(25, num_samples=n, global_batch_size=batch, seed=3, drop_last=False)
    stream = np.concatenate([epoch_permutation(n, 3, e) for e in range(4)]).tolist()
    assert sum(batches, []) == stream[: 25 * batch]  # batch 6 = 2 from epoch 0 + 6 from epoch 1
    assert PromptSampler(n, batch, drop_last=False).steps_for_epochs(4) == 25


def test_same_seed_same_order_other_seed_or_epoch_differs():
    kwargs = dict(num_samples=200, global_batch_size=20)
    assert global_batches(25, seed=11, **kwargs) == global_batches(25, seed=11, **kwargs)
    assert global_batches(10, seed=11, **kwargs) != global_batches(10, seed=12, **kwargs)
    epochs = global_batches(20, seed=11, **kwargs)
    assert epochs[:10] != epochs[10:]
    assert sorted(sum(epochs[:10], [])) == sorted(sum(epochs[10:], [])) == list(range(200))
    # Not a shift of one another: (seed, epoch) pairs are mixed, not added.
    assert not np.array_equal(epoch_permutation(200, 11, 1), epoch_permutation(200, 12, 0))


def test_no_shuffle_is_file_order():
    assert global_batches(3, num_samples=10, global_batch_size=4, shuffle=False) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop", [1, 5, 8, 13])  # mid-epoch, just before/after an epoch end
def test_resume_mid_epoch_gives_the_rest_of_the_uninterrupted_sequence(drop_last, stop):
    n, batch, dp, steps = 70, 16, 2, 20
    for rank in range(dp):
        uninterrupted = PromptSampler(n, batch, rank, dp, seed=5, drop_last=drop_last)
        expected = [uninterrupted.next_batch() for _ in range(steps)]

        first = PromptSampler(n, batch, rank, dp, seed=5, drop_last=drop_last)
        done = [first.next_batch() for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
        assert set(state) >= {"epoch", "position"}

        resumed = PromptSampler(n, batch, rank, dp, seed=5, drop_last=drop_last)
        resumed.load_state_dict(state)
        rest = [resumed.next_batch() for _ in range(steps - stop)]
        assert done + rest == expected
        assert resumed.state_dict() == uninterrupted.state_dict()


def test_bad_settings_and_states_are_clear_errors():
    with pytest.raises(DataError, match="12 prompts do not split over 5 data-parallel ranks"):
        PromptSampler(100, 12, 0, 5)
    with pytest.raises(DataError, match="the dataset has 7 prompts, fewer than one batch of 8"):
        PromptSampler(7, 8)
    assert PromptSampler(7, 8, drop_last=False).next_global_batch()  # carrying can wrap
    assert len(PromptSampler(8, 8).next_global_batch()) == 8  # exactly one batch is enough
    with pytest.raises(DataError, match="data.train_batch_size: must be > 0, got 0"):
        PromptSampler(8, 0)
    with pytest.raises(DataError, match="data.val_batch_size: must be > 0, got 0"):
        next(eval_batches(8, 0))
    for dp_rank, dp_size in ((0, 0), (2, 2), (-1, 2)):
        with pytest.raises(ValueError, match=rf"dp_rank={dp_rank} is not in \[0, dp_size="):
            PromptSampler(8, 4, dp_rank, dp_size)
        with pytest.raises(ValueError, match=rf"dp_rank={dp_rank} is not in \[0, dp_size="):
            next(eval_batches(8, 4, dp_rank, dp_size))
    with pytest.raises(DataError, match="the dataset has no prompts"):
        PromptSampler(0, 8, drop_last=False)
    sampler = PromptSampler(100, 10)
    with pytest.raises(DataError, match="refers to 90 prompts but the dataset now has 100"):
        sampler.load_state_dict({"epoch": 1, "position": 20, "num_samples": 90})
    with pytest.raises(DataError, match="out of range"):
        sampler.load_state_dict({"epoch": 0, "position": 101})


def test_from_config():
    config = Config()
    config.data.train_batch_size = 6
    config.data.shuffle = False
    sampler = PromptSampler.from_config(config, num_samples=30, dp_rank=1, dp_size=3)
    assert sampler.next_batch() == [2, 3]
    assert sampler.seed == config.trainer.seed


def test_eval_batches_cover_everything_once():
    n, batch, dp = 23, 8, 3
    per_rank = [list(eval_batches(n, batch, rank, dp)) for rank in range(dp)]
    assert all(len(batches) == 3 for batches in per_rank)
    for step in range(3):
        sizes = [len(per_rank[rank][step]) for rank in range(dp)]
        assert max(sizes) - min(sizes) <= 1
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(n))
