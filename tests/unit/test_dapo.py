"""DAPO's pieces (arXiv 2503.14476): overlong shaping, the group filter, and the step's
groups under dynamic sampling (`trainer/dynamic_sampling.py`, with scripted rounds)."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch

from rl_megatron.algorithms.dapo import informative_groups, overlong_penalty
from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.trainer.dynamic_sampling import Round, collect_groups


def naive_overlong(length: int, max_length: int, buffer: int) -> float:
    """DAPO eq. 13, written as the paper's three cases."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer
    return -1.0


def test_overlong_penalty_is_dapo_eq_13():
    lengths = torch.arange(0, 24)
    got = overlong_penalty(lengths, 20, 8, 1.0)
    want = [naive_overlong(int(n), 20, 8) for n in lengths]
    assert got.tolist() == pytest.approx(want)
    # Hand values: free up to 12 tokens, -0.5 at 16, -1 at the limit.
    assert overlong_penalty(torch.tensor([12, 13, 16, 20]), 20, 8, 0.5).tolist() == [
        0.0,
        -0.0625,
        -0.25,
        -0.5,
    ]
    # The buffer may be the whole length: the penalty is linear from 0 tokens.
    assert overlong_penalty(torch.tensor([0, 4, 8]), 8, 8, 1.0).tolist() == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="buffer_length must be in"):
        overlong_penalty(lengths, 20, 21, 1.0)
    with pytest.raises(ValueError, match="buffer_length must be in"):
        overlong_penalty(lengths, 20, 0, 1.0)


def test_informative_groups():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2, 0.2, 0.2])
    assert informative_groups(scores, 3).tolist() == [False, True, False]
    assert informative_groups(scores, 1).tolist() == [False] * 9  # a group of one never is
    with pytest.raises(ValueError, match="num_groups"):
        informative_groups(scores, 2)


# ---------------------------------------------------------------- dynamic sampling


N = 2  # samples per prompt


def scripted(rounds: list[list[float]]):
    """`next_round` returning the given scores (n per group); each response names its
    round and group in its tokens so the kept rows can be traced."""
    calls = []

    def next_round(r: int) -> Round:
        calls.append(r)
        scores = rounds[r]
        groups = len(scores) // N
        prompts = [[10 + r] for _ in range(groups) for _ in range(N)]
        responses = [[100 * r + g, j] for g in range(groups) for j in range(N)]
        batch = RolloutBatch.from_sequences(
            prompts,
            responses,
            [[-0.5, -0.25]] * len(responses),
            ["stop"] * len(responses),
            group_index=[g for g in range(groups) for _ in range(N)],
        )
        tag = torch.tensor([100.0 * r + g for g in range(groups) for _ in range(N)])
        return Round(batch, torch.tensor(scores, dtype=torch.float64), {"tag": tag}, 1.0)

    return next_round, calls


def _collect(rounds, groups, filter_groups=True, max_extra_rounds=3):
    next_round, calls = scripted(rounds)
    out = collect_groups(
        next_round, groups, N, filter_groups, max_extra_rounds, None, logging.getLogger("t")
    )
    return out, calls


def test_without_filtering_the_first_round_is_the_step():
    out, calls = _collect([[1.0, 1.0, 0.0, 1.0]], 2, filter_groups=False)
    assert calls == [0] and out.metrics == {}
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert out.reward_errors == 1.0


def test_half_uninformative_groups_are_replaced_by_the_next_rounds():
    rounds = [
        [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.2],  # groups 0, 2 uninformative
        [0.3, 0.3, 1.0, 0.0, 0.0, 0.0, 0.7, 0.7],  # only group 1 informative
        [0.1, 0.2, 0.4, 0.9, 0.0, 1.0, 1.0, 0.0],  # all informative: 1 more needed
        [9.0, 8.0, 9.0, 8.0, 9.0, 8.0, 9.0, 8.0],  # never reached
    ]
    out, calls = _collect(rounds, groups=4)
    assert calls == [0, 1, 2]
    # Informative groups in the order found: (round 0: 1, 3), (round 1: 1), (round 2: 0).
    assert out.per_row["tag"].tolist() == [1, 1, 3, 3, 101, 101, 200, 200]
    assert out.scores.tolist() == [0.0, 1.0, 0.0, 0.2, 1.0, 0.0, 0.1, 0.2]
    assert out.rollout.group_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(out.rollout) == 8 and out.rollout.rollout_log_probs is not None
    # The rows' tokens travelled with their scores.
    assert out.rollout.responses[:, 0].tolist() == [1, 1, 3, 3, 101, 101, 200, 200]
    assert out.metrics == {
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/groups_generated": 12.0,
        "dynamic_sampling/groups_informative": 7.0,
        "dynamic_sampling/groups_filled": 0.0,
        "dynamic_sampling/cap_reached": 0.0,
    }
    assert out.reward_errors == 3.0  # every round's


def test_a_cap_reached_is_reported_and_filled_not_looped_on(caplog):
    same = [0.5, 0.5, 0.5, 0.5]
    rounds = [[1.0, 0.0, 0.2, 0.2], same, same, same, same]
    with caplog.at_level(logging.WARNING):
        out, calls = _collect(rounds, groups=2, max_extra_rounds=2)
    assert calls == [0, 1, 2]  # 1 + max_extra_rounds rounds, no more
    # The informative group first, then the first uninformative group seen.
    assert out.per_row["tag"].tolist() == [0, 0, 1, 1]
    assert out.metrics["dynamic_sampling/cap_reached"] == 1.0
    assert out.metrics["dynamic_sampling/groups_filled"] == 1.0
    assert out.metrics["dynamic_sampling/groups_informative"] == 1.0
    assert out.metrics["dynamic_sampling/rounds"] == 3.0
    assert "max_extra_rounds=2" in caplog.text
    # No extra round allowed: the first round is filled at once.
    out, calls = _collect([same, [1.0, 0.0, 1.0, 0.0]], groups=2, max_extra_rounds=0)
    assert calls == [0] and out.metrics["dynamic_sampling/groups_filled"] == 2.0


def test_the_fill_takes_only_the_missing_groups_from_the_first_spares():
    rounds = [
        [1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.7, 0.7],  # 1 informative, 3 uninformative
        [1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.4, 0.4],  # 2 informative: 1 group short
    ]
    out, calls = _collect(rounds, groups=4, max_extra_rounds=1)
    assert calls == [0, 1]
    # Round 0's group 0, round 1's groups 0 and 1, then round 0's first spare: 4 groups.
    assert out.per_row["tag"].tolist() == [0, 0, 100, 100, 101, 101, 1, 1]
    assert out.metrics["dynamic_sampling/groups_filled"] == 1.0
    scores = out.scores.tolist()
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5]
    metrics = out.reward_metrics()
    assert metrics["reward/mean"] == pytest.approx(statistics.fmean(scores))
    assert metrics["reward/std"] == pytest.approx(statistics.pstdev(scores))  # the rows'
    assert metrics["reward/errors"] == 2.0  # both rounds'
    assert "reward/overlong_penalty_mean" not in metrics
