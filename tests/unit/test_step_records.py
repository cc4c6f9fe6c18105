"""Each step's record (metrics.jsonl, the console line) carries that step's own evaluation
and checkpoint timings, the last step's included (issue 36): `PPOTrainer.fit` driven with
stand-in phases on a fake clock."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from rl_megatron.config import CheckpointConfig, LoggingConfig, TrainerConfig
from rl_megatron.trainer.ppo_trainer import PPOTrainer
from rl_megatron.utils.metrics import MetricsTracker, read_metrics
from rl_megatron.utils.timers import PhaseTimer

GENERATE_S, EVALUATE_S, CHECKPOINT_S = 1.0, 0.5, 0.25


class _Clock:
    """`time.perf_counter` that moves only when a stand-in phase says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _trainer(tmp_path, clock: _Clock, total_steps: int, stop_after: int | None = None):
    """A PPOTrainer's state as `fit` uses it; its real `save` (the `checkpoint` phase)."""
    fake = SimpleNamespace(
        config=SimpleNamespace(
            trainer=TrainerConfig(val_interval=2),
            checkpoint=CheckpointConfig(save_interval=3),
            logging=LoggingConfig(log_interval=1),
        ),
        run=SimpleNamespace(env=SimpleNamespace(rank=0)),
        phases=PhaseTimer(),
        metrics=MetricsTracker(tmp_path, rank=0),
        log=logging.getLogger("test"),
        hf_snapshots=None,
        peft_snapshots=None,
        session=None,  # single-turn
        split=None,  # the engine on these ranks
        step=0,
        total_steps=total_steps,
        saved=[],
    )

    def train_step():
        # As the real one: the training phases are timed, then taken with the step's metrics.
        with fake.phases.time("generate"):
            clock.now += GENERATE_S
        return {
            "reward/mean": 0.5,
            "rollout/response_length_mean": 4.0,
            "actor/entropy_rollout": 1.0,
            "perf/tokens_per_s_per_device": 10.0,
            **fake.phases.pop(),
        }

    def evaluate():
        clock.now += EVALUATE_S
        return {"val/reward_mean": 0.75}

    def save_checkpoint(step):
        clock.now += CHECKPOINT_S
        fake.saved.append(step)

    fake.train_step = train_step
    fake.evaluate = evaluate
    fake.checkpoints = SimpleNamespace(save=save_checkpoint)
    fake.save = lambda: PPOTrainer.save(fake)
    fake.resume = lambda: None
    fake._start_split = lambda: PPOTrainer._start_split(fake)
    fake._stop_requested = lambda: stop_after is not None and fake.step >= stop_after
    return fake


def test_each_record_has_its_own_evaluation_and_checkpoint_timings(tmp_path, monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    trainer = _trainer(tmp_path, clock, total_steps=5)
    PPOTrainer.fit(trainer)

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert trainer.saved == [3, 5]  # every 3 steps, and at the end
    timings = [
        (r.get("timing_s/evaluate"), r.get("timing_s/checkpoint"), r["timing_s/step"])
        for r in records
    ]
    eval_step = GENERATE_S + EVALUATE_S
    ckpt_step = GENERATE_S + CHECKPOINT_S
    assert timings == [
        (None, None, GENERATE_S),  # step 1: neither
        (EVALUATE_S, None, eval_step),  # step 2: its evaluation (val_interval 2)
        (None, CHECKPOINT_S, ckpt_step),  # step 3: its checkpoint (save_interval 3)
        (EVALUATE_S, None, eval_step),
        (None, CHECKPOINT_S, ckpt_step),  # the last step: its final checkpoint
    ]
    assert [r["timing_s/generate"] for r in records] == [GENERATE_S] * 5
    # The evaluation's results sit in the same record as its time.
    assert [("val/reward_mean" in r) for r in records] == [False, True, False, True, False]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [f"step {i}/5" for i in range(1, 6)]
    assert f"| {eval_step:.1f}s (gen" in lines[1] and f"| {ckpt_step:.1f}s (gen" in lines[4]


@pytest.mark.parametrize("stop_after", [1, 2])
def test_a_sigterm_step_records_its_checkpoint_before_stopping(tmp_path, monkeypatch, stop_after):
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    trainer = _trainer(tmp_path, clock, total_steps=5, stop_after=stop_after)
    PPOTrainer.fit(trainer)

    records = read_metrics(tmp_path)
    assert trainer.saved == [stop_after]
    assert [r["step"] for r in records] == list(range(1, stop_after + 1))
    last = records[-1]
    assert last["timing_s/checkpoint"] == CHECKPOINT_S
    assert last.get("timing_s/evaluate") == (EVALUATE_S if stop_after == 2 else None)
