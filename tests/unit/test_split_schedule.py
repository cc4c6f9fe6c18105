"""split_async's schedule and pairing (`trainer/split_rollouts.py`), as pure functions: which
weights generate which batch, the one order both sides transfer in, and who sends whom."""

from __future__ import annotations

import itertools

import pytest

from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.parallel import ParallelLayout
from rl_megatron.resharding.layouts import TrainingLayout
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
    assert (p.weight_block(0), p.weight_block(1)) == (([0], [0]), ([1], [1]))


def test_a_tp_generation_replica_takes_its_weights_from_one_training_block():
    # Training TP 2 x PP 2 (4 ranks a replica), DP 2; generation TP 2, two replicas.
    p = _pairing(2, 2, 2, 2, 2)
    assert p.served_by(0) == [0] and p.served_by(1) == [1]
    assert p.weight_block(0) == ([0, 1, 2, 3], [0, 1])
    assert p.weight_block(1) == ([4, 5, 6, 7], [2, 3])


def test_more_training_replicas_than_generation_replicas():
    p = _pairing(1, 1, 4, 1, 2)
    assert (p.served_by(0), p.served_by(1)) == ([0, 2], [1, 3])
    assert [p.generator_of(i) for i in range(4)] == [0, 1, 0, 1]
    assert p.weight_block(1) == ([1], [1])  # replicas 2 and 3 feed none


def test_weight_peers_are_launch_ranks_of_both_sides():
    """4 training ranks (TP 2 x DP 2) at launch ranks 0-3, 4 generation ranks (two replicas
    at TP 2) at 4-7: generation replica j's plan is training ranks 2j, 2j + 1, then launch
    ranks 4 + 2j, 5 + 2j (a swapped side or replica index fails here)."""
    from rl_megatron.placement import SplitWorld

    pairing = _pairing(2, 1, 2, 2, 2)
    world = SplitWorld(rank=0, world_size=8, rollout_ranks=4, bridge=None)
    assert pairing.weight_peers(0, world) == [0, 1, 4, 5]
    assert pairing.weight_peers(1, world) == [2, 3, 6, 7]


@pytest.mark.parametrize(
    "tp, pp, t_g, model",
    [(2, 1, 1, "qwen3_padded_vocab"), (1, 2, 1, "llama_gqa"), (2, 2, 2, "qwen3_padded_vocab"),
     (1, 1, 1, "llama_gqa"), (4, 1, 2, "llama_gqa")],
)  # fmt: skip
def test_the_remote_plan_sends_every_generation_row_once_from_a_training_rank(tp, pp, t_g, model):
    """Split placement's plan (`plan.build_remote_plan`): training ranks only send,
    generation ranks only receive (and fill padding), every row of every generation shard
    arrives exactly once, and sender and receiver agree on every message."""
    from rl_megatron.resharding.layouts import GenerationLayout
    from rl_megatron.resharding.plan import Fill, PlanKey, build_remote_plan
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.reshard_refs import model_info

    info = model_info(model)
    training = TrainingLayout(tp, pp, 1)
    train_vocab = padded_vocab_size(info.vocab_size, 128, tp)
    gen_vocab = vllm_layout.vllm_padded_vocab(info.vocab_size, t_g)
    key = PlanKey(info, training, GenerationLayout(tp=t_g, world_size=tp * pp),
                  vllm_layout.vllm_specs, train_vocab, gen_vocab, 1 << 12, 4)  # fmt: skip
    plan = build_remote_plan(key)
    block = tp * pp
    assert plan.replica_size == block + t_g
    for local in range(block):  # training ranks: sends only
        assert not plan.targets[local]
        for r in plan.rounds[local]:
            assert not r.writes and not r.recvs
            assert all(peer >= block for peer in r.sends)
    for g in range(t_g):
        local = block + g
        assert not plan.sources[local]
        specs = {s.name: s for s in plan.targets[local]}
        assert specs == {s.name: s for s in vllm_layout.vllm_specs(info, t_g, g, gen_vocab)}
        rows = {name: [0] * s.rows for name, s in specs.items()}
        for r in plan.rounds[local]:
            assert not r.sends and all(peer < block for peer in r.recvs)
            assert all(isinstance(w, Fill) for w in r.writes)
            for m in [*r.writes, *(m for ms in r.recvs.values() for m in ms)]:
                for i in range(m.dst_offset, m.dst_offset + m.rows):
                    rows[m.dst_param][i] += 1
            for peer, moves in r.recvs.items():  # what the peer sends this rank, in order
                sent = next(s for s in plan.rounds[peer] if s.index == r.index).sends[local]
                assert sent == moves
        assert all(set(counts) == {1} for counts in rows.values()), "a row twice or never"
