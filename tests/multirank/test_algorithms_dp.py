"""Data-parallel reductions of rl_megatron.algorithms on 2 gloo ranks.

Each rank holds half of a batch; whitening, explained variance and the global-batch loss
normalisation must give what one rank computes on the whole batch. fp64, tolerance 1e-10.
Dynamic sampling over the two replicas (`trainer/dynamic_sampling.collect_groups`, scripted
rounds) when they fill their shares in different rounds, with and without the cap reached,
equals a simulation of both replicas at once in one process (`_simulate_dynamic_sampling`).
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

    _check_dynamic_sampling(rank, world_size, group)


def test_dp_whitening_and_global_loss_normalisation():
    run_on_ranks(_dp_body, world_size=2)


# Scores of each replica's rounds, N = 2 per group, 2 groups per round; a group is
# informative when its two scores differ. (rounds per replica, groups per replica, cap)
_I, _U = [1.0, 0.0], [0.5, 0.5]  # an informative group, an uninformative one
DYNAMIC_SAMPLING_CASES = [
    # Replica 0 is full after round 0 (and finds more it must not keep), replica 1 after
    # round 2: every replica runs three rounds.
    (
        [[*_I, *_I], [*_I, *_U], [*_U, *_I], [*_I, *_I]],
        [[*_U, *_U], [*_U, *_I], [*_I, *_U], [*_I, *_I]],
        3,
    ),
    # The cap (1 extra round) binds for replica 1 only: it fills its share with its first
    # uninformative group; replica 0, full, fills nothing.
    ([[*_I, *_I], [*_I, *_I], [*_I, *_I]], [[*_U, *_I], [*_U, *_U], [*_I, *_I]], 1),
]


def _simulate_dynamic_sampling(replicas, groups: int, max_extra_rounds: int):
    """Every replica's rounds at once: the kept groups' tags (100·round + group) per
    replica, and the step's global metrics."""
    kept = [[] for _ in replicas]
    spare = [[] for _ in replicas]
    generated = informative = rounds = 0
    while True:
        for i, scripted_rounds in enumerate(replicas):
            scores = scripted_rounds[rounds]
            for g in range(len(scores) // 2):
                useful = scores[2 * g] != scores[2 * g + 1]
                generated += 1
                informative += useful
                if useful and len(kept[i]) < groups:
                    kept[i].append(100 * rounds + g)
                elif not useful:
                    spare[i].append(100 * rounds + g)
        rounds += 1
        if all(len(k) == groups for k in kept) or rounds == 1 + max_extra_rounds:
            break
    filled = 0
    for k, s in zip(kept, spare):
        missing = groups - len(k)
        k.extend(s[:missing])
        filled += missing
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/groups_generated": float(generated),
        "dynamic_sampling/groups_informative": float(informative),
        "dynamic_sampling/groups_filled": float(filled),
        "dynamic_sampling/cap_reached": float(filled > 0),
    }
    return kept, metrics


def _check_dynamic_sampling(rank, world_size, group) -> None:
    import logging

    from rl_megatron.trainer.dynamic_sampling import collect_groups
    from tests.unit.test_dapo import N, scripted

    assert N == 2 and world_size == 2
    for case, (replica0, replica1, max_extra) in enumerate(DYNAMIC_SAMPLING_CASES):
        replicas = [replica0, replica1]
        kept, metrics = _simulate_dynamic_sampling(replicas, 2, max_extra)
        next_round, calls = scripted(replicas[rank])
        out = collect_groups(next_round, 2, N, True, max_extra, group, logging.getLogger("t"))
        where = f"case {case} rank {rank}"
        rounds = int(metrics["dynamic_sampling/rounds"])
        assert calls == list(range(rounds)), f"{where}: rounds {calls}"
        tags = out.per_row["tag"].tolist()
        assert tags == [float(t) for t in kept[rank] for _ in range(N)], f"{where}: {tags}"
        assert out.rollout.group_index.tolist() == [0, 0, 1, 1], where
        assert out.metrics == metrics, f"{where}: {out.metrics} != {metrics}"
    # The cases are what they say: replica 0 full after round 0, replica 1 after round 2;
    # then replica 1 short at the cap, filled with its round-0 group 0.
    simulated = [_simulate_dynamic_sampling(c[:2], 2, c[2]) for c in DYNAMIC_SAMPLING_CASES]
    assert [k for k, _ in simulated] == [[[0, 1], [101, 200]], [[0, 1], [1, 0]]], simulated
    assert [m["dynamic_sampling/groups_filled"] for _, m in simulated] == [0.0, 1.0]
