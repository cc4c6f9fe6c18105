"""Data-parallel reductions of rl_megatron.algorithms on 2 gloo ranks.

Each rank holds half of a batch; whitening, explained variance and the global-batch loss
normalisation must give what one rank computes on the whole batch. fp64, tolerance 1e-10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.spawn import run_on_ranks


def _dp_body(rank, world_size):
    from rl_megatron.algorithms.advantages import (
        gae,
        masked_whiten,
        reinforce_plus_plus,
        reinforce_plus_plus_baseline,
    )
    from rl_megatron.algorithms.aggregation import AGG_MODES, aggregate, batch_totals
    from rl_megatron.algorithms.losses import explained_variance

    f64 = torch.float64
    group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(0)
    batch, length = 8, 6
    rewards, values, x = torch.randn(3, batch, length, generator=gen, dtype=f64).unbind()
    lengths = torch.tensor([6, 2, 5, 0, 6, 1, 3, 4])  # uneven halves: 13 vs 14 tokens
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).long()
    mask[0, 2] = 0
    scores = torch.randn(batch, generator=gen, dtype=f64)
    group_index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # prompts never straddle ranks
    rows = slice(rank * batch // world_size, (rank + 1) * batch // world_size)

    def check(local, whole):
        torch.testing.assert_close(local, whole[rows], atol=1e-10, rtol=0)

    check(masked_whiten(x[rows], mask[rows], group), masked_whiten(x, mask))
    check(
        gae(rewards[rows], values[rows], mask[rows], 0.9, 0.8, group=group)[0],
        gae(rewards, values, mask, 0.9, 0.8)[0],
    )
    check(
        reinforce_plus_plus(rewards[rows], mask[rows], 0.9, group)[0],
        reinforce_plus_plus(rewards, mask, 0.9)[0],
    )
    check(
        reinforce_plus_plus_baseline(scores[rows], group_index[rows], mask[rows], group),
        reinforce_plus_plus_baseline(scores, group_index, mask),
    )
    # Without the group the halves are whitened separately, which must differ.
    assert (masked_whiten(x[rows], mask[rows]) - masked_whiten(x, mask)[rows]).abs().max() > 1e-3
    ev_local = explained_variance(values[rows], rewards[rows], mask[rows], group)
    torch.testing.assert_close(ev_local, explained_variance(values, rewards, mask))

    totals = batch_totals(mask[rows], group)
    assert totals.num_tokens.item() == mask.sum().item() and totals.num_seqs.item() == 7
    w0 = torch.randn(length, generator=gen, dtype=f64)
    for mode in AGG_MODES:
        # DP = 1: the whole batch on one rank.
        w = w0.clone().requires_grad_(True)
        aggregate(torch.tanh(x * w) ** 2, mask, mode, norm_len=length).backward()
        grad_dp1 = w.grad
        # DP = 2: each rank its half, in 2 micro-batches; gradients summed over ranks.
        w = w0.clone().requires_grad_(True)
        for xm, mm in zip(x[rows].chunk(2), mask[rows].chunk(2)):
            aggregate(torch.tanh(xm * w) ** 2, mm, mode, totals, length).backward()
        grad_dp2 = w.grad.clone()
        dist.all_reduce(grad_dp2, group=group)
        torch.testing.assert_close(grad_dp2, grad_dp1, atol=1e-10, rtol=0, msg=mode)


def test_dp_whitening_and_global_loss_normalisation():
    run_on_ranks(_dp_body, world_size=2)


def _correction_body(rank, world_size):
    """Rollout correction's batch statistics over DP equal one rank's on the whole batch."""
    from rl_megatron.algorithms.rollout_correction import (
        is_weights,
        mismatch_metrics,
        rejection_mask,
    )

    group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(0)
    log_ratio = 0.5 * torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mu = torch.randn(8, 6, generator=gen, dtype=torch.float64) - 2
    lengths = torch.tensor([6, 2, 5, 0, 6, 1, 3, 4])
    mask = (torch.arange(6) < lengths.unsqueeze(-1)).long()
    rows = slice(rank * 4, rank * 4 + 4)
    for level in ("token", "sequence"):
        for threshold in (1.3, (0.6, 1.6)):
            local, m_local = is_weights(
                log_ratio[rows], mask[rows], level, threshold, True, group=group
            )
            whole, m_whole = is_weights(log_ratio, mask, level, threshold, True)
            torch.testing.assert_close(local, whole[rows], atol=1e-6, rtol=0)
            for key in m_whole:
                torch.testing.assert_close(m_local[key], m_whole[key], msg=key)
        kept, m_local = rejection_mask(log_ratio[rows], mask[rows], level, 0.7, 1.4, group=group)
        kept_whole, m_whole = rejection_mask(log_ratio, mask, level, 0.7, 1.4)
        assert torch.equal(kept, kept_whole[rows])
        for key in m_whole:
            torch.testing.assert_close(m_local[key], m_whole[key], msg=key)
    local = mismatch_metrics(mu[rows], mu[rows] + log_ratio[rows], mask[rows], group=group)
    whole = mismatch_metrics(mu, mu + log_ratio, mask)
    for key in whole:  # the max is the max over both halves, not a mean of the two
        torch.testing.assert_close(local[key], whole[key], msg=key)


def test_dp_rollout_correction_statistics():
    run_on_ranks(_correction_body, world_size=2)
