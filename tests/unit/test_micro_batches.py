"""Micro-batch splitting: token budget, coverage, order, balance, padding trims."""

from __future__ import annotations

import random

import pytest
import torch

from rl_megatron.trainer.micro_batches import (
    dynamic_micro_batches,
    fixed_micro_batches,
    pad_responses,
    restore_order,
    trim_padding,
)


def _check_partition(bins: list[list[int]], n: int) -> None:
    rows = [i for b in bins for i in b]
    assert sorted(rows) == list(range(n)), "every row exactly once"
    assert all(b == sorted(b) for b in bins), "rows keep their order inside a micro-batch"


def test_fixed_micro_batches():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_micro_batches(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        fixed_micro_batches(4, 0)


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_respects_budget_and_covers_every_row(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 64)
    lens = [rng.randint(1, 100) for _ in range(n)]
    budget = rng.randint(100, 400)
    bins = dynamic_micro_batches(lens, budget)
    _check_partition(bins, n)
    assert all(sum(lens[i] for i in b) <= budget for b in bins)
    # Few micro-batches: LPT never needs more than twice the lower bound here.
    lower = -(-sum(lens) // budget)
    assert len(bins) <= max(2 * lower, 1)


def test_dynamic_balances_tokens():
    # 8 rows, two long and six short: fixed pairs would put both long rows together
    # only by chance; the balanced split spreads them.
    lens = [90, 90, 10, 10, 10, 10, 10, 10]
    bins = dynamic_micro_batches(lens, max_tokens=120)
    loads = sorted(sum(lens[i] for i in b) for b in bins)
    assert len(bins) == 2 and loads == [120, 120]


def test_dynamic_count_constraints():
    lens = [5] * 10
    bins = dynamic_micro_batches(lens, 100, min_micro_batches=3, multiple_of=2)
    assert len(bins) == 4
    _check_partition(bins, 10)
    assert dynamic_micro_batches([], 10) == []


def test_dynamic_rejects_a_row_over_budget():
    with pytest.raises(ValueError, match=r"1 sequence\(s\) are longer.*row 1"):
        dynamic_micro_batches([3, 50, 4], max_tokens=10)


def test_restore_order_inverts_any_split():
    rng = random.Random(0)
    lens = [rng.randint(1, 30) for _ in range(17)]
    data = torch.arange(17 * 3).reshape(17, 3)
    bins = dynamic_micro_batches(lens, 40)
    chunks = [data[torch.tensor(b)] * 1 for b in bins]
    assert torch.equal(restore_order(chunks, bins), data)
    with pytest.raises(ValueError, match="more than one"):
        restore_order([data[:2], data[:2]], [[0, 1], [1, 2]])


def test_trim_padding_and_pad_responses():
    # Row 0: prompt 2 tokens, response 1; row 1: prompt 3, response 2 (P = 4, R = 4).
    prompts = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])
    responses = torch.tensor([[3, 0, 0, 0], [4, 5, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0]])
    start, r = trim_padding(prompts, responses, mask)
    assert (start, r) == (1, 2)
    assert trim_padding(prompts[:1], responses[:1], mask[:1]) == (2, 1)
    x = torch.ones(2, r)
    padded = pad_responses(x, 4)
    assert padded.shape == (2, 4) and padded[:, r:].abs().sum() == 0
