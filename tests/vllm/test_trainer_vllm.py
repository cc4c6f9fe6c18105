"""The trainer with the in-process vLLM engine (CPU build) on a pipeline-parallel actor.

2 ranks, TP=1 × PP=2 for training, vLLM at TP=1 (two generation replicas inside the one
training replica): every step reshards the actor's two pipeline stages into both engines.
If a sync put any weight in the wrong place, vLLM's sampling log-probs would drift from the
actor's recomputed ones; the fp32 CPU parity of the two is ~1e-6 (tests/vllm), so the
mismatch bound below (1e-3) catches any wrong row while the weights change every step.

That run turns the rollout correction on (sequence-level TIS and rejection), which makes
the trainer ask vLLM for its log-probs (`rollout.calculate_log_probs` left at its default);
with the fp32 CPU parity the weights stay 1 and nothing is rejected. A second run (1 rank,
2 steps) keeps the defaults, no correction and no log-probs: the trainer must train as
before, without the mismatch metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.rollout_refs import tiny_llama
from tests.vllm.torchrun_script import REPO

STEPS = 4


def run_trainer(tmp_path, nproc: int, steps: int, overrides: list[str]) -> list[dict]:
    """launch/ppo.py on tiny_cpu.yaml with a tiny HF Llama and vLLM; the metrics rows."""
    hf_dir = tmp_path / "tiny_llama"
    tiny_llama(0).save_pretrained(hf_dir, safe_serialization=True)
    arch = ["num_layers", "hidden_size", "num_attention_heads", "num_query_groups"]
    arch += ["ffn_hidden_size", "vocab_size"]
    overrides = [f"model.{key}=null" for key in arch] + [
        f"model.hf_path={hf_dir}",
        "model.max_position_embeddings=256",
        "rollout.engine=vllm",
        "rollout.tp=1",
        "rollout.gpu_memory_utilization=0.05",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={tmp_path / 'runs'}",
        *overrides,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "launch/ppo.py", "--config", "yaml_configs/tiny_cpu.yaml"]
    proc = subprocess.run(
        cmd + overrides, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (tmp_path / "runs" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows


@pytest.mark.slow
def test_grpo_with_vllm_rollout_and_pipeline_parallel_actor(tmp_path):
    overrides = ["parallel.tp=1", "parallel.pp=2", "trainer.val_interval=2"]
    overrides += [
        "algorithm.rollout_correction.level=sequence",  # asks vLLM for log-probs itself
        "algorithm.rollout_correction.rejection=[0.5, 2.0]",
    ]
    rows = run_trainer(tmp_path, nproc=2, steps=STEPS, overrides=overrides)
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert abs(row["rollout_corr/is_weight_mean"] - 1.0) < 1e-2, row
        assert row["rollout_corr/rejected_seq_frac"] == 0.0
        assert 0 <= row["rollout/mismatch_kl_k3"] < 1e-4
        assert row["rollout/num_samples"] == 64 and row["rollout/response_length_mean"] > 0
        # Step 1 generates with the weights vLLM loaded from hf_path (the actor's too);
        # later steps need a sync: each stage holds half the layers, each engine all.
        if row["step"] == 1:
            assert "reshard/bytes_received_gb" not in row
            assert "timing_parts_s/reshard/sync" not in row
        else:
            assert row["reshard/bytes_received_gb"] > 0
            # The reshard phase, split into its parts (issue 21): they fit inside it, and
            # the sync's host-side pieces inside the sync. The KV cache wakes after it, in
            # a phase of its own.
            parts = [row[f"timing_parts_s/reshard/{p}"] for p in ("wake_weights", "sync")]
            assert 0 < sum(parts) <= row["timing_s/reshard"], row
            assert row["timing_s/wake_kv_cache"] > 0, row
            pieces = ("prepare_s", "begin_s", "issue_copies_s", "finish_s")
            host = sum(row[f"reshard/{p}"] for p in pieces)
            assert 0 < host <= row["timing_parts_s/reshard/sync"], row
        assert row["actor/grad_norm"] > 0
    assert rows[1]["val/num_prompts"] == 32


@pytest.mark.slow
def test_grpo_without_engine_log_probs(tmp_path):
    overrides = ["parallel.tp=1", "trainer.val_interval=0"]  # calculate_log_probs: false
    rows = run_trainer(tmp_path, nproc=1, steps=2, overrides=overrides)
    for row in rows:
        assert not any(key.startswith("rollout/logprob_diff") for key in row), row
        assert row["rollout/num_samples"] == 64 and row["rollout/response_length_mean"] > 0
        assert row["actor/grad_norm"] > 0
    # Step 2 generated from weights synced after step 1's update (on one rank the sync
    # permutes in place: no bytes cross ranks).
    assert "reshard/bytes_received_gb" not in rows[0]
    assert rows[1]["reshard/bytes_received_gb"] == 0.0


@pytest.mark.slow
def test_reward_improves_with_rollout_correction(tmp_path):
    """GRPO with token-level TIS and rejection, vLLM sampling at TP=2 on 4 ranks (TP=2 x
    DP=2): the engine's log-probs reach the batch by themselves and the demo task's reward
    climbs as in `tests/e2e/test_training.py` (same bound, same 40 steps)."""
    from tests.e2e.test_training import MIN_IMPROVEMENT, _improvement

    overrides = ["parallel.tp=2", "rollout.tp=2", "trainer.val_interval=0"]
    overrides += [
        "checkpoint.save_interval=0",
        "algorithm.rollout_correction.level=token",
        "algorithm.rollout_correction.threshold=2.0",
        "algorithm.rollout_correction.rejection=[0.5, 2.0]",
    ]
    rows = run_trainer(tmp_path, nproc=4, steps=40, overrides=overrides)
    gain = _improvement(rows)
    assert gain > MIN_IMPROVEMENT, f"reward improved by {gain:.3f} only"
    for row in rows:  # fp32 on CPU: the engine's policy is the trainer's to ~1e-6
        assert abs(row["rollout_corr/is_weight_mean"] - 1.0) < 1e-3, row
        assert row["rollout_corr/rejected_token_frac"] == 0.0
        assert row["rollout/logprob_diff_max"] < 1e-3
