"""`trainer.mode: colocated_async` end to end (tiny_cpu.yaml, 4 gloo ranks, TP=2 x DP=2):
staleness 0 without partial rollouts is the synchronous loop; with partial rollouts every
trained token is within the staleness bound, partial trajectories are trained, and every
record of the data is trained at most once, also across a kill and a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.launches import kill_after_checkpoint, start_run
from tests.e2e.test_training import _metrics, _train

# Both loops with the same off-policy correction (the asynchronous default).
CORRECTION = ["algorithm.rollout_correction.level=token"]
PARTIAL = [
    "trainer.mode=colocated_async",
    "rollout.max_response_length=8",
    "rollout.partial.chunk_tokens=2",
    "rollout.partial.in_flight_batches=2",
]


def _records(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


@pytest.mark.slow
def test_staleness_zero_without_partial_rollouts_is_the_synchronous_loop(tmp_path):
    common = ["trainer.total_steps=2", "trainer.val_interval=0", "checkpoint.save_interval=2"]
    common += CORRECTION
    sync = _train(tmp_path / "sync", *common)
    assert sync.returncode == 0, sync.stderr[-3000:]
    asynchronous = _train(
        tmp_path / "async",
        *common,
        "trainer.mode=colocated_async",
        "rollout.max_staleness=0",
        "rollout.partial.enable=false",
    )
    assert asynchronous.returncode == 0, asynchronous.stderr[-3000:]
    want, got = _metrics(tmp_path / "sync" / "tiny_cpu"), _metrics(tmp_path / "async" / "tiny_cpu")
    for a, b in zip(want, got, strict=True):
        for key in (
            "reward/mean",
            "rollout/prompt_length_mean",
            "rollout/response_length_mean",
            "rollout/logprob_diff_max",
            "actor/loss",
            "actor/grad_norm",
            "actor/pg_clipfrac",
        ):
            assert b[key] == a[key], f"step {a['step']} {key}: async {b[key]} vs sync {a[key]}"
        assert b["async/staleness_max"] == 0.0 and b["async/partial_fraction"] == 0.0
        # Every token generated was trained: the response tokens of the step's rows.
        trained = a["rollout/num_samples"] * a["rollout/response_length_mean"]
        assert b["async/generated_tokens"] == pytest.approx(trained)
    final = "tiny_cpu/checkpoints/step_00000002/actor"
    files = sorted(p.name for p in (tmp_path / "sync" / final).glob("*.distcp"))
    assert len(files) == 4
    for name in files:
        a = (tmp_path / "sync" / final / name).read_bytes()
        assert a == (tmp_path / "async" / final / name).read_bytes(), f"{name} differs"


@pytest.mark.slow
def test_partial_rollouts_stay_within_the_bound_and_resume_loses_no_record(tmp_path):
    """Staleness 1, chunks of 2 tokens, two batches in flight: 6 steps straight vs killed
    after step 3's checkpoint and resumed. Every trained token is at most one version old;
    some trajectories span two versions; no data record is trained twice; the resumed run
    trains exactly the uninterrupted run's records and tokens at steps 4-6."""
    common = [*PARTIAL, "rollout.max_staleness=1", "trainer.total_steps=6"]
    common += ["trainer.val_interval=0", "checkpoint.save_interval=3", "trainer.dump_rollouts=true"]
    straight = tmp_path / "straight"
    result = _train(straight, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(straight / "tiny_cpu")
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert max(r["async/partial_fraction"] for r in rows) > 0, "no trajectory was partial"
    records = _records(straight / "tiny_cpu")
    for record in records:
        step_version = record["step"] - 1  # the weights that step trained
        versions = record["token_versions"]
        assert len(versions) == len(record["response_ids"])
        assert all(step_version - 1 <= v <= step_version for v in versions), record
        assert versions == sorted(versions)
    # A group is its record's n samples, trained once: (record, sample) pairs are unique.
    per_record: dict[int, int] = {}
    for record in records:
        per_record[record["data_record"]] = per_record.get(record["data_record"], 0) + 1
    assert set(per_record.values()) == {4}, "a record was trained twice or split"

    killed = tmp_path / "killed"
    kill_after_checkpoint(start_run(killed, *common), killed / "tiny_cpu", 3)
    result = _train(killed, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout

    # Steps 4-6 of the resumed run: the same records, the same tokens, the same versions.
    def by_step(run):
        out: dict[int, list] = {}
        for r in _records(run / "tiny_cpu"):
            out.setdefault(r["step"], []).append(
                (r["dp_rank"], r["data_record"], r["response_ids"], r["token_versions"])
            )
        return out

    want, got = by_step(straight), by_step(killed)
    for step in (4, 5, 6):
        assert got[step] == want[step], f"step {step}: the resumed run trained other rows"
