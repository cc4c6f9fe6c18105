"""benchmarks/update_diagnostics.py (`trainer_bench.py --update-diagnostics`): the slot
rounds, the config diff and the micro-batch recorder (the GPU numbers are the benchmark's;
these check its bookkeeping)."""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

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

        def _update(self, role, batch, loss_fn, name, **kwargs):
            self.ran.append(f"{name}:{batch}")
            return name

        def train_step(self) -> None:
            self._update(None, self.step, None, "critic")
            self._update(None, self.step, None, "actor")

    trainer = Trainer()
    seen: list[str] = []

    @contextlib.contextmanager
    def during():
        yield seen
        seen.append("closed")

    update, value = update_traces.kept_actor_update(trainer, during)
    assert value is seen and seen == ["closed"] and trainer.step == 1
    assert trainer.ran == ["critic:0", "actor:0"]
    assert update() == "actor" and trainer.ran[-1] == "actor:0"  # the same batch again
    assert trainer._update.__func__ is Trainer._update  # the patch is gone
