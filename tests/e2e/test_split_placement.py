"""`trainer.mode: split_async` end to end (tiny_cpu.yaml, 4 gloo ranks: 2 train at TP=1 x
DP=2, 2 generate with the Megatron engine at TP 1, one generation replica per training
replica): with staleness 0 it is the synchronous loop on 2 ranks, bit for bit; with
staleness 2 every batch is exactly as old as the schedule says; a run killed during a save
and during an update resumes with every record of the epoch trained exactly once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.launches import kill_when, start_run
from tests.e2e.test_training import _metrics, _train

TRAINING = ["parallel.tp=1", "rollout.tp=1", "trainer.val_interval=0"]
SPLIT = [*TRAINING, "trainer.mode=split_async", "placement.rollout_ranks=2"]


def _rows(run: Path) -> dict[int, list[tuple]]:
    """step -> (dp_rank, data_record, token_versions) of every row trained at that step."""
    out: dict[int, list[tuple]] = {}
    for path in sorted((run / "tiny_cpu" / "rollouts").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["step"], []).append(
                (r["dp_rank"], r["data_record"], r["token_versions"])
            )
    return out


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_loop_on_the_training_ranks(tmp_path):
    common = ["trainer.total_steps=3", "checkpoint.save_interval=3"]
    common += ["algorithm.rollout_correction.level=token"]
    sync = _train(tmp_path / "sync", *TRAINING, *common, ranks=2)
    assert sync.returncode == 0, sync.stderr[-3000:]
    split = _train(tmp_path / "split", *SPLIT, *common, "rollout.max_staleness=0")
    assert split.returncode == 0, split.stderr[-3000:]
    want, got = _metrics(tmp_path / "sync" / "tiny_cpu"), _metrics(tmp_path / "split" / "tiny_cpu")
    assert len(want) == len(got) == 3
    for a, b in zip(want, got, strict=True):
        for key in (
            "reward/mean",
            "rollout/response_length_mean",
            "rollout/logprob_diff_max",  # the generation ranks' log-probs, the trainer's
            "actor/loss",
            "actor/grad_norm",
            "actor/pg_clipfrac",
        ):
            assert b[key] == a[key], f"step {a['step']} {key}: split {b[key]} vs sync {a[key]}"
        assert b["async/staleness_max"] == 0.0
        trained = a["rollout/num_samples"] * a["rollout/response_length_mean"]
        assert b["async/generated_tokens"] == pytest.approx(trained)
        assert b["split/generate_s"] > 0 and b["split/generate_tokens_per_s"] > 0
        assert b["reshard/sent_gb"] > 0  # the weights crossed to the generation ranks
    final = "tiny_cpu/checkpoints/step_00000003/actor"
    files = sorted(p.name for p in (tmp_path / "sync" / final).glob("*.distcp"))
    assert len(files) == 2
    for name in files:
        a = (tmp_path / "sync" / final / name).read_bytes()
        assert a == (tmp_path / "split" / final / name).read_bytes(), f"{name} differs"


@pytest.mark.slow
def test_staleness_two_trains_each_batch_exactly_as_old_as_the_schedule_says(tmp_path):
    steps = 5
    run = _train(
        tmp_path,
        *SPLIT,
        "rollout.max_staleness=2",
        f"trainer.total_steps={steps}",
        "checkpoint.save_interval=0",
        "trainer.dump_rollouts=true",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _metrics(tmp_path / "tiny_cpu")
    # Step k (from 0) trains batch k, generated with version max(0, k - 2).
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert [r["async/staleness_mean"] for r in rows] == [0, 1, 2, 2, 2]
    trained = _rows(tmp_path)
    assert sorted(trained) == list(range(1, steps + 1))
    per_record = Counter()
    for step, step_rows in trained.items():
        version = max(0, step - 1 - 2)
        for dp_rank, record, versions in step_rows:
            assert set(versions) == {version}, (step, dp_rank, record)
            per_record[record] += 1
    assert set(per_record.values()) == {4}  # n samples, one step: no record twice


def _last_step(run: Path) -> int:
    path = run / "tiny_cpu" / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.mark.slow
def test_kills_during_a_save_and_an_update_lose_and_repeat_no_record(tmp_path):
    """64 records (4 steps an epoch), staleness 1, a checkpoint every 2 steps, 6 steps: one
    run killed with SIGKILL during the save of step 4 (resumes from 2) and during the
    update of step 5 (resumes from 4), then run to the end. Each step trains the
    uninterrupted run's records, and epoch 0's 64 records are trained once each."""
    run_args = [
        *SPLIT,
        "rollout.max_staleness=1",
        "data.synthetic_size=64",
        "trainer.total_steps=6",
        "checkpoint.save_interval=2",
        "trainer.dump_rollouts=true",
    ]
    straight = tmp_path / "straight"
    result = _train(straight, *run_args)
    assert result.returncode == 0, result.stderr[-3000:]
    want = _rows(straight)

    killed = tmp_path / "killed"
    checkpoints, records = killed / "tiny_cpu" / "checkpoints", killed / "tiny_cpu" / "rollouts"
    moments = [
        ("the save of step 4", lambda: any(checkpoints.glob("step_00000004.tmp-*")), None),
        ("step 5's update", lambda: (records / "step_00000005.jsonl").exists(), 2),
        ("the end", None, 4),
    ]
    for attempt, (what, moment, resumes_from) in enumerate(moments):
        log = tmp_path / f"attempt_{attempt}.log"
        proc = start_run(killed, *run_args, log=log)
        if moment is None:
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        else:
            kill_when(proc, moment, what)
        out = log.read_text()
        if resumes_from is None:
            assert "resumed from" not in out
        else:
            assert f"step_{resumes_from:08d} at step {resumes_from}" in out, out[-3000:]
        if attempt == 0:
            assert not (checkpoints / "step_00000004").exists(), "killed after the commit"
    # Launched again at its end: both sides see there is nothing left and exit.
    again = _train(killed, *run_args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_00000006 at step 6" in again.stdout + again.stderr
    got = _rows(killed)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        # The same records on the same replicas (tokens differ after a resume: its first
        # batches are generated with the resumed weights, fresher than the straight run's).
        assert sorted(r[:2] for r in got[step]) == sorted(r[:2] for r in want[step]), step
    epoch0 = Counter(record for step in range(1, 5) for _, record, _ in got[step])
    assert sorted(epoch0) == list(range(64)) and set(epoch0.values()) == {4}


@pytest.mark.slow
def test_the_demo_task_learns_with_staleness_two(tmp_path):
    """The CPU demo (40 steps, as tests/e2e/test_training.py's), generated two versions
    behind from the third step on: the reward climbs by the same bound."""
    from tests.e2e.test_training import MIN_IMPROVEMENT, _improvement

    run = _train(
        tmp_path,
        *SPLIT,
        "rollout.max_staleness=2",
        "trainer.total_steps=40",
        "checkpoint.save_interval=0",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _metrics(tmp_path / "tiny_cpu")
    assert max(r["async/staleness_max"] for r in rows) == 2
    gain = _improvement(rows)
    assert gain > MIN_IMPROVEMENT, f"reward improved by {gain:.3f} only"


@pytest.mark.slow
def test_the_split_benchmark_caps_both_sides_alike(tmp_path):
    """benchmarks/split_ab.py's CPU smoke run: one round (a split launch, a sync launch);
    the length sampler caps the generation ranks' samples as it caps the co-located
    engine's, so both sides train the same response lengths (tokens differ: the split
    side's second batch is one version behind), and the ratio is the rates' ratio."""
    import subprocess
    import sys

    from tests.e2e.test_launcher import ROOT

    out = tmp_path / "split_ab.json"
    cmd = [sys.executable, "benchmarks/split_ab.py", "--config", "yaml_configs/tiny_cpu.yaml"]
    cmd += ["--gpus", "4", "--rounds", "1", "--warmup-steps", "1", "--steps", "2"]
    cmd += ["--out-json", str(out), "parallel.tp=1", "rollout.tp=1", "actor.micro_batch_size=8"]
    cmd += ["rollout.max_response_length=32"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (record,) = result["rounds"]
    split, sync = record["split"], record["sync"]
    assert [s["rollout/response_length_mean"] for s in split["steps"]] == [
        s["rollout/response_length_mean"] for s in sync["steps"]
    ]
    assert max(s["rollout/response_length_mean"] for s in split["steps"]) < 32  # capped
    assert split["gpus"] == sync["gpus"] == 4
    rate = split["trained_tokens"] / split["seconds"] / 4
    assert split["tokens_per_s_per_gpu"] == pytest.approx(rate)
    assert record["ratio"] == pytest.approx(rate / sync["tokens_per_s_per_gpu"])
    assert result["targets"][0]["ratio_median"] == pytest.approx(record["ratio"])


@pytest.mark.slow
def test_sigterm_stops_both_sides_and_the_run_resumes(tmp_path):
    """SIGTERM to torchrun: the training ranks finish their step, save it, drain what the
    generation ranks sent meanwhile and send them a stop; every rank exits (none waits
    for a partner that left) and a rerun resumes from the saved step to the end."""
    import subprocess

    from tests.e2e.launches import launch_command, sigterm_at_step
    from tests.e2e.test_launcher import ROOT

    run_args = [*SPLIT, "rollout.max_staleness=1", "checkpoint.save_interval=0"]
    cmd, env = launch_command(tmp_path, *run_args)
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*cmd, "trainer.total_steps=1000"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        sigterm_at_step(proc, 2)
    # torchrun gives its ranks 30 s after passing SIGTERM on, then kills the ones left:
    # nobody had to be killed, and no generation rank failed on a training rank that left
    # while it waited (gloo: "Connection closed by peer").
    console = log.read_text()
    assert "closing signal SIGTERM" in console, console[-3000:]
    assert "SIGKILL" not in console, console[-3000:]
    # (torchrun's own traceback of the signal it got is expected: not a rank's.)
    assert "] failed:" not in console and "Connection closed" not in console, console[-3000:]
    steps = [r["step"] for r in _metrics(tmp_path / "tiny_cpu")]
    last = steps[-1]
    assert 2 <= last < 1000 and steps == list(range(1, last + 1))
    saved = sorted(p.name for p in (tmp_path / "tiny_cpu" / "checkpoints").iterdir())
    assert saved == [f"step_{last:08d}"], saved
    rerun = subprocess.run(
        [*cmd, f"trainer.total_steps={last + 2}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"step_{last:08d} at step {last}" in rerun.stdout + rerun.stderr
    rows = _metrics(tmp_path / "tiny_cpu")
    assert [r["step"] for r in rows][-2:] == [last + 1, last + 2]
