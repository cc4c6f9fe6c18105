"""Checkpoint and resume of a `trainer.mode: colocated_async` run lose no record and repeat
none (issue 39), whatever the moment of a kill -9.

The run: tiny_cpu.yaml (4 gloo ranks, TP=2 x DP=2, 16 records a step, 8 per replica),
staleness 1, chunks of 2 tokens, 3 local batches in flight, a dataset of 96 records (6
steps' worth: the first epoch's last records are drawn at step 4 and trained at steps 5-6,
while epoch 1 is being drawn), a checkpoint every 2 steps, 8 steps.

* Every record of epoch 0 is, at every checkpoint, exactly one of: trained (the rollout
  records of the steps up to it), in flight (the checkpoint's buffer, with its tokens),
  or not drawn yet (after the checkpoint's data position). The expected draws are
  computed here from the sampler's documented order (`np.random.default_rng([seed, epoch])`
  permutation, contiguous DP slices of each global batch), not through the sampler.
* One run killed with SIGKILL (whole process group) three times, each attempt resumed by
  the next (auto-resume): during the save of step 4 (its `.tmp-` directory exists: the
  resume takes step 2's checkpoint), during the generation of step 5 (after step 4's
  checkpoint, at the epoch boundary) and during the update of step 7 (its rollout records
  written). Every step each attempt trained after its resume has the uninterrupted run's
  rows (replica, record, tokens, versions); the final buffer holds the same records and
  tokens (log-probs to 1e-5, see the test), and the counting above holds over the resumed
  run too.

Broken on purpose once, each fails: a load that drops the buffer's groups (rows differ at
the first step after a resume; the counting finds 16 records per replica drawn and never
trained, a third of the epoch, the peers' bug), a replica loading replica 0's state, a
data cursor rewound to the records trained (the counting refuses checkpoint 4's position
at once; rows differ from step 5), a group trained twice or a record lost per draw in a
straight run (the counting test).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rl_megatron.config import load_config
from tests.e2e.launches import kill_when, start_run
from tests.e2e.test_launcher import ROOT, TINY
from tests.e2e.test_training import _metrics, _train

RECORDS, STEPS, EVERY = 96, 8, 2
RUN = [
    "trainer.mode=colocated_async",
    "rollout.max_staleness=1",
    "rollout.partial.chunk_tokens=2",
    "rollout.partial.in_flight_batches=3",
    f"data.synthetic_size={RECORDS}",
    f"trainer.total_steps={STEPS}",
    f"checkpoint.save_interval={EVERY}",
    f"checkpoint.keep_last={STEPS // EVERY}",  # every checkpoint stays, to be counted
    "trainer.dump_rollouts=true",
    "trainer.val_interval=0",
]
CONFIG = load_config(ROOT / TINY, RUN)
BATCH, N = CONFIG.data.train_batch_size, CONFIG.rollout.n
DP = 2  # tiny_cpu: 4 ranks at TP=2
LOCAL = BATCH // DP
PER_EPOCH = RECORDS // BATCH  # global batches per epoch (96 = 6 x 16: nothing dropped)


# ----------------------------------------------------------------------------- reading a run


def _rows(run: Path) -> dict[int, list[tuple]]:
    """step -> the rows trained at that step: (dp_rank, data_record, response_ids,
    token_versions), in the order the records file holds them."""
    out: dict[int, list[tuple]] = {}
    for path in sorted((run / "tiny_cpu" / "rollouts").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            row = (r["dp_rank"], r["data_record"], r["response_ids"], r["token_versions"])
            out.setdefault(r["step"], []).append(row)
    return out


def _trained_groups(run: Path, up_to: int) -> dict[int, list[int]]:
    """replica -> the records its groups trained at steps 1..up_to, in step order; each
    group is n rows of one record."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for step in range(1, up_to + 1):
        path = run / "tiny_cpu" / "rollouts" / f"step_{step:08d}.jsonl"
        for line in path.read_text().splitlines():
            r = json.loads(line)
            groups.setdefault((step, r["dp_rank"], r["group"]), []).append(r["data_record"])
    out: dict[int, list[int]] = {r: [] for r in range(DP)}
    for (step, replica, group), records in sorted(groups.items()):
        assert len(records) == N and len(set(records)) == 1, (step, replica, group, records)
        out[replica].append(records[0])
    for replica, records in out.items():
        assert len(records) == up_to * LOCAL, f"replica {replica}: {len(records)} groups"
    return out


def _async_state(run: Path, step: int) -> list[dict]:
    """Each replica's {"sampler", "buffer"} as checkpoint `step` holds it."""
    meta = run / "tiny_cpu" / "checkpoints" / f"step_{step:08d}" / "trainer_state.json"
    return json.loads(meta.read_text())["trainer_state"]["async_rollouts"]["replicas"]


def _expected_draws(replica: int, draws: int) -> list[list[tuple[int, int]]]:
    """The replica's first `draws` local batches as (epoch, record): epoch e visits the
    data in the permutation drawn from (seed, e); replica r takes the r-th slice of
    `LOCAL` records of each global batch of `BATCH` (data/sampler.py's docstring)."""
    out = []
    for d in range(draws):
        epoch, b = divmod(d, PER_EPOCH)
        order = np.random.default_rng([CONFIG.trainer.seed, epoch]).permutation(RECORDS)
        start = b * BATCH + replica * LOCAL
        out.append([(epoch, int(x)) for x in order[start : start + LOCAL]])
    return out


def _account(run: Path, step: int) -> dict[str, int]:
    """Checks that checkpoint `step` and the rollout records of steps 1..step account for
    every record drawn exactly once, and that every record of epoch 0 is trained, in
    flight or not drawn yet, exactly once. Returns epoch 0's counts per status."""
    trained = _trained_groups(run, step)
    epoch0: dict[int, str] = {}
    for replica, state in enumerate(_async_state(run, step)):
        draws = state["buffer"]["draws"]
        assert draws >= 1
        # The data position is the end of the batches drawn, whatever is in flight.
        epoch, batches = divmod(draws, PER_EPOCH)
        want = {"epoch": epoch, "position": batches * BATCH, "num_samples": RECORDS}
        assert state["sampler"] == want, f"step {step} replica {replica}: {state['sampler']}"
        # Slots of the local batches drawn (and of the epoch begun), each to be accounted.
        slots = _expected_draws(replica, max(draws, PER_EPOCH * (epoch + 1)))
        status: dict[tuple[int, int], str] = {}
        for group in state["buffer"]["groups"]:
            d, i = divmod(group["order"], LOCAL)  # orders count the groups drawn
            assert d < draws and slots[d][i][1] == group["record"], (
                f"step {step} replica {replica}: record {group['record']} in flight as the "
                f"{i}-th of local batch {d} ({draws} drawn), which holds {slots[d][i][1]}"
            )
            finished = all(s["finish_reason"] is not None for s in group["samples"])
            started = any(s["tokens"] for s in group["samples"])
            assert (d, i) not in status
            status[d, i] = "finished" if finished else "partial" if started else "not started"
        for record in trained[replica]:  # the earliest drawn slot of that record left
            free = [
                (d, i)
                for d in range(draws)
                for i in range(LOCAL)
                if slots[d][i][1] == record and (d, i) not in status
            ]
            assert free, f"step {step} replica {replica}: record {record} trained twice"
            status[free[0]] = "trained"
        skipped = [slots[d][i] for d in range(draws) for i in range(LOCAL) if (d, i) not in status]
        assert not skipped, f"step {step} replica {replica}: drawn, never trained: {skipped}"
        for d in range(draws, len(slots)):
            for i in range(LOCAL):
                status[d, i] = "not drawn"
        for (d, i), what in status.items():
            epoch_of, record = slots[d][i]
            if epoch_of == 0:
                assert record not in epoch0, f"record {record} drawn twice in epoch 0"
                epoch0[record] = what
    assert sorted(epoch0) == list(range(RECORDS)), "epoch 0 is not every record once"
    return dict(Counter(epoch0.values()))


# ----------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight")
    result = _train(run, *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.mark.slow
def test_every_record_of_an_epoch_is_counted_once_at_every_checkpoint(straight):
    counts = {step: _account(straight, step) for step in range(EVERY, STEPS + 1, EVERY)}
    # Each step trains a local batch per replica and draws one (three at step 1): at step 2
    # half of the records in flight have finished and wait, half are partial trajectories.
    assert counts[2] == {"trained": 32, "finished": 16, "partial": 16, "not drawn": 32}
    # Step 4 drew epoch 0's last batch: its last 32 records are in flight, with tokens.
    assert counts[4] == {"trained": 64, "finished": 16, "partial": 16}
    assert counts[6] == counts[8] == {"trained": RECORDS}  # then epoch 1's records only
    # The async/draws metric (summed over replicas) tells the same count of batches.
    drawn = sum(r["async/draws"] for r in _metrics(straight / "tiny_cpu"))
    assert drawn == sum(s["buffer"]["draws"] for s in _async_state(straight, STEPS))


def _last_step(run: Path) -> int:
    path = run / "tiny_cpu" / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines only
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.mark.slow
def test_kills_during_save_generation_and_update_resume_the_same_rows(straight, tmp_path):
    run, checkpoints = tmp_path / "killed", tmp_path / "killed" / "tiny_cpu" / "checkpoints"
    records = run / "tiny_cpu" / "rollouts"
    want = _rows(straight)
    # Step 5 starts with its generation (the Megatron engine's weight sync is a version
    # stamp): a third of the way into the uninterrupted run's is well inside it.
    generating = 0.3 * _metrics(straight / "tiny_cpu")[4]["timing_s/generate"]
    moments = [
        # (what, when to kill, how long after, the checkpoint the attempt resumes from)
        ("the save of step 4", lambda: any(checkpoints.glob("step_00000004.tmp-*")), 0, None),
        ("step 4's record", lambda: _last_step(run) == 4, generating, 2),
        ("step 7's rollout records", lambda: (records / "step_00000007.jsonl").exists(), 0, 4),
        ("the end", None, 0, 6),
    ]
    for attempt, (what, moment, delay, resumes_from) in enumerate(moments):
        log = tmp_path / f"attempt_{attempt}.log"
        proc = start_run(run, *RUN, log=log)
        if moment is None:
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        else:
            kill_when(proc, moment, what, delay)
        out = log.read_text()
        if resumes_from is None:
            assert "resumed from" not in out
        else:
            assert f"step_{resumes_from:08d} at step {resumes_from}" in out, out[-3000:]
        # Every step this attempt wrote after its resume has the uninterrupted run's rows.
        got = _rows(run)
        for step in range(1 + (resumes_from or 0), STEPS + 1):
            if step in got:
                assert got[step] == want[step], f"attempt {attempt}: step {step} differs"
        # The kill landed where it was meant to.
        if attempt == 0:
            assert not (checkpoints / "step_00000004").exists(), "killed after the commit"
            assert any(checkpoints.glob("step_00000004.tmp-*"))
        elif attempt == 1:
            assert _last_step(run) == 4 and not (records / "step_00000005.jsonl").exists()
        elif attempt == 2:
            assert _last_step(run) == 6 and not (checkpoints / "step_00000008").exists()
    assert sorted(got) == list(range(1, STEPS + 1))
    assert not list(checkpoints.glob("*.tmp-*"))  # the interrupted save's leftovers went
    # The same records in flight, with the same tokens, and the same data position. Not
    # the same log-probs to the bit: the Megatron engine pads a batch into the widest kept
    # decode session of its shape (`DecodeSessions.width`), which a fresh process lacks,
    # so a resumed run's log-probs differ in the last bits (and so do the final weights).
    got, want_state = _async_state(run, STEPS), _async_state(straight, STEPS)
    for state in want_state:
        for group in state["buffer"]["groups"]:
            for sample in group["samples"]:
                sample["log_probs"] = pytest.approx(sample["log_probs"], abs=1e-5)
    assert got == want_state
    for step in range(EVERY, STEPS + 1, EVERY):
        assert _account(run, step) == _account(straight, step), step
