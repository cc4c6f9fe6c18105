"""How deeply the trainer puts its engine to sleep, and that it syncs before every generate.

`rollout.sleep_level` 2 (the default) lets the engine drop its weights while the roles
train: the next sync rewrites every one of them, so a host copy (level 1) would be moved
out and back for nothing. Between the rounds of dynamic sampling the engine keeps them
(level 1): the next round generates with the same weights and no sync comes before it.
Level 0 keeps the weights on the device at every sleep, between rounds too.
The engine refuses to generate after a level-2 sleep until a full update
(`RolloutEngine.generate`), so a trainer that slept deeply and skipped a sync fails here.
The trainer's phase timer reads what the engine holds asleep, and the evaluation's KV-cache
wake is a part of its phase, so that the phase's `_on_device` peaks see it awake.
With `rollout.wake_weights_during_update` (the default) the engine's weights wake once the
actor's last optimizer step is queued and before its metrics are read (the host's wait),
when they fit; the next sync then has nothing to wake.

One rank, the replayed rollout of `tests/trainer_probe.py`, two steps and an evaluation.
"""

from __future__ import annotations

import pytest

from tests.spawn import run_on_ranks
from tests.trainer_probe import build_probe_trainer, probe_config


def _record(trainer) -> tuple[list[int], list[int | None]]:
    """The level of every `sleep`, and the weight version at every `generate`."""
    levels: list[int] = []
    versions: list[int | None] = []
    engine = trainer.engine
    sleep, generate = engine.sleep, engine.generate

    def recorded_sleep(level: int = 1) -> None:
        levels.append(level)
        sleep(level)

    def recorded_generate(*args, **kwargs):
        versions.append(engine.weight_version)
        return generate(*args, **kwargs)

    engine.sleep, engine.generate = recorded_sleep, recorded_generate
    return levels, versions


def _body(rank, world_size, tmp_path, overrides, expected_levels):
    from rl_megatron.distributed import distributed_run

    config = probe_config(
        tmp_path,
        {},
        [
            "algorithm.adv_estimator=grpo",
            "trainer.total_steps=2",
            "data.val_batch_size=4",
            *overrides,
        ],
    )
    with distributed_run(seed=config.trainer.seed, timeout_s=120) as run:
        trainer = build_probe_trainer(config, run, total_steps=2)
        # The phases' `_on_device` peaks subtract what the engine holds asleep.
        assert trainer.phases.off_device_bytes == trainer.engine.unmapped_bytes
        trainer.data.val = trainer.data.train  # an evaluation set: the same prompts
        levels, versions = _record(trainer)
        for _ in range(2):
            trainer.train_step()
            trainer.step += 1
        trainer.phases.pop()
        trainer.evaluate()
        # The evaluation wakes and sleeps again: the phase's least read of the engine's
        # memory asleep is the one at the end of its KV cache's wake (`PhaseTimer.part`).
        assert "timing_parts_s/evaluate/wake_kv_cache" in trainer.phases.pop()
        assert levels == expected_levels, levels
        # Step 1 generates with the weights the engine started from; every later generate
        # with the actor's weights of that step, synced after the deep sleep.
        assert versions[0] == 0 and versions[-1] == 2, versions
        assert all(v is not None for v in versions), versions


@pytest.mark.parametrize(
    "overrides, expected_levels",
    [
        ([], [2, 2, 2]),  # two rollouts, then the evaluation
        # Dynamic sampling: a round may be followed by another without a sync in between.
        (
            [
                "algorithm.dynamic_sampling.enable=true",
                "algorithm.dynamic_sampling.max_extra_rounds=0",
            ],
            [1, 1, 2],
        ),
        # Level 0 keeps the weights on the device: so do the rounds of dynamic sampling.
        (["rollout.sleep_level=0"], [0, 0, 0]),
        (
            [
                "rollout.sleep_level=0",
                "algorithm.dynamic_sampling.enable=true",
                "algorithm.dynamic_sampling.max_extra_rounds=0",
            ],
            [0, 0, 0],
        ),
    ],
    ids=["default", "dynamic_sampling", "level0", "level0_dynamic_sampling"],
)
def test_sleep_level(tmp_path, overrides, expected_levels):
    run_on_ranks(
        _body, world_size=1, tmp_path=tmp_path, overrides=overrides, expected_levels=expected_levels
    )


def _wake_order_body(rank, world_size, tmp_path, overrides, room, expected):
    from rl_megatron.distributed import distributed_run

    config = probe_config(
        tmp_path, {}, ["algorithm.adv_estimator=grpo", "trainer.total_steps=2", *overrides]
    )
    with distributed_run(seed=config.trainer.seed, timeout_s=120) as run:
        trainer = build_probe_trainer(config, run, total_steps=2)
        engine, actor = trainer.engine, trainer.roles.actor
        events: list[str] = []

        def recorded(fn, label):
            def call(*args, **kwargs):
                events.append(label(*args))
                return fn(*args, **kwargs)

            return call

        # What the engine really wakes (its hook), and when the actor queues a step and
        # when the host reads the steps' metrics.
        engine._wake = recorded(engine._wake, lambda tags: "wake " + ",".join(tags))
        engine._has_room = lambda tags: room
        actor._optimizer_step = recorded(actor._optimizer_step, lambda *a: "step")
        actor._resolve = recorded(actor._resolve, lambda *a: "resolve")
        # The update's memory peaks are taken before the wake changes what sleeps.
        phases = trainer.phases
        phases.close_peaks = recorded(phases.close_peaks, lambda *a: "close_peaks " + a[0])
        # Where the phases' memory accounting ends an interval, and where room is made.
        phases._boundary = recorded(phases._boundary, lambda *a, **k: "|")
        engine.make_room = recorded(engine.make_room, lambda tags: "make_room " + ",".join(tags))
        flags, overlap = [], []
        for _ in range(2):
            metrics = trainer.train_step()
            trainer.step += 1
            flags.append(metrics.get("reshard/weights_woken_during_update"))
            overlap.append("timing_overlap_s/update_actor/wake_engine_weights" in metrics)
        # Room is made for a wake in an interval of its own: a boundary after it, and one
        # before what the engine really wakes (so that torch's cache given back and the
        # engine's memory mapped never share one).
        for i, event in enumerate(events):
            if event.startswith("make_room"):
                assert events[i + 1] == "|", events[i - 2 : i + 3]
            if event.startswith("wake"):
                assert events[i - 1] == "|" or events[i - 1].startswith("close_peaks"), events
        steps = [e for e in events if e != "|" and not e.startswith("make_room")]
        collapsed = [e for i, e in enumerate(steps) if not (e == "step" == steps[i - 1])]
        assert collapsed == expected, collapsed
        woke_early = not overrides
        assert flags == [float(room) if woke_early else None] * 2, flags
        assert overlap == [woke_early] * 2, overlap


@pytest.mark.parametrize(
    "overrides, room, expected",
    [
        # The engine starts awake; after each rollout it sleeps at level 2. The weights wake
        # between the last step and the metrics' read; the next sync wakes nothing.
        (
            [],
            True,
            [
                *("step", "close_peaks update_actor", "wake weights", "resolve"),
                *("wake kv_cache", "step", "close_peaks update_actor", "wake weights", "resolve"),
            ],
        ),
        # No room beside the roles: the sync wakes them, as with the option off.
        (
            [],
            False,
            [
                *("step", "close_peaks update_actor", "resolve", "wake weights"),
                *("wake kv_cache", "step", "close_peaks update_actor", "resolve"),
            ],
        ),
        (
            ["rollout.wake_weights_during_update=false"],
            True,
            ["step", "resolve", "wake weights", "wake kv_cache", "step", "resolve"],
        ),
    ],
    ids=["default", "no_room", "off"],
)
def test_weights_wake_during_the_update(tmp_path, overrides, room, expected):
    run_on_ranks(
        _wake_order_body,
        world_size=1,
        tmp_path=tmp_path,
        overrides=overrides,
        room=room,
        expected=expected,
    )
