"""`trainer.mode: split_async` with vLLM (CPU build) generating on ranks of their own.

4 ranks: 2 train (TP=1 x DP=2), 2 run vLLM at TP 1, one engine per training replica. With
staleness 0 every step's batch is sampled by weights synced after the previous update,
from the training ranks across the bridge into vLLM's parameters (resharded on the
training side into vLLM's layout, then sent shard by shard). vLLM's sampling log-probs
against the actor's recomputed ones are at fp32 parity (~1e-6, tests/vllm) only if every
row of every weight landed where it belongs, while the weights change every step: the
bound below (1e-3) catches any misplaced row. With staleness 1 each step after the first
trains on the previous version's samples, and the mismatch shows it.
"""

from __future__ import annotations

import pytest

from tests.vllm.test_trainer_vllm import run_trainer

SPLIT = [
    "parallel.tp=1",
    "trainer.mode=split_async",
    "placement.rollout_ranks=2",
    "trainer.val_interval=0",
    "checkpoint.save_interval=0",
    "algorithm.rollout_correction.level=token",  # vLLM returns its log-probs
]


@pytest.mark.slow
def test_vllm_on_generation_ranks_samples_with_the_weights_just_trained(tmp_path):
    rows = run_trainer(
        tmp_path / "s0", nproc=4, steps=3, overrides=[*SPLIT, "rollout.max_staleness=0"]
    )
    for row in rows:
        assert row["async/staleness_max"] == 0.0
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert row["reshard/sent_gb"] > 0 and row["split/generate_tokens_per_s"] > 0
        assert row["rollout/num_samples"] == 64 and row["actor/grad_norm"] > 0
    stale = run_trainer(
        tmp_path / "s1", nproc=4, steps=3, overrides=[*SPLIT, "rollout.max_staleness=1"]
    )
    assert [r["async/staleness_max"] for r in stale] == [0, 1, 1]
    # Steps 2 and 3 trained on samples of the weights before the last update.
    assert min(r["rollout/logprob_diff_max"] for r in stale[1:]) > 1e-3
