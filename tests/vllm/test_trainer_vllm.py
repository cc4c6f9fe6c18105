"""The trainer with the in-process vLLM engine (CPU build) on a pipeline-parallel actor.

2 ranks, TP=1 × PP=2 for training, vLLM at TP=1 (two generation replicas inside the one
training replica): every step reshards the actor's two pipeline stages into both engines.
If a sync put any weight in the wrong place, vLLM's sampling log-probs would drift from the
actor's recomputed ones; the fp32 CPU parity of the two is ~1e-6 (tests/vllm), so the
mismatch bound below (1e-3) catches any wrong row while the weights change every step.

That run turns the rollout correction on (sequence-level TIS and rejection), which makes
the trainer ask vLLM for its log-probs (`rollout.calculate_log_probs` left at its default);
with the fp32 CPU parity the weights stay 1 and nothing is rejected. A second run (2 ranks,
TP=2 for training and vLLM, 2 steps, tied embeddings) keeps the defaults, no correction and no log-probs: the trainer
must train as before, without the mismatch metrics.

Every passing run's console is quiet (issue 36): no traceback (vLLM's chat-template
warm-up, its engine shut down after the process groups), no "Failed to load weights" at a
weight sync (a tied lm_head, the rotary cache), no leaked shared memory at exit. A run
whose rollout.gpu_memory_utilization leaves no KV cache stops with one line, exit code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ports import reserve_port
from tests.rollout_refs import tiny_llama
from tests.vllm.torchrun_script import REPO

STEPS = 4
# What a passing run must not print (stdout and stderr), each a sign of issue 36's noise.
NOISE = ("Traceback", "Failed to load weights", "leaked shared_memory", "warmup failed")


def _hf_model(tmp_path, tied: bool):
    hf_dir = tmp_path / "tiny_llama"
    model = tiny_llama(0)
    if tied:  # lm_head shares the embedding, as Qwen's and Llama-3.2's small sizes do
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(hf_dir, safe_serialization=True)
    return hf_dir


def assert_quiet(proc: subprocess.CompletedProcess) -> None:
    console = proc.stdout + proc.stderr
    for noise in NOISE:
        assert noise not in console, f"{noise!r} in the console:\n{console[-6000:]}"


def run_trainer(
    tmp_path, nproc: int, steps: int, overrides: list[str], tied: bool = False
) -> list[dict]:
    """launch/ppo.py on tiny_cpu.yaml with a tiny HF Llama and vLLM; the metrics rows."""
    hf_dir = _hf_model(tmp_path, tied)
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
    assert_quiet(proc)
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
        "rollout.verify_sync=sample",  # each sync read back from vLLM and compared
        "rollout.sync_probe_prompts=3",  # and its log-probs on a fixed batch
        "rollout.sync_probe_tokens=4",
    ]
    rows = run_trainer(tmp_path, nproc=2, steps=STEPS, overrides=overrides)
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert 0 < row["sync_probe/tokens"] <= 3 * 4, row  # one replica (PP 2)
        assert row["sync_probe/logprob_diff_max"] < 1e-3, row["sync_probe/logprob_diff_max"]
        assert abs(row["rollout_corr/is_weight_mean"] - 1.0) < 1e-2, row
        assert row["rollout_corr/rejected_seq_frac"] == 0.0
        assert 0 <= row["rollout/mismatch_kl_k3"] < 1e-4
        assert row["rollout/num_samples"] == 64 and row["rollout/response_length_mean"] > 0
        # Step 1 generates with the weights vLLM loaded from hf_path (the actor's too);
        # later steps need a sync: each stage holds half the layers, each engine all.
        if row["step"] == 1:
            assert "reshard/bytes_received_gb" not in row
            assert "timing_parts_s/reshard/sync" not in row
            assert "sync/verify_s" not in row
        else:
            assert row["reshard/bytes_received_gb"] > 0
            assert row["sync/verified_tensors"] > 0 and row["sync/verified_bytes"] > 0, row
            assert row["sync/verify_s"] > 0
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
    # calculate_log_probs: false
    overrides = ["parallel.tp=2", "rollout.tp=2", "trainer.val_interval=0"]
    rows = run_trainer(tmp_path, nproc=2, steps=2, overrides=overrides, tied=True)
    for row in rows:
        assert not any(key.startswith("rollout/logprob_diff") for key in row), row
        assert not any(key.startswith("sync/verif") for key in row), row  # off
        assert row["rollout/num_samples"] == 64 and row["rollout/response_length_mean"] > 0
        assert row["actor/grad_norm"] > 0
    # Step 2 generated from weights synced after step 1's update (each rank's TP shard is
    # its own engine shard: the sync permutes in place, no bytes cross ranks).
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


@pytest.mark.slow
def test_kv_cache_that_does_not_fit_is_one_line_naming_a_value_that_does(tmp_path):
    """rollout.gpu_memory_utilization far below what the rank's process already holds (the
    CPU build sizes the KV cache as that share of the RAM minus the process, when
    VLLM_CPU_KVCACHE_SPACE is unset): one line, exit code 2, naming the key and a value;
    with that value the run trains."""
    import re

    hf_dir = _hf_model(tmp_path, tied=False)
    args = ["--config", "yaml_configs/tiny_cpu.yaml", f"trainer.output_dir={tmp_path / 'runs'}"]
    args += [f"model.{key}=null" for key in ("num_layers", "hidden_size", "vocab_size")]
    args += ["model.num_attention_heads=null", "model.num_query_groups=null"]
    args += ["model.ffn_hidden_size=null", f"model.hf_path={hf_dir}"]
    args += ["model.max_position_embeddings=256", "rollout.engine=vllm", "rollout.tp=1"]
    args += ["parallel.tp=1", "trainer.total_steps=1", "trainer.val_interval=0"]
    args += ["checkpoint.save_interval=0"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # One rank without torchrun (whose own exit code and traceback would stand in front of
    # the rank's), with the variables it sets: vLLM's external_launcher reads them.
    port = reserve_port()  # below the ephemeral range: tests/ports.py
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def launch(fraction: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "launch/ppo.py", *args, f"rollout.gpu_memory_utilization={fraction}"]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    proc = launch("0.0001")
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-4000:]
    fits = re.fullmatch(
        r"error: rollout\.gpu_memory_utilization=0\.0001 leaves no room for the KV cache on "
        r"this CPU \(it is 0\.00 GiB of [\d.]+ GiB of RAM per rank, and each rank already "
        r"holds [\d.]+ GiB\); use at least (0\.\d\d|1\.00)",
        lines[0],
    )
    assert fits, lines[0]
    proc = launch(fits[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_quiet(proc)


@pytest.mark.slow
def test_multi_turn_with_vllm_at_tp2(tmp_path):
    """Multi-turn rollouts through the trainer on vLLM at TP=2 (2 ranks): the first rank
    drives the environments and its TP peer replays each engine step. The engine's
    log-probs of the sampled tokens match the trainer's on the loss mask; the records'
    observations are the tool messages the environment sent, out of the loss."""
    overrides = ["parallel.tp=2", "rollout.tp=2", "trainer.val_interval=2"]
    overrides += [
        "data.synthetic_task=key_lookup",
        "environment.function=tests/e2e/envs/echo_env.py:SeenEnv",
        "reward.function=null",
        "rollout.calculate_log_probs=true",
        "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.max_turn_tokens=16",
        "rollout.max_response_length=48",
        "trainer.dump_rollouts=true",
    ]
    from rl_megatron.data.synthetic import EOS_ID, ROLE_IDS, CharTokenizer

    rows = run_trainer(tmp_path, nproc=2, steps=2, overrides=overrides)
    tok = CharTokenizer()
    observations = 0
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert row["multi_turn/trajectories"] == 64 and row["multi_turn/turns_mean"] >= 1
        assert row["actor/grad_norm"] > 0
        path = tmp_path / "runs" / "tiny_cpu" / "rollouts" / f"step_{row['step']:08d}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for r in records:
            assert r["token_ids"] == r["prompt_ids"] + r["response_ids"]
            assert len(r["observations"]) == r["num_turns"] - 1
            for k, obs in enumerate(r["observations"]):
                ids = [
                    ROLE_IDS["tool"],
                    *tok.encode(f"seen {k + 1}"),
                    EOS_ID,
                    ROLE_IDS["assistant"],
                ]
                assert obs["text"] == tok.decode(ids, skip_special_tokens=False)
            observations += len(r["observations"])
            assert r["reward"] == pytest.approx(r["env_reward"])
    assert observations > 0
    assert "val/reward_mean" in rows[1]


@pytest.mark.slow
def test_partial_rollouts_continue_exactly_on_vllm(tmp_path):
    """trainer.mode=colocated_async on vLLM (TP=2), chunks of 2 tokens: every response is
    generated in up to 4 calls, each re-reading the tokens so far as its prompt (prefix
    cache hits under the same weights). With max_staleness 0 nothing older than the step's
    weights is trained (samples left unfinished restart), so vLLM's log-probs of every
    token, continuation or not, must match the actor's recomputation as closely as a
    single call's do."""
    overrides = ["parallel.tp=2", "rollout.tp=2", "trainer.val_interval=0"]
    overrides += [
        "trainer.mode=colocated_async",
        "rollout.max_staleness=0",
        "rollout.partial.chunk_tokens=2",
        "rollout.partial.in_flight_batches=2",
    ]
    rows = run_trainer(tmp_path, nproc=2, steps=3, overrides=overrides)
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert row["async/staleness_max"] == 0.0
        assert row["async/chunks"] >= 2, row["async/chunks"]
        assert row["rollout/num_samples"] == 64
    # The second batch in flight started in each phase and restarted in the next.
    assert sum(row["async/restarted"] for row in rows[1:]) > 0


@pytest.mark.slow
def test_grpo_with_a_lora_adapter_in_vllm(tmp_path):
    """A LoRA actor (adapters on all four linear kinds, TP=2 for training and vLLM), synced
    both ways. `merged` (the default): each sync sends W + (alpha/r)·B·A
    (resharding/lora_merge.py). `adapter`: vLLM keeps the base it loaded from model.hf_path
    and runs the adapter with its own LoRA kernels; each sync sends A and B only
    (rollout/vllm/lora_sync.py). In both the engine's sampling log-probs stay the actor's
    recomputed ones to the fp32 CPU parity (1e-3): step 1 generates with the loaded base
    (B = 0), from step 2 on B has moved, and on the dev CPU a merged sync that sent W gave
    0.44 at step 2, an adapter sync that kept the last version 0.50 at step 3. The two runs
    sample the same tokens at every step (same seeds; their engines' log-probs differ by
    float rounding only: W·x + s·B(A·x) against (W + s·B·A)·x)."""
    modules = "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"
    common = ["parallel.tp=2", "rollout.tp=2", "trainer.val_interval=0"]
    common += ["actor.lora.rank=8", f"actor.lora.target_modules={modules}"]
    common += ["rollout.sleep_level=1", "trainer.dump_rollouts=true"]
    common += ["rollout.calculate_log_probs=true", "checkpoint.save_interval=0"]
    runs = {}
    for mode in ("merged", "adapter"):
        root = tmp_path / mode
        rows = run_trainer(root, nproc=2, steps=3, overrides=[*common, f"rollout.lora_sync={mode}"])
        for row in rows:
            assert row["rollout/logprob_diff_max"] < 1e-3, (mode, row["step"], row)
            assert row["rollout/num_samples"] == 64 and row["rollout/response_length_mean"] > 0
        records = root / "runs" / "tiny_cpu" / "rollouts"
        runs[mode] = rows, {
            step: [json.loads(x)["token_ids"] for x in (records / f"step_{step:08d}.jsonl")
                   .read_text().splitlines()]
            for step in (1, 2, 3)
        }  # fmt: skip
    (merged_rows, merged_tokens), (rows, tokens) = runs["merged"], runs["adapter"]
    assert "reshard/prepare_s" not in merged_rows[0] and merged_rows[1]["reshard/prepare_s"] > 0
    assert tokens == merged_tokens  # every trajectory of every step, token for token
    # Every adapter sync moves the adapters only (vLLM loaded the base): per layer PEFT's
    # q/k/v/o/gate/up/down, each A [r, in] and B [out, r] (hidden 64, q 4×32, k/v 2×32,
    # FFN 128), fp32.
    r, h, q, kv, ffn = 8, 64, 128, 64, 128
    pairs = [(h, q), (h, kv), (h, kv), (q, h), (h, ffn), (h, ffn), (ffn, h)]
    adapter_bytes = 2 * 4 * sum(r * (fan_in + fan_out) for fan_in, fan_out in pairs)
    for row in rows[1:]:
        assert row["reshard/bytes_received_gb"] * 1e9 == pytest.approx(adapter_bytes), row
    assert [r["actor/loss"] for r in rows] == pytest.approx(
        [r["actor/loss"] for r in merged_rows], rel=1e-4
    )  # the same samples trained on
