"""Micro-batch splitting: token budget, coverage, order, balance, padding trims, layout."""

from __future__ import annotations

import random

import pytest
import torch

from rl_megatron.trainer.micro_batches import (
    aligned_shape,
    dynamic_micro_batches,
    fixed_micro_batches,
    left_align,
    pad_responses,
    restore_order,
    row_index,
    schedule_micro_batches,
    select_rows,
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
    assert dynamic_micro_batches([3, 10, 4], max_tokens=10) == [[0, 2], [1]]  # 10 fits alone
    with pytest.raises(ValueError, match="max_tokens must be > 0, got 0"):
        dynamic_micro_batches([3], max_tokens=0)


def _three_rows():
    prompts = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [1, 2, 3, 4]])
    responses = torch.tensor([[3, 0, 0, 0], [4, 5, 0, 0], [6, 7, 8, 0]])
    mask = torch.cat([prompts != 0, responses != 0], dim=1).long()
    return {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": mask,
        "response_mask": (responses != 0).long(),
        "advantages": torch.tensor([[0.5, 0, 0, 0], [1.0, 2.0, 0, 0], [3.0, 4.0, 5.0, 0]]),
    }


@pytest.mark.parametrize("multiple_of", [1, 4])
def test_scheduled_micro_batches_are_each_rows_own_alignment(multiple_of):
    # Shapes come from a host copy of the mask (given or made); the result is what
    # left_align makes of the rows when it measures them itself.
    batch, split = _three_rows(), [[0], [1, 2]]
    for host_mask in (None, batch["attention_mask"].clone()):
        got = schedule_micro_batches(
            batch, split, torch.device("cpu"), multiple_of=multiple_of, host_mask=host_mask
        )
        for rows, micro in zip(split, got, strict=True):
            want = left_align(select_rows(batch, rows), multiple_of=multiple_of)
            assert micro.keys() == want.keys()
            assert all(torch.equal(micro[k], want[k]) for k in want), rows
    assert [m["input_ids"].shape[1] for m in got] == ([3, 7] if multiple_of == 1 else [4, 8])


def test_one_shape_fills_every_micro_batch_with_rows_that_count_nowhere():
    # The interleaved pipeline's form: the batch's full width rounded up, as many rows as
    # the largest micro-batch; the filler rows copy the first row with response_mask 0.
    batch = _three_rows()
    got = schedule_micro_batches(
        batch, [[0], [1, 2]], torch.device("cpu"), one_shape=True, multiple_of=3
    )
    assert [tuple(m["input_ids"].shape) for m in got] == [(2, 9), (2, 9)]
    assert [m["responses"].shape[1] for m in got] == [4, 4]
    first, second = got
    assert torch.equal(first["input_ids"][1], first["input_ids"][0])  # a copy of row 0
    assert first["response_mask"].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert second["response_mask"].tolist() == batch["response_mask"][1:].tolist()
    assert batch["response_mask"][0].tolist() == [1, 0, 0, 0]  # the caller's rows untouched
    assert second["input_ids"][1, :7].tolist() == [1, 2, 3, 4, 6, 7, 8]


def test_restore_order_inverts_any_split():
    rng = random.Random(0)
    lens = [rng.randint(1, 30) for _ in range(17)]
    data = torch.arange(17 * 3).reshape(17, 3)
    bins = dynamic_micro_batches(lens, 40)
    chunks = [data[torch.tensor(b)] * 1 for b in bins]
    assert torch.equal(restore_order(chunks, bins), data)
    with pytest.raises(ValueError, match="more than one"):
        restore_order([data[:2], data[:2]], [[0, 1], [1, 2]])


def test_select_rows_keeps_the_given_order_for_every_tensor():
    batch = {"a": torch.arange(12).reshape(6, 2), "b": torch.arange(6.0)}
    out = select_rows(batch, [4, 0, 4, 1])
    assert out["a"].tolist() == [[8, 9], [0, 1], [8, 9], [2, 3]]
    assert out["b"].tolist() == [4.0, 0.0, 4.0, 1.0]
    index = row_index(range(3))
    assert index.dtype == torch.int64 and index.tolist() == [0, 1, 2]


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


def test_left_align_moves_padding_to_the_end_of_rows():
    # The batch of the test above, with a per-token loss input and a per-row one.
    prompts = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])
    responses = torch.tensor([[3, 0, 0, 0], [4, 5, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0]])
    batch = {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": mask,
        "position_ids": mask.cumsum(1) - 1,
        "advantages": torch.tensor([[0.5, 0, 0, 0], [1.0, 2.0, 0, 0]]),
        "score": torch.tensor([1.0, 2.0]),
    }
    out = left_align(batch)
    # Widest row: 3 prompt + 2 response tokens.
    assert out["input_ids"].tolist() == [[5, 6, 3, 0, 0], [7, 8, 9, 4, 5]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    # Response token k is predicted at column prompt_len - 1 + k.
    assert out["gather_index"].tolist() == [[1, 2], [2, 3]]
    for row, index in enumerate(out["gather_index"].tolist()):
        for k, col in enumerate(index):
            if batch["advantages"][row, k] != 0:
                assert out["input_ids"][row, col + 1] == responses[row, k]
    assert out["responses"].tolist() == [[3, 0], [4, 5]]
    assert out["advantages"].tolist() == [[0.5, 0.0], [1.0, 2.0]]
    assert out["score"].tolist() == [1.0, 2.0] and "prompts" not in out

    # Sequence parallelism: the width rounds up; a fixed width keeps every column.
    assert left_align(batch, multiple_of=4)["input_ids"].shape == (2, 8)
    fixed = left_align(batch, width=9)
    assert fixed["input_ids"].shape == (2, 9) and fixed["responses"].shape == (2, 4)
    assert fixed["attention_mask"].sum(1).tolist() == [3, 5]
    assert fixed["input_ids"][1, :5].tolist() == [7, 8, 9, 4, 5]

    # The role's path: the shape from a host copy of the mask, then given explicitly.
    assert aligned_shape(mask, 4) == (5, 2) and aligned_shape(mask, 4, multiple_of=4) == (8, 2)
    assert aligned_shape(torch.zeros_like(mask), 4) == (1, 1)
    given = left_align(batch, width=5, response_len=2)
    assert given.keys() == out.keys()
    assert all(torch.equal(given[k], out[k]) for k in out)


def test_left_aligned_causal_attention_equals_the_padding_mask():
    """What the role relies on: no mask on left-aligned rows = the padding mask on the old layout."""
    from rl_megatron.models.sdpa_attention import causal_padding_mask

    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0]])
    prompts = torch.randint(1, 9, (2, 4)) * mask[:, :4]
    responses = torch.randint(1, 9, (2, 4)) * mask[:, 4:]
    out = left_align({"prompts": prompts, "responses": responses, "attention_mask": mask})
    table = torch.randn(10, 8)
    q_old = table[torch.cat([prompts, responses], 1)][:, None]  # [b, 1, s, d]
    q_new = table[out["input_ids"]][:, None]
    old = torch.nn.functional.scaled_dot_product_attention(
        q_old, q_old, q_old, attn_mask=~causal_padding_mask(mask)
    )
    new = torch.nn.functional.scaled_dot_product_attention(q_new, q_new, q_new, is_causal=True)
    for row in range(2):
        real_old = old[row, 0][mask[row].bool()]
        real_new = new[row, 0][out["attention_mask"][row].bool()]
        torch.testing.assert_close(real_new, real_old)
