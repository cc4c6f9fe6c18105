"""`launch/ppo.py` trains: reward climbs (GRPO, PPO+GAE), resume after a kill, bad input.

The runs use `yaml_configs/tiny_cpu.yaml` (synthetic digit_echo task, random 4-layer
model) under torchrun on 4 gloo ranks, TP=2 × DP=2, as `make demo` does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rl_megatron.checkpoint.safe_metadata import read_metadata
from rl_megatron.config import load_config
from rl_megatron.data.synthetic import synthetic_dataset
from tests.e2e.launches import kill_after_checkpoint, start_run
from tests.e2e.test_launcher import ROOT, TINY, _run

# Mean reward of the last steps minus that of the first steps must exceed this. A random
# policy scores ~0.03 (one of ~100 tokens is the answer, 10 are digits); emitting only
# digits already scores >= 0.2, so 0.1 is a clear, learned improvement and far above the
# step-to-step noise (std of the step mean ~0.01-0.02 at 64 samples).
MIN_IMPROVEMENT = 0.1
WINDOW = 5


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _improvement(rows: list[dict]) -> float:
    rewards = [r["reward/mean"] for r in rows]
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW


def _train(tmp_path: Path, *overrides: str, ranks: int = 4, timeout: int = 600):
    args = ["--config", TINY, f"trainer.output_dir={tmp_path}", *overrides]
    return _run(args, torchrun_ranks=ranks, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator, extra",
    [
        ("grpo", []),
        # PPO with a critic (GAE); λ < 1 so the critic's values shape the advantages.
        ("gae", ["algorithm.lam=0.95"]),
        # LoRA rank 8 (tiny_cpu.yaml adapts the LM head too: a random model's frozen head
        # caps its logits); its engine samples through the head's hook (logits gathered
        # over TP), its trainer log-probs through `head_weight`: the diff check below.
        ("grpo", ["actor.lora.rank=8"]),
    ],
)
def test_reward_improves(tmp_path, estimator, extra):
    result = _train(
        tmp_path,
        f"algorithm.adv_estimator={estimator}",
        "trainer.total_steps=40",
        "trainer.val_interval=20",
        "checkpoint.save_interval=0",
        "rollout.sync_probe_prompts=3",
        "rollout.sync_probe_tokens=6",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "tiny_cpu")
    assert [r["step"] for r in rows] == list(range(1, 41))
    for row in rows:  # the probe after each sync: the engine samples with the actor's weights
        assert 0 < row["sync_probe/tokens"] <= 2 * 3 * 6  # 2 replicas × 3 prompts × 6 tokens
        assert row["sync_probe/logprob_diff_max"] < 1e-3, row["sync_probe/logprob_diff_max"]
        assert 1.0 <= row["sync_probe/token_mult_prob_error"] < 1.001
    gain = _improvement(rows)
    assert gain > MIN_IMPROVEMENT, f"{estimator}: reward improved by {gain:.3f} only"
    # The console line carries the reward too (what `make demo` shows).
    assert result.stdout.count("| reward ") == 40
    if estimator == "gae":
        assert "critic/loss" in rows[-1] and "critic/explained_variance" in rows[-1]
    # Every step times its phases and compares engine and trainer log-probs.
    for key in ("timing_s/generate", "timing_s/update_actor", "rollout/logprob_diff_max"):
        assert key in rows[-1], key
    # The Megatron engine samples with the actor's own weights: the same policy.
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    assert rows[19]["val/num_prompts"] == 32 and "val/reward_mean" in rows[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, extra",
    [
        # GSPO with the paper's clip range and aggregation (arXiv 2507.18071, §5.1).
        (
            "gspo",
            [
                "actor.policy_loss=gspo",
                "actor.loss_agg_mode=seq-mean-token-mean",
                "actor.clip_ratio_low=0.0003",
                "actor.clip_ratio_high=0.0004",
            ],
        ),
        ("cispo", ["actor.policy_loss=cispo", "actor.clip_ratio_high=0.28"]),
    ],
)
def test_reward_improves_with_gspo_and_cispo(tmp_path, name, extra):
    """The new policy losses learn the demo task (the rollout correction's run is the vLLM
    engine's, tests/vllm/test_trainer_vllm.py)."""
    result = _train(
        tmp_path,
        "trainer.total_steps=40",
        "trainer.val_interval=0",
        "checkpoint.save_interval=0",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "tiny_cpu")
    gain = _improvement(rows)
    assert gain > MIN_IMPROVEMENT, f"{name}: reward improved by {gain:.3f} only"


@pytest.mark.slow
def test_kl_terms_reference_and_offload(tmp_path):
    """KL loss + KL reward penalty (adaptive β) with the reference role; every role's
    params, grads and optimizer state offloaded between phases."""
    result = _train(
        tmp_path,
        "trainer.total_steps=3",
        "trainer.val_interval=0",
        "actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=100",
        "actor.offload.params=true",
        "actor.offload.grads=true",
        "actor.offload.optimizer=true",
        "reference.offload_params=true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "tiny_cpu")
    # The reference starts as the actor: no divergence before the first update (up to
    # float summation order: the two roles run different micro-batch shapes)...
    assert abs(rows[0]["actor/kl_to_ref"]) < 1e-6
    assert abs(rows[0]["actor/reward_kl_penalty"]) < 1e-6
    # ...and some after it, which the adaptive controller (target 0.1 > KL) lowers β for.
    assert rows[2]["actor/kl_to_ref"] != 0.0 and rows[2]["actor/kl_loss"] > 0.0
    assert rows[2]["actor/kl_coef"] < rows[0]["actor/kl_coef"]
    assert "timing_s/reference" in rows[0]


@pytest.mark.slow
def test_dump_rollouts_writes_one_record_per_trajectory(tmp_path):
    """`trainer.dump_rollouts`: one JSONL file per step with every replica's trajectories
    (2 ranks, DP=2: the records are gathered), tokens and mask as trained, the step's rewards."""
    result = _train(
        tmp_path,
        "parallel.tp=1",
        "rollout.tp=1",
        "trainer.total_steps=2",
        "trainer.val_interval=0",
        "checkpoint.save_interval=0",
        "trainer.dump_rollouts=true",
        ranks=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "tiny_cpu"
    rows = _metrics(run_dir)
    folder = run_dir / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_00000001.jsonl",
        "step_00000002.jsonl",
    ]
    config = load_config(ROOT / TINY)
    for row in rows:
        lines = (folder / f"step_{row['step']:08d}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert len(records) == config.data.train_batch_size * config.rollout.n
        assert [r["dp_rank"] for r in records] == sorted(r["dp_rank"] for r in records)
        assert {r["dp_rank"] for r in records} == {0, 1}  # both replicas, in replica order
        for r in records:
            assert r["step"] == row["step"] and r["num_turns"] == 1 and r["observations"] == []
            assert r["token_ids"] == r["prompt_ids"] + r["response_ids"]
            assert len(r["loss_mask"]) == len(r["token_ids"])
            assert sum(r["loss_mask"]) == len(r["response_ids"]) > 0
            assert r["loss_mask"][: len(r["prompt_ids"])] == [0] * len(r["prompt_ids"])
            assert len(r["rollout_log_probs"]) == len(r["response_ids"])
            assert r["finish_reason"] in {"stop", "length"}
            assert len(r["turns"]) == 1 and isinstance(r["turns"][0]["text"], str)
        # Equal rows per replica: the mean over replicas of their means is the mean.
        mean = sum(r["reward"] for r in records) / len(records)
        assert mean == pytest.approx(row["reward/mean"], abs=1e-6)
    assert not list(folder.glob("*.tmp"))


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    """6 steps straight vs 3 steps, SIGKILL, auto-resume, 3 more: same metrics at steps
    4-6 (data order, samples, losses, grad norms) and bit-identical final checkpoints."""
    _check_resume_after_kill(tmp_path)


@pytest.mark.slow
def test_resume_after_kill_with_lora(tmp_path):
    """The same with LoRA adapters and a KL loss (reference = the base): each step folder
    holds the adapters and their optimizer state only, the frozen base is one copy per run
    (`checkpoints/lora_base/`, not rewritten by the resumed run), and it resumes exactly.
    It failed once (one rank's final file, metrics equal, before `_where` named the byte) and
    then passed 45 times in a row, 10 of them beside CPU hogs (load ~11 on 2 cores)."""
    inodes = _check_resume_after_kill(tmp_path, "actor.lora.rank=8", "actor.use_kl_loss=true")
    base = "tiny_cpu/checkpoints/lora_base/actor"
    assert inodes["after the kill"] == inodes["after the resume"], inodes  # written once
    for run in ("straight", "killed"):
        step = tmp_path / run / "tiny_cpu/checkpoints/step_00000006"
        record = json.loads((step / "trainer_state.json").read_text())["roles"]["actor"]["base"]
        assert record["kind"] == "copy" and record["path"] == "../lora_base/actor"
        keys = sorted(read_metadata(step / "actor").state_dict_metadata)
        model = [k for k in keys if not k.startswith("optimizer.")]
        assert model and all("_lora." in k for k in model), model
    # The base copies are the same bytes too: with the step folders, the whole model.
    names = sorted(p.name for p in (tmp_path / "straight" / base).glob("*.distcp"))
    assert len(names) == 2  # one per TP rank: the DP replicas' identical shards go once
    for name in names:
        a, b = (tmp_path / run / base / name for run in ("straight", "killed"))
        assert a.read_bytes() == b.read_bytes(), f"{base}/{name} differs"


def _check_resume_after_kill(tmp_path, *extra: str) -> dict:
    common = ["trainer.total_steps=6", "trainer.val_interval=0", "checkpoint.save_interval=3"]
    common += extra
    straight = tmp_path / "straight"
    result = _train(straight, *common)
    assert result.returncode == 0, result.stderr[-3000:]

    # Same run, killed (SIGKILL, whole process group) once step 3's checkpoint exists.
    killed = tmp_path / "killed"
    kill_after_checkpoint(start_run(killed, *common), killed / "tiny_cpu", 3)
    first = _metrics(killed / "tiny_cpu")
    assert 3 <= len(first) < 6, f"killed run logged {len(first)} steps"
    base = killed / "tiny_cpu/checkpoints/lora_base/actor"  # a LoRA run's base copy
    inodes = {"after the kill": base.stat().st_ino if base.exists() else None}

    result = _train(killed, *common)  # auto-resumes from the newest checkpoint
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    want = {r["step"]: r for r in _metrics(straight / "tiny_cpu")}
    # Steps after the kill were logged twice (before and after the resume); the last
    # record of each step is the resumed run's.
    got = {r["step"]: r for r in _metrics(killed / "tiny_cpu")}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        for key in (
            "reward/mean",
            "rollout/prompt_length_mean",  # the same prompts (data order)
            "rollout/response_length_mean",  # the same samples
            "actor/loss",
            "actor/grad_norm",  # the same weights and optimizer state going in
            "actor/pg_clipfrac",
        ):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-7), (
                f"step {step} {key}: resumed {got[step][key]} vs uninterrupted {want[step][key]}"
            )
    # The final checkpoints hold the same weights and optimizer state, byte for byte.
    final = "tiny_cpu/checkpoints/step_00000006/actor"
    files = sorted(p.name for p in (straight / final).glob("*.distcp"))
    assert len(files) == 4  # one per rank
    for name in files:
        a, b = (straight / final / name).read_bytes(), (killed / final / name).read_bytes()
        assert a == b, (
            f"final actor state differs after the resume: {_where(a, b, straight / final / name)}"
        )
    inodes["after the resume"] = base.stat().st_ino if base.exists() else None
    return inodes


def _where(a: bytes, b: bytes, path: Path) -> str:
    """The first differing byte of two same-named checkpoint files, with the dist-checkpoint
    item it lies in (the index names each item's offset), so a failure says what differs."""
    if len(a) != len(b):
        return f"{path.name}: {len(a)} vs {len(b)} bytes"
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    count = sum(x != y for x, y in zip(a, b))
    items = read_metadata(path.parent).storage_data.items()
    item = next(
        (f"{index.fqn} @{index.offset}, byte {first - info.offset} of {info.length}"
         for index, info in items
         if info.relative_path == path.name and info.offset <= first < info.offset + info.length),
        "no item",
    )  # fmt: skip
    return (
        f"{path.name}: {count} byte(s) differ, first at {first} ({item}): {a[first]} vs {b[first]}"
    )


@pytest.mark.slow
def test_sigterm_saves_and_stops(tmp_path):
    """SIGTERM (what Slurm sends before a job's time runs out) to torchrun: the ranks
    finish the step they are in, save it, and stop; a rerun resumes from there."""
    from tests.e2e.launches import launch_command, sigterm_at_step

    cmd, env = launch_command(
        tmp_path, "trainer.total_steps=1000", "trainer.val_interval=0", "checkpoint.save_interval=0"
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    sigterm_at_step(proc, 2)
    steps = [r["step"] for r in _metrics(tmp_path / "tiny_cpu")]
    assert 2 <= steps[-1] < 1000 and steps == list(range(1, steps[-1] + 1))
    saved = sorted(p.name for p in (tmp_path / "tiny_cpu" / "checkpoints").iterdir())
    assert saved == [f"step_{steps[-1]:08d}"], saved  # the step it stopped after, complete
    assert (tmp_path / "tiny_cpu" / "checkpoints" / saved[0] / "trainer_state.json").is_file()


# ------------------------------------------------------------------- bad input

ONE_RANK = ["parallel.tp=1", "rollout.tp=1", "trainer.total_steps=2", "trainer.val_interval=0"]


def _one_rank(tmp_path: Path, *overrides: str):
    args = ["--config", TINY, f"trainer.output_dir={tmp_path}", *ONE_RANK, *overrides]
    return _run(args, timeout=300)


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_empty_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = _one_error_line(
        _one_rank(tmp_path, "data.synthetic_task=null", f"data.train_files=[{empty}]")
    )
    assert line == f"error: data.train_files: no records in {empty}"


def test_missing_reward_field(tmp_path):
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1 2 =", "answer": "2"}, {"prompt": "3"}])
    line = _one_error_line(
        _one_rank(tmp_path, "data.synthetic_task=null", f"data.train_files=[{data}]")
    )
    assert f"{data}:2" in line and "'answer'" in line


def test_all_prompts_too_long(tmp_path):
    line = _one_error_line(
        _one_rank(tmp_path, "rollout.max_prompt_length=4", "rollout.prompt_overflow=filter")
    )
    assert "all 2048 prompts are longer than rollout.max_prompt_length=4 tokens" in line


REWARDS = """
import sys

def always_raises(response, sample):
    raise KeyError("score_me")

CALLS = 0

def exits_after_step_1(response, sample):
    global CALLS
    CALLS += 1
    if CALLS > 64:  # one step on one rank: 16 prompts x 4 samples
        sys.exit(1)
    return 1.0

def raises_on_odd_answers(response, sample):
    if int(sample["answer"]) % 2:
        raise ValueError("odd answers are not scored")
    return 1.0
"""


def test_raising_reward_function(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text(REWARDS)
    # on_error=raise: the run stops at the first failure, naming the sample.
    line = _one_error_line(
        _one_rank(
            tmp_path / "a", f"reward.function={module}:always_raises", "reward.on_error=raise"
        )
    )
    # The function is named as reward.function gives it (file and name).
    assert f"'{module}:always_raises' failed on sample 0 (synthetic:train:" in line
    assert "KeyError: 'score_me'" in line
    # on_error=score: failures are scored and counted...
    result = _one_rank(tmp_path / "b", f"reward.function={module}:raises_on_odd_answers")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "b" / "tiny_cpu")
    assert all(0 < r["reward/errors"] < 64 for r in rows), [r["reward/errors"] for r in rows]
    assert f"samples failed in '{module}:raises_on_odd_answers'" in result.stdout  # the log
    # ...but a function that fails on every sample stops the run instead of training on it,
    # naming the step as the console does. `sys.exit` in it is such a failure, not an exit.
    # (The run also truncates prompts at load, counted in every step's metrics.)
    result = _one_rank(
        tmp_path / "c",
        f"reward.function={module}:exits_after_step_1",
        "rollout.max_prompt_length=7",
        "rollout.prompt_overflow=truncate_left",
    )
    line = _one_error_line(result)
    assert "step 1/2 |" in result.stdout
    assert "exits_after_step_1' failed on every sample of step 2 (64 samples)" in line
    (row,) = _metrics(tmp_path / "c" / "tiny_cpu")
    # digit_echo prompts are 3-6 digits and spaces, one token per character.
    config = load_config(ROOT / TINY)
    prompts = synthetic_dataset("digit_echo", config.data.synthetic_size, config.trainer.seed)
    truncated = sum(len(p["prompt"]) > 7 for p in prompts.samples)
    assert row["rollout/prompts_truncated"] == truncated > 0


def test_reward_improves_with_context_parallelism(tmp_path):
    """GRPO at parallel.cp=2 (TP1·CP2·DP1 on 2 ranks, ~30 s): the roles train on half of
    each sequence per rank, the Megatron engine generates whole rows on each CP rank."""
    result = _train(
        tmp_path,
        "parallel.tp=1",
        "rollout.tp=1",
        "parallel.cp=2",
        "trainer.total_steps=20",
        "trainer.val_interval=0",
        "checkpoint.save_interval=0",
        ranks=2,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cp=2" in result.stdout
    rows = _metrics(tmp_path / "tiny_cpu")
    gain = _improvement(rows)
    assert gain > MIN_IMPROVEMENT, f"cp=2: reward improved by {gain:.3f} only"
    # The engine (whole rows, no CP) and the trainer (CP-split forward) agree.
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3


def test_reward_improves_moe_with_expert_parallelism(tmp_path):
    """GRPO on the tiny Qwen3-MoE (`tiny_moe_cpu.yaml`) at parallel.ep=2, TP1·DP4 on 4 ranks
    (~35 s): each pair of replicas splits the experts, so the Megatron engine's ranks, which
    decode different prompts, agree on every forward (evaluation included). With routing
    replay: the engine records each token's experts (not in the forwards that only join
    the expert group's lockstep) and the actor replays them."""
    args = [
        "--config",
        "yaml_configs/tiny_moe_cpu.yaml",
        f"trainer.output_dir={tmp_path}",
        "parallel.ep=2",
        "actor.micro_batch_size=8",  # mini-batch 32 over dp=4
        "trainer.total_steps=20",
        "trainer.val_interval=10",
        "checkpoint.save_interval=0",
        "actor.router_replay=true",
    ]
    result = _run(args, torchrun_ranks=4, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # The engine's MoE layers hold half of the 4 experts: EP was used, not only validated.
    assert "2 of 4 experts per rank, an expert group of 2 ranks" in result.stdout
    rows = _metrics(tmp_path / "tiny_moe_cpu")
    assert [r["step"] for r in rows] == list(range(1, 21))
    # The engine's routing is the actor's own: before the replay, the routers choose as the
    # engine recorded on all but near-ties (fp32 noise of another token grouping; a step
    # has ~3k recorded (token, layer) pairs); a token or layer off by one differs on many.
    mismatch = [r["rollout/routing_mismatch_frac"] for r in rows]
    assert max(mismatch) < 1e-3, mismatch
    gain = _improvement(rows)
    assert gain > MIN_IMPROVEMENT, f"ep=2: reward improved by {gain:.3f} only"
    # Same policy in the engine and in the trainer's (EP-split) forward (and routing).
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    assert rows[9]["val/num_prompts"] == 32 and "val/reward_mean" in rows[-1]
    # Each step's record carries its own evaluation's and checkpoint's times, the last
    # step's included (issue 36).
    assert [r["step"] for r in rows if "timing_s/evaluate" in r] == [10, 20]
    assert [r["step"] for r in rows if "timing_s/checkpoint" in r] == [20]
