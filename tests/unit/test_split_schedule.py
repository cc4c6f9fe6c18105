"""split_async's schedule and pairing (`trainer/split_rollouts.py`), as pure functions: which
weights generate which batch, the one order both sides transfer in, and who sends whom."""

from __future__ import annotations

import itertools

import pytest

from rl_megatron.parallel import ParallelLayout
from rl_megatron.trainer.split_rollouts import Pairing, SplitSchedule

CASES = [
    (s, start, total)
    for s, start in itertools.product(range(4), range(3))
    for total in range(start + 1, start + 8)
]


@pytest.mark.parametrize("s, start, total", CASES)
def test_every_batch_once_in_order_within_the_bound(s, start, total):
    schedule = SplitSchedule(s, start, total)
    ops = schedule.ops()
    assert ops[0] == ("weights", start)  # the generation side's first weights: the run's
    assert [i for kind, i in ops if kind == "batch"] == list(range(start, total))
    held = None
    for kind, index in ops:
        if kind == "weights":
            assert held is None or index == held + 1  # one version at a time, none skipped
            held = index
        else:
            # The weights the generation side holds are the schedule's for this batch ...
            assert held == schedule.version_for(index)
            staleness = index - held
            assert 0 <= staleness <= s
            # ... and the bound is used in full once the run is s steps in.
            assert staleness == min(s, index - start)


@pytest.mark.parametrize("s, start, total", CASES)
def test_the_training_side_sends_the_version_it_holds(s, start, total):
    """Replaying the training side: before step k it runs the ops up to `needed_by_step(k)`;
    every weights op among them must be version k (the weights it holds after k steps;
    the run's first op, version `start`, goes before step `start`)."""
    schedule = SplitSchedule(s, start, total)
    ops = schedule.ops()
    done = 0
    for step in range(start, total):
        needed = schedule.needed_by_step(step)
        assert needed >= done
        new = ops[done:needed]
        assert ("batch", step) in ops[:needed]
        sent = [i for i, (kind, _) in enumerate(new) if kind == "weights"]
        assert [new[i][1] for i in sent] in ([], [step])
        if s >= 1 and sent and step > start:  # the first batch has nothing to overlap
            # What the weights sent now generate is generated while step trains: the
            # training side waits for no batch after sending them.
            assert all(kind == "weights" for kind, _ in new[sent[0] :])
        done = needed
    assert done == len(ops)  # the last step leaves nothing for the generation side to do


def test_staleness_zero_is_the_synchronous_loop():
    ops = SplitSchedule(0, 0, 3).ops()
    assert ops == [
        ("weights", 0),
        ("batch", 0),
        ("weights", 1),
        ("batch", 1),
        ("weights", 2),
        ("batch", 2),
    ]


def test_one_step_off():
    schedule = SplitSchedule(1, 0, 4)
    assert schedule.ops() == [
        ("weights", 0),
        ("batch", 0),
        ("batch", 1),
        ("weights", 1),
        ("batch", 2),
        ("weights", 2),
        ("batch", 3),
    ]
    # Step 1 trains on batch 1 (version 0) and sends version 1 after receiving it.
    assert schedule.needed_by_step(1) == 4


def test_a_run_resumed_at_its_end_transfers_nothing():
    # The generation side then ends after the start message; neither side waits.
    assert SplitSchedule(1, 6, 6).ops() == []


def test_a_resumed_run_starts_from_its_own_weights():
    schedule = SplitSchedule(2, 5, 9)
    assert schedule.ops()[:4] == [("weights", 5), ("batch", 5), ("batch", 6), ("batch", 7)]
    assert [schedule.version_for(b) for b in range(5, 9)] == [5, 5, 5, 6]


def _pairing(tp: int, pp: int, dp: int, t_g: int, replicas: int) -> Pairing:
    return Pairing(ParallelLayout(tp=tp, pp=pp, dp=dp), t_g, replicas)


def test_one_generation_replica_per_training_replica():
    p = _pairing(1, 1, 2, 1, 2)
    assert (p.served_by(0), p.served_by(1)) == ([0], [1])
    assert (p.generator_of(0), p.generator_of(1)) == (0, 1)
    assert (p.weight_source(0, 0), p.weight_source(1, 0)) == (0, 1)
    assert (p.weight_destinations(0), p.weight_destinations(1)) == ([(0, 0)], [(1, 0)])


def test_micro_replicas_of_one_training_replica_feed_two_generation_replicas():
    # TP 2 training, t_g 1: each training rank holds a whole generation replica (micro-DP).
    p = _pairing(2, 1, 1, 1, 2)
    assert (p.served_by(0), p.served_by(1)) == ([0], [])
    assert (p.weight_source(0, 0), p.weight_source(1, 0)) == (0, 1)


def test_a_tp_generation_replica_takes_each_shard_from_its_holder():
    # Training TP 2 x PP 2 (4 ranks a replica), DP 2; generation TP 2, one replica.
    p = _pairing(2, 2, 2, 2, 1)
    assert p.served_by(0) == [0, 1]
    assert [p.weight_source(0, r) for r in range(2)] == [0, 1]
    # Two micro-replicas per training replica; a second and third generation replica
    # would take training replica 1's first and replica 0's second micro-replica.
    q = _pairing(2, 2, 2, 2, 3)
    assert [q.weight_source(j, 1) for j in range(3)] == [1, 5, 3]
    assert q.weight_destinations(3) == [(2, 1)]


def test_more_training_replicas_than_generation_replicas():
    p = _pairing(1, 1, 4, 1, 2)
    assert (p.served_by(0), p.served_by(1)) == ([0, 2], [1, 3])
    assert [p.generator_of(i) for i in range(4)] == [0, 1, 0, 1]
    assert p.weight_destinations(2) == p.weight_destinations(3) == []


def test_each_training_rank_sends_its_shard_to_the_generation_rank_that_takes_it():
    """Launch ranks of the weights' destinations: 4 training ranks (TP 2 x DP 2), 4
    generation ranks (two replicas at TP 2). Generation replica j, TP rank r sits at launch
    rank 4 + 2j + r and takes its shard from training replica j's TP rank r."""
    from rl_megatron.placement import SplitWorld
    from rl_megatron.trainer.split_rollouts import TrainingSide

    pairing = _pairing(2, 1, 2, 2, 2)
    want = {0: [4], 1: [5], 2: [6], 3: [7]}
    for rank, destinations in want.items():
        side = object.__new__(TrainingSide)  # only what `_destinations` reads
        side.pairing, side.rank = pairing, rank
        side.world = SplitWorld(rank=rank, world_size=8, rollout_ranks=4, bridge=None)
        assert side._destinations() == destinations, rank
