"""trainer.mode and the asynchronous rollout keys: defaults, what they resolve to, and
one-line refusals naming the key."""

from __future__ import annotations

import pytest

from rl_megatron.config import ConfigError, load_config
from rl_megatron.config_checks import validate
from tests.unit.test_multi_turn import ONE_RANK, TINY


def test_sync_is_the_default_and_async_turns_the_correction_on():
    config = load_config(TINY, ONE_RANK)
    assert config.trainer.mode == "sync"
    assert config.algorithm.rollout_correction.level is None
    assert config.rollout.calculate_log_probs is False
    # Chunks long enough for the longest sample to finish within the bound: 8 / (1 + 1).
    assert config.rollout.partial.chunk_tokens == 4
    staleness_2 = load_config(TINY, ONE_RANK + ["rollout.max_staleness=2"])
    assert staleness_2.rollout.partial.chunk_tokens == 3  # ceil(8 / 3)
    config = load_config(TINY, ONE_RANK + ["trainer.mode=colocated_async"])
    validate(config, world_size=1)
    # Stale tokens need the behaviour policy's log-probs: token-level TIS at 2.
    assert config.algorithm.rollout_correction.level == "token"
    assert config.algorithm.rollout_correction.threshold == 2.0
    assert config.rollout.calculate_log_probs is True
    assert (config.rollout.max_staleness, config.rollout.on_stale) == (1, "restart")
    # A correction the user names is kept.
    config = load_config(
        TINY,
        ONE_RANK + ["trainer.mode=colocated_async", "algorithm.rollout_correction.level=sequence"],
    )
    assert config.algorithm.rollout_correction.level == "sequence"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.max_staleness=-1"], "rollout.max_staleness: must be >= 0, got -1"),
        (["rollout.partial.in_flight_batches=0"],
         "rollout.partial.in_flight_batches: must be >= 1, got 0"),
        (["rollout.partial.chunk_tokens=0"], "rollout.partial.chunk_tokens: 0 must be in [1, "),
        (["trainer.mode=split_async"], "trainer.mode: split_async needs a launch of 2 ranks"),
        (["trainer.mode=colocated_async", "algorithm.dynamic_sampling.enable=true",
          "rollout.n=4", "algorithm.adv_estimator=grpo"],
         "algorithm.dynamic_sampling.enable: trainer.mode=colocated_async does not combine"),
        (["trainer.mode=colocated_async", "environment.function=my_env.py:Lookup"],
         "environment.function: trainer.mode=colocated_async does not combine with multi-turn"),
        (["rollout.on_stale=skip"], "rollout.on_stale"),
        (["trainer.mode=async"], "trainer.mode"),
    ],
)  # fmt: skip
def test_async_config_checks_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate(load_config(TINY, ONE_RANK + overrides), world_size=1)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.mode=split_async"], "placement.rollout_ranks: trainer.mode=split_async needs "
         "1 to 3 generation ranks of the 4 launched, got 0"),
        (["trainer.mode=split_async", "placement.rollout_ranks=4"],
         "placement.rollout_ranks: trainer.mode=split_async needs 1 to 3"),
        (["placement.rollout_ranks=2"],
         "placement.rollout_ranks: 2 generation ranks need trainer.mode=split_async (got sync)"),
        (["trainer.mode=split_async", "placement.rollout_ranks=3", "rollout.tp=2",
          "parallel.tp=1"], "placement.rollout_ranks: 3 is not a multiple of rollout.tp=2"),
        (["trainer.mode=split_async", "placement.rollout_ranks=2", "trainer.val_interval=5"],
         "trainer.val_interval: trainer.mode=split_async does not combine with evaluation"),
        (["trainer.mode=split_async", "placement.rollout_ranks=2", "rollout.verify_sync=sample"],
         "rollout.verify_sync: trainer.mode=split_async does not combine with verified syncs"),
        (["trainer.mode=split_async", "placement.rollout_ranks=2", "actor.lora.rank=4"],
         "actor.lora.rank: trainer.mode=split_async does not combine with a LoRA actor"),
        (["trainer.mode=split_async", "placement.rollout_ranks=2", "parallel.tp=2",
          "rollout.tp=1"], "placement.rollout_ranks: 2 ranks make 2 generation replicas at "
         "rollout.tp=1, more than the 1 training replicas"),
        # The training layout spans the ranks that do not generate: 4 - 3 = 1, not tp=2.
        (["trainer.mode=split_async", "placement.rollout_ranks=3", "parallel.tp=2",
          "rollout.tp=1"], "placement.rollout_ranks: 3 leaves 1 training ranks of the 4 "
         "launched, not a multiple of parallel.tp·pp·cp = 2·1·1"),
    ],
)  # fmt: skip
def test_split_placement_checks_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate(load_config(TINY, ONE_RANK + ["trainer.val_interval=0"] + overrides), world_size=4)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_split_placement_trains_on_the_ranks_that_do_not_generate():
    overrides = ["trainer.mode=split_async", "placement.rollout_ranks=2", "parallel.tp=2"]
    config = load_config(TINY, ONE_RANK + ["trainer.val_interval=0"] + overrides)
    layout = validate(config, world_size=6)
    assert (layout.tp, layout.dp, layout.world_size) == (2, 2, 4)
    # Batches a version or more behind: the asynchronous correction, as colocated_async's.
    assert config.algorithm.rollout_correction.level == "token"
