"""RolloutBatch layout against naive per-row reference code (exact: integer tensors)."""

from __future__ import annotations

import pytest
import torch

from rl_megatron.rollout.batch import FinishReason, RolloutBatch

PAD = 0


def make_rows(seed: int = 0, rows: int = 7, n: int = 1):
    """Random rows: prompts 1-9 tokens, responses 0-6 tokens (0 = rejected prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, log_probs, reasons, groups = [], [], [], [], []
    for i in range(rows):
        p = int(torch.randint(1, 10, (1,), generator=g))
        r = int(torch.randint(0, 7, (1,), generator=g))
        prompt = torch.randint(1, 100, (p,), generator=g).tolist()
        for _ in range(n):
            prompts.append(prompt)
            responses.append(torch.randint(1, 100, (r,), generator=g).tolist())
            log_probs.append((-torch.rand(r, generator=g)).tolist())
            reasons.append("rejected" if r == 0 else ("stop" if r % 2 else "length"))
            groups.append(i)
    return prompts, responses, log_probs, reasons, groups


def build(seed: int = 0, rows: int = 7, n: int = 1) -> tuple[RolloutBatch, tuple]:
    data = make_rows(seed, rows, n)
    prompts, responses, log_probs, reasons, groups = data
    batch = RolloutBatch.from_sequences(
        prompts, responses, log_probs, reasons, group_index=groups, pad_token_id=PAD
    )
    return batch, data


def test_layout_matches_naive_rows():
    batch, (prompts, responses, log_probs, reasons, groups) = build()
    batch.validate()
    b, p, r = len(prompts), max(map(len, prompts)), max(map(len, responses))
    assert batch.prompts.shape == (b, p) and batch.responses.shape == (b, r)
    for i in range(b):
        pl, rl = len(prompts[i]), len(responses[i])
        # Left-padded prompt, right-padded response.
        assert batch.prompts[i].tolist() == [PAD] * (p - pl) + prompts[i]
        assert batch.responses[i].tolist() == responses[i] + [PAD] * (r - rl)
        assert batch.attention_mask[i].tolist() == [0] * (p - pl) + [1] * (pl + rl) + [0] * (r - rl)
        assert batch.response_mask[i].tolist() == [1] * rl + [0] * (r - rl)
        # Positions count real tokens from 0; padding on the right keeps counting.
        assert batch.position_ids[i].tolist() == [0] * (p - pl) + list(range(pl + r))
        assert batch.rollout_log_probs[i, :rl].tolist() == pytest.approx(log_probs[i])
        assert batch.rollout_log_probs[i, rl:].abs().sum() == 0
        assert batch.row_tokens(i) == (prompts[i], responses[i])
    assert batch.finish_reasons == reasons
    assert batch.group_index.tolist() == groups
    assert batch.prompt_lengths.tolist() == [len(x) for x in prompts]
    assert batch.response_lengths.tolist() == [len(x) for x in responses]


def test_input_ids_put_every_response_start_in_the_same_column():
    batch, (prompts, responses, *_) = build()
    p = batch.prompt_width
    ids = batch.input_ids
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        assert ids[i, p - 1].item() == prompt[-1]  # its logits predict response token 0
        assert ids[i, p : p + len(response)].tolist() == response


def test_indexing_chunk_and_cat_roundtrip():
    batch, data = build(rows=9)
    assert len(batch[2]) == 1 and batch[2].responses.dim() == 2
    assert batch[-1].group_index.tolist() == [8]
    assert batch[[4, 1]].group_index.tolist() == [4, 1]
    mask = batch.response_lengths > 2
    assert batch[mask].group_index.tolist() == torch.nonzero(mask)[:, 0].tolist()
    chunks = batch.chunk(4)
    assert [len(c) for c in chunks] == [4, 4, 1]
    back = RolloutBatch.cat(chunks)
    for name in ("prompts", "responses", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    with pytest.raises(ValueError, match="micro_batch_size"):
        batch.chunk(0)
    singles = batch.chunk(1)
    assert [c.group_index.tolist() for c in singles] == [[i] for i in range(9)]


def test_compact_and_cat_equal_a_fresh_build_of_the_same_rows():
    batch, (prompts, responses, log_probs, reasons, groups) = build(rows=10)
    for chunk, start in zip(batch.chunk(3), range(0, 10, 3)):
        rows = slice(start, start + 3)
        fresh = RolloutBatch.from_sequences(
            prompts[rows], responses[rows], log_probs[rows], reasons[rows], group_index=groups[rows]
        )
        small = chunk.compact()
        small.validate()
        for name in ("prompts", "responses", "attention_mask", "position_ids", "response_mask"):
            assert torch.equal(getattr(small, name), getattr(fresh, name)), name
    # cat re-pads batches of different widths exactly like one build of all rows.
    parts = [batch[0:3].compact(), batch[3:10].compact()]
    joined = RolloutBatch.cat(parts)
    joined.validate()
    for name in ("prompts", "responses", "attention_mask", "position_ids", "rollout_log_probs"):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name


def test_to_keeps_integer_dtypes():
    batch, _ = build()
    moved = batch.to("cpu", non_blocking=True)
    assert moved.prompts.dtype == torch.int64 and moved.rollout_log_probs.dtype == torch.float32
    assert moved.prompt_truncated.dtype == torch.bool


def test_metrics_count_prompts_not_rows():
    # 3 prompts x n=2: prompt 1 rejected (both rows), prompt 2 truncated (both rows).
    prompts = [[1, 2]] * 2 + [[3]] * 2 + [[4, 5, 6]] * 2
    responses = [[7, 2], [7]] + [[], []] + [[8, 8, 8], [9]]
    batch = RolloutBatch.from_sequences(
        prompts,
        responses,
        [[-0.5] * len(r) for r in responses],
        ["stop", "length", "rejected", "rejected", "length", "stop"],
        group_index=[0, 0, 1, 1, 2, 2],
        prompt_truncated=[False, False, False, False, True, True],
        weight_version=5,
    )
    m = batch.metrics()
    assert m["rollout/prompts_rejected"] == 1
    assert m["rollout/prompts_truncated"] == 1
    assert m["rollout/num_samples"] == 6
    assert m["rollout/finish_stop_frac"] == pytest.approx(2 / 6)
    assert m["rollout/finish_length_frac"] == pytest.approx(2 / 6)
    # Rejected rows have no response and are left out of the length statistics.
    assert m["rollout/response_length_mean"] == pytest.approx((2 + 1 + 3 + 1) / 4)
    assert m["rollout/response_length_max"] == 3
    assert m["rollout/prompt_length_mean"] == pytest.approx((2 + 2 + 1 + 1 + 3 + 3) / 6)
    assert batch.weight_version == 5 and batch[1:3].weight_version == 5
    # Rows sampled by one version keep it when joined; by two, the join has none.
    assert RolloutBatch.cat([batch[0:2], batch[2:6]]).weight_version == 5
    other = RolloutBatch.from_sequences([[1]], [[2]], [[-0.5]], ["stop"], weight_version=6)
    assert RolloutBatch.cat([batch, other]).weight_version is None


def test_errors_name_the_row():
    with pytest.raises(ValueError, match="row 1 has 2 response tokens but 1 log-probs"):
        RolloutBatch.from_sequences([[1], [2]], [[3], [4, 5]], [[0.0], [0.0]], ["stop"] * 2)
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        RolloutBatch.from_sequences([[]], [[3]], [[0.0]], ["stop"])
    with pytest.raises(ValueError, match="finish_reasons has 1 rows"):
        RolloutBatch.from_sequences([[1], [2]], [[3], [4]], [[0.0], [0.0]], ["stop"])
    with pytest.raises(ValueError, match="unknown finish reason 'eos'"):
        FinishReason.parse("eos")
    batch, _ = build()
    batch.response_mask = batch.response_mask[:, :1]
    with pytest.raises(ValueError, match="RolloutBatch.response_mask has shape"):
        batch.validate()


def test_n_samples_keep_groups_contiguous():
    batch, _ = build(rows=4, n=3)
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # Micro-batches that are a multiple of n never split a group.
    for chunk in batch.chunk(6):
        groups = chunk.group_index.tolist()
        assert all(groups.count(g) == 3 for g in set(groups))


def build_without_log_probs(seed: int = 0, rows: int = 7) -> RolloutBatch:
    prompts, responses, _, reasons, groups = make_rows(seed, rows)
    return RolloutBatch.from_sequences(
        prompts, responses, None, reasons, group_index=groups, pad_token_id=PAD
    )


LAYOUT_FIELDS = ("prompts", "responses", "attention_mask", "response_mask", "position_ids")
ROW_FIELDS = LAYOUT_FIELDS + ("prompt_lengths", "response_lengths", "finish_reason", "group_index")


def test_batch_without_engine_log_probs_has_the_same_layout():
    """`rollout.calculate_log_probs: false`: no log-probs, every other field as with them."""
    with_lp, _ = build(rows=9)
    without = build_without_log_probs(rows=9)
    without.validate()
    assert without.rollout_log_probs is None
    for name in ROW_FIELDS:
        assert torch.equal(getattr(without, name), getattr(with_lp, name)), name
    assert without.metrics() == with_lp.metrics()
    padded = RolloutBatch.from_padded(
        with_lp.prompts,
        with_lp.responses,
        None,
        with_lp.prompt_lengths,
        with_lp.response_lengths,
        with_lp.finish_reason,
        group_index=with_lp.group_index,
    )
    assert padded.rollout_log_probs is None
    assert torch.equal(padded.attention_mask, with_lp.attention_mask)
    # The row checks that do not involve log-probs still hold.
    with pytest.raises(ValueError, match="finish_reasons has 1 rows"):
        RolloutBatch.from_sequences([[1], [2]], [[3], [4]], None, ["stop"])
    without.position_ids = without.position_ids[:, :1]
    with pytest.raises(ValueError, match="RolloutBatch.position_ids has shape"):
        without.validate()


def test_select_chunk_compact_cat_and_to_without_log_probs():
    with_lp, _ = build(rows=10)
    without = build_without_log_probs(rows=10)
    mask = without.response_lengths > 2
    for index in (slice(2, 7), 3, -1, [4, 1, 8], mask):
        part, ref = without[index], with_lp[index]
        assert part.rollout_log_probs is None
        for name in ROW_FIELDS:
            assert torch.equal(getattr(part, name), getattr(ref, name)), (index, name)
    chunks = [c.compact() for c in without.chunk(3)]
    assert [len(c) for c in chunks] == [3, 3, 3, 1]
    assert all(c.rollout_log_probs is None for c in chunks)
    joined = RolloutBatch.cat(chunks)
    joined.validate()
    assert joined.rollout_log_probs is None
    for name in ROW_FIELDS:
        assert torch.equal(getattr(joined, name), getattr(without, name)), name
    moved = without.to("cpu", non_blocking=True)
    assert moved.rollout_log_probs is None and moved.prompts.dtype == torch.int64
    assert torch.equal(moved.position_ids, without.position_ids)


def test_cat_refuses_to_mix_batches_with_and_without_log_probs():
    with_lp, _ = build(rows=4)
    without = build_without_log_probs(rows=4)
    with pytest.raises(ValueError, match="batch 1 has no rollout_log_probs but batch 0 has"):
        RolloutBatch.cat([with_lp, without])
    with pytest.raises(ValueError, match="batch 0 has no rollout_log_probs but batch 1 has"):
        RolloutBatch.cat([without[:2], with_lp])


def test_routed_experts_follow_the_tokens():
    """Per-row routing `[n_i, L, k]` lands on the row's first n_i tokens of `input_ids`
    (-1 elsewhere) and moves with them through indexing, compact and cat."""
    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    routing = [torch.arange(4 * 2 * 2).view(4, 2, 2), torch.arange(3 * 2 * 2).view(3, 2, 2) + 50]
    batch = RolloutBatch.from_sequences(
        prompts, responses, None, ["stop", "length"], routed_experts=routing
    )
    batch.validate()
    assert batch.routed_experts.shape == (2, 6, 2, 2) and batch.routed_experts.dtype == torch.int16
    for i in range(2):
        real = batch.attention_mask[i].bool().nonzero()[:, 0]
        n = len(routing[i])
        assert torch.equal(batch.routed_experts[i, real[:n]].long(), routing[i])
        unknown = torch.ones(6, dtype=torch.bool)
        unknown[real[:n]] = False
        assert bool((batch.routed_experts[i, unknown] == -1).all())
    one = batch[1].compact()  # prompt width 1, response width 3
    assert torch.equal(one.routed_experts[0, :3].long(), routing[1])
    joined = RolloutBatch.cat([batch[0].compact(), one])
    assert torch.equal(joined.routed_experts, batch.routed_experts)
    with pytest.raises(ValueError, match="batch 1 has no routed_experts but batch 0 has"):
        RolloutBatch.cat([batch[:1], build_without_log_probs(rows=1)])
