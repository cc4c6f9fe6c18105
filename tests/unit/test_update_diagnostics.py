"""benchmarks/update_diagnostics.py (`trainer_bench.py --update-diagnostics`): the slot
rounds, the config diff and the micro-batch recorder (the GPU numbers are the benchmark's;
these check its bookkeeping)."""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import update_diagnostics as ud  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402


def test_interleave_slots_balances_order_and_places():
    calls = []
    slots = {name: functools.partial(calls.append, name) for name in "abcd"}
    seconds, orders, probes = ud.interleave_slots(slots, repeats=8, warmup=1)
    assert len(calls) == 4 * 9 and all(len(s) == 8 for s in seconds.values())
    assert set(probes) == set(slots) and len(orders) == 8
    for x, y in itertools.permutations("abcd", 2):  # every pair in either order, 4 rounds each
        assert sum(o.index(x) < o.index(y) for o in orders) == 4
    for name in "abcd":  # every slot in every place, twice
        assert sorted(o.index(name) for o in orders) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_config_diff_names_only_what_differs():
    def config(**kwargs):
        return TransformerConfig(
            num_layers=2, hidden_size=8, num_attention_heads=2, init_method_std=0.02, **kwargs
        )

    # Each config makes its own initialiser partials: equal by what they call.
    assert ud.config_diff(config(), config()) == {}
    diff = ud.config_diff(config(hidden_dropout=0.0), config(hidden_dropout=0.1))
    assert diff == {"hidden_dropout": ["0.0", "0.1"]}


def test_recorded_micro_batches_sees_each_step_and_restores_the_method():
    class Role:
        def _micro_batches(self, batch, split):
            return [{"input_ids": batch[rows]} for rows in split]

    role, batch = Role(), torch.arange(8).view(4, 2)
    with ud.recorded_micro_batches(role) as built:
        first = role._micro_batches(batch, [[0, 1], [2, 3]])
        role._micro_batches(batch, [[3]])
    assert built[0] is first and len(built) == 2 and len(built[1]) == 1
    assert "_micro_batches" not in vars(role)  # the class's method again


def test_kept_actor_update_reruns_the_actor_phase_and_returns_what_during_saw():
    """`update_traces.kept_actor_update`: one more step (the critic's phase as usual), its
    actor phase kept as a callable that runs it again, and `during()`'s value from the
    step's own run."""
    import contextlib

    import update_traces

    class Trainer:
        step = 0

        def __init__(self) -> None:
            self.ran: list[str] = []
            self.open: list[str] = []  # the phases open now
            trainer = self

            class Phases:
                @contextlib.contextmanager
                def time(self, phase):
                    trainer.open.append(phase)
                    yield
                    trainer.open.remove(phase)

            self.phases = Phases()

        def _update(self, role, batch, loss_fn, name, **kwargs):
            self.ran.append(f"{name}:{batch}:{','.join(self.open)}")
            return name

        def train_step(self) -> None:
            with self.phases.time("update_critic"):
                self._update(None, self.step, None, "critic")
            with self.phases.time("update_actor"):
                self._update(None, self.step, None, "actor")

    trainer = Trainer()
    seen: list[str] = []

    @contextlib.contextmanager
    def during():
        yield seen
        seen.append("closed")

    update, value = update_traces.kept_actor_update(trainer, during)
    assert value is seen and seen == ["closed"] and trainer.step == 1
    assert trainer.ran == ["critic:0:update_critic", "actor:0:update_actor"]
    # The same batch again, inside the phase (its last step may close the phase's peaks).
    assert update() == "actor" and trainer.ran[-1] == "actor:0:update_actor"
    assert trainer.open == []
    assert trainer._update.__func__ is Trainer._update  # the patch is gone


def test_interleave_slots_rounds_of_several_calls_sum_them_and_cancel_a_drift(monkeypatch):
    """K calls of each slot per round: passes alternate the round's order and its
    reverse, a slot's round time is the sum of its K calls, warm-ups stay one call each,
    and a host slowing linearly in time adds the same to every slot (K even)."""
    now, calls = [0.0], []

    def slot(name):
        calls.append(name)
        now[0] += 1.0 + 0.1 * len(calls)  # every call slower than the one before

    monkeypatch.setattr(ud.time, "perf_counter", lambda: now[0])
    slots = {name: functools.partial(slot, name) for name in "abc"}
    seconds, orders, _ = ud.interleave_slots(slots, repeats=2, warmup=1, calls_per_round=2)
    assert calls[:3] == list("abc")  # warm-up: one call each
    assert calls[3:9] == list("abccba") and orders[0] == list("abc")
    assert calls[9:15] == list("cbaabc") and orders[1] == list("cba")
    assert seconds["a"] == pytest.approx([2.0 + 0.1 * (4 + 9), 2.0 + 0.1 * (12 + 13)])
    for name in "bc":  # the drift cancels: every slot the same sum in each round
        assert seconds[name] == pytest.approx(seconds["a"])
    # One call per round would not cancel it: the first slot of a round is faster.
    now[0], calls[:] = 0.0, []
    single, _, _ = ud.interleave_slots(slots, repeats=2, warmup=1)
    assert single["a"][0] < single["c"][0]
    with pytest.raises(ValueError, match="calls_per_round must be >= 1, got 0"):
        ud.interleave_slots(slots, repeats=2, calls_per_round=0)


@pytest.mark.parametrize("same_tokens", [True, False])
def test_update_vs_plain_ab_feeds_b_and_counts_calls_as_asked(monkeypatch, same_tokens):
    """`trainer_bench.update_vs_plain_ab`: with --plain-update-batches the plain loop gets
    the update's own micro-batches (as `plain_micro_batches` makes them), else random
    ones (None); --update-calls-per-round K reaches the A/B and its control."""
    import argparse
    import contextlib
    from types import SimpleNamespace

    import trainer_bench as tb
    from plain_loop import plain_micro_batches

    ids = torch.arange(12).view(2, 6)
    recorded = [
        [{"input_ids": ids, "position_ids": ids}],
        [{"input_ids": ids + 1, "position_ids": ids}],
    ]
    updates, fed = [], []

    class Loop:
        def __init__(self, *args, **kwargs):
            pass

        def iteration(self, micro_batches=None):
            fed.append(micro_batches)

        def close(self):
            pass

    monkeypatch.setattr(
        tb, "kept_actor_update", lambda trainer, during: (lambda: updates.append(1), recorded)
    )
    monkeypatch.setattr(tb, "PlainLoop", Loop)
    monkeypatch.setattr(tb, "sync", lambda: None)
    monkeypatch.setattr(tb, "trainer_gc_policy", lambda manual: contextlib.nullcontext())
    monkeypatch.setattr(tb.dist, "get_rank", lambda: 0)
    config = SimpleNamespace(
        model=SimpleNamespace(num_layers=2, hidden_size=8, num_experts=4, moe_router_topk=2),
        algorithm=SimpleNamespace(adv_estimator="grpo"),
        trainer=SimpleNamespace(manual_gc=False),
    )
    args = argparse.Namespace(
        interleave_update=3,
        update_calls_per_round=2,
        plain_update_batches=same_tokens,
        update_diagnostics=0,
        out_json=None,
    )
    out = tb.update_vs_plain_ab(SimpleNamespace(info=None), config, args, optimizer_steps=2)
    # A/B: a warm-up round of one call each, then 3 rounds of 2 calls; the control: 3
    # rounds of 2 calls of the plain loop in each slot; the loop's own warm-up first.
    assert len(updates) == 1 + 3 * 2
    plain_calls = 1 + 3 * 2 + 3 * 2 * 2
    assert len(fed) == 1 + 2 * plain_calls  # each plain call: both optimizer steps
    assert fed[0] is None  # the loop's warm-up: random tokens
    if same_tokens:
        want = [plain_micro_batches(m) for m in recorded]
        for i, got in enumerate(fed[1:]):
            expected = want[i % 2]
            assert torch.equal(got[0]["input_ids"], expected[0]["input_ids"])
            assert torch.equal(got[0]["labels"], expected[0]["labels"])
        assert out["plain_tokens"] == "update_batches"
        assert "the update's own micro-batches" in out["target"]["name"]
    else:
        assert fed[1:] == [None] * (2 * plain_calls)
        assert out["plain_tokens"] == "random" and "random tokens" in out["target"]["name"]
    assert (
        out["ab"]["calls_per_round"] == 2 and out["control_plain_vs_plain"]["calls_per_round"] == 2
    )
    assert out["ab"]["repeats"] == 3 and out["target"]["calls_per_round"] == 2
