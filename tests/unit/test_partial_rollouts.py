"""trainer/partial_rollouts.py with a scripted engine: staleness bound, partial samples kept
exactly across a weight update, every record accounted for, resume from its state."""

from __future__ import annotations

import json
import random

import pytest

from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.trainer.partial_rollouts import (
    PartialRollouts,
    continuation_seed,
    staleness_metrics,
)

N, MAX_NEW, LOCAL, STOP = 2, 12, 4, 1


class ScriptedEngine:
    """Sample k of a record decodes a fixed script: `length[record, k]` tokens, the last
    one the stop token, the others `10 + position`; a call returns at most its budget of
    what is left. The lengths are adversarial: drawn so that some samples finish at once,
    some run to MAX_NEW, in an order unrelated to the draw order. Records every call."""

    def __init__(self, seed=0, version=0):
        self.version, self.calls = version, []
        self.rng = random.Random(seed)
        self.lengths: dict[int, int] = {}

    def script(self, record):
        if record not in self.lengths:
            self.lengths[record] = self.rng.choice([1, 2, 3, 7, MAX_NEW, MAX_NEW + 5])
        return self.lengths[record]

    def generate(self, prompts, max_new, seeds):
        self.calls.append((len(prompts), max_new, list(seeds)))
        responses, reasons = [], []
        for prompt in prompts:
            done = len(prompt) - 1  # the prompt is [1000 + record], then the tokens so far
            left = self.script(prompt[0]) - done
            if left <= max_new:
                responses.append([10 + done + i for i in range(left - 1)] + [STOP])
                reasons.append("stop")
            else:
                responses.append([10 + done + i for i in range(max_new)])
                reasons.append("length")
        return RolloutBatch.from_sequences(
            prompts=prompts,
            responses=responses,
            log_probs=[[-0.25 * (t % 7) for t in r] for r in responses],
            finish_reasons=reasons,
            pad_token_id=0,
            weight_version=self.version,
        )


def make_draw(log):
    def draw(d):
        records = list(range(d * LOCAL, (d + 1) * LOCAL))
        log.extend(records)
        return records, [[1000 + r] for r in records], 100 + d * LOCAL * N

    return draw


def buffer_of(chunk=4, extra_batches=1, staleness=1, on_stale="restart"):
    return PartialRollouts(N, MAX_NEW, chunk, extra_batches * LOCAL, staleness, on_stale)


def test_staleness_never_exceeds_the_bound_and_every_record_is_accounted_for():
    for staleness in (0, 1, 2):
        for on_stale in ("restart", "drop"):
            engine, drawn, trained = ScriptedEngine(seed=staleness), [], []
            buffer = buffer_of(chunk=3, extra_batches=2, staleness=staleness, on_stale=on_stale)
            dropped = 0
            for step in range(12):
                engine.version = step
                phase = buffer.phase(step, LOCAL, make_draw(drawn), engine.generate)
                dropped += phase.metrics["async/dropped"]
                assert len(phase.groups) == LOCAL
                for group in phase.groups:
                    assert group.finished
                    for sample in group.samples:
                        assert sample.versions, "a finished sample has its tokens"
                        assert step - min(sample.versions) <= staleness
                        assert sample.versions == sorted(sample.versions)
                        assert_is_the_script(engine, group.record, sample)
                trained += [g.record for g in phase.groups]
            in_flight = [g.record for g in buffer.groups]
            # Drawn once each; trained, in flight or dropped: nothing lost, nothing twice.
            assert len(set(drawn)) == len(drawn)
            assert len(set(trained)) == len(trained)
            assert sorted(trained + in_flight) == sorted(drawn) or on_stale == "drop"
            assert len(trained) + len(in_flight) + dropped == len(drawn)


def assert_is_the_script(engine, record, sample):
    """A finished sample holds its script whole, however many chunks and phases it took:
    up to its stop token, or MAX_NEW tokens ending at the length limit; a log-prob a token."""
    length = engine.lengths[1000 + record]  # the prompt is [1000 + record]
    if length <= MAX_NEW:
        want, reason = [10 + i for i in range(length - 1)] + [STOP], "stop"
    else:
        want, reason = [10 + i for i in range(MAX_NEW)], "length"
    assert (sample.tokens, sample.finish_reason) == (want, reason), record
    assert sample.log_probs == [-0.25 * (t % 7) for t in want]
    assert len(sample.versions) == len(want)


@pytest.mark.parametrize("chunk", [1, 5, MAX_NEW])
def test_samples_are_their_scripts_whatever_the_chunk(chunk):
    # 5 does not divide MAX_NEW: the last chunk's budget is what is left, not 5.
    engine, drawn = ScriptedEngine(seed=6), []
    buffer = buffer_of(chunk=chunk, extra_batches=1, staleness=MAX_NEW)
    for step in range(4):
        engine.version = step
        phase = buffer.phase(step, LOCAL, make_draw(drawn), engine.generate)
        for group in phase.groups:
            for sample in group.samples:
                assert_is_the_script(engine, group.record, sample)
    assert max(budget for _, budget, _ in engine.calls) == chunk
    assert set(engine.lengths.values()) >= {1, MAX_NEW, MAX_NEW + 5}  # every ending occurs


def test_a_sample_exactly_at_the_bound_is_kept_and_one_past_it_restarted():
    engine, drawn = ScriptedEngine(seed=1), []
    buffer = buffer_of(chunk=2, extra_batches=2, staleness=1)
    buffer.phase(0, LOCAL, make_draw(drawn), engine.generate)
    partial = [s for g in buffer.groups for s in g.samples if s.tokens and not s.finished]
    assert partial
    engine.version = 1
    phase = buffer.phase(1, LOCAL, make_draw(drawn), engine.generate)
    assert phase.metrics["async/restarted"] == 0  # version 0 is 1 behind: within the bound
    still = [s for s in partial if not s.finished and s.versions and s.versions[0] == 0]
    assert all(s.restarts == 0 for s in partial)
    assert still, "some version-0 samples outlive phase 1 (the script has long ones)"
    engine.version = 2
    phase = buffer.phase(2, LOCAL, make_draw(drawn), engine.generate)
    assert phase.metrics["async/restarted"] >= len(still)
    assert all(s.restarts == 1 and 0 not in s.versions for s in still)


def test_a_partial_sample_keeps_its_tokens_and_later_ones_carry_the_new_version():
    engine, drawn = ScriptedEngine(seed=1), []
    buffer = buffer_of(chunk=4, extra_batches=2, staleness=2)
    engine.version = 0
    buffer.phase(0, LOCAL, make_draw(drawn), engine.generate)
    partial = [s for g in buffer.groups for s in g.samples if s.tokens and not s.finished]
    assert partial, "the script leaves samples unfinished after a phase"
    before = {id(s): (list(s.tokens), list(s.log_probs), list(s.versions)) for s in partial}
    engine.version = 1
    buffer.phase(1, LOCAL, make_draw(drawn), engine.generate)
    for sample in partial:
        tokens, log_probs, versions = before[id(sample)]
        k = len(tokens)
        assert sample.tokens[:k] == tokens and sample.log_probs[:k] == log_probs
        assert sample.versions[:k] == versions == [0] * k
        assert len(sample.tokens) > k and set(sample.versions[k:]) == {1}
        # Continuations are the script's next tokens: the engine saw the tokens so far.
        assert sample.tokens[k] in (10 + k, STOP)


def test_staleness_zero_without_partial_is_one_batch_to_its_end_with_the_sync_seeds():
    engine, drawn = ScriptedEngine(seed=2), []
    buffer = buffer_of(chunk=MAX_NEW, extra_batches=0, staleness=0)
    phase = buffer.phase(0, LOCAL, make_draw(drawn), engine.generate)
    assert drawn == [0, 1, 2, 3] and buffer.groups == []
    # One call per distinct budget (all MAX_NEW here): prompt i's sample j, seed 100+i*N+j.
    assert engine.calls == [(LOCAL * N, MAX_NEW, [100 + k for k in range(LOCAL * N)])]
    assert [g.record for g in phase.groups] == [0, 1, 2, 3]
    assert phase.metrics["async/chunks"] == 1.0
    generated = sum(len(s.tokens) for g in phase.groups for s in g.samples)
    assert phase.metrics["async/generated_tokens"] == generated > 0


def test_restart_and_drop_act_on_what_exceeds_the_bound():
    engine, drawn = ScriptedEngine(seed=3), []
    buffer = buffer_of(chunk=2, extra_batches=2, staleness=0, on_stale="restart")
    buffer.phase(0, LOCAL, make_draw(drawn), engine.generate)
    started = [s for g in buffer.groups for s in g.samples if s.tokens]
    engine.version = 1
    phase = buffer.phase(1, LOCAL, make_draw(drawn), engine.generate)
    assert phase.metrics["async/restarted"] == len(started) > 0
    assert all(s.restarts == 1 and set(s.versions) <= {1} for s in started)
    # A restarted sample draws new seeds, not its first attempt's.
    assert continuation_seed(7, 0, 0) == 7 and continuation_seed(7, 1, 0) != 7
    assert continuation_seed(7, 0, 3) not in (7, continuation_seed(7, 1, 3))
    drop = buffer_of(chunk=2, extra_batches=2, staleness=0, on_stale="drop")
    drop.phase(0, LOCAL, make_draw([]), ScriptedEngine(seed=3, version=0).generate)
    groups_started = sum(any(s.tokens for s in g.samples) for g in drop.groups)
    phase = drop.phase(1, LOCAL, make_draw([]), ScriptedEngine(seed=3, version=1).generate)
    assert phase.metrics["async/dropped"] == groups_started > 0


def test_resuming_from_the_state_continues_exactly():
    def run(split_at=None):
        engine, drawn, out = ScriptedEngine(seed=4), [], []
        buffer = buffer_of(chunk=3, extra_batches=2, staleness=1)
        for step in range(6):
            if step == split_at:  # a checkpoint: JSON out and into a fresh buffer
                state = json.loads(json.dumps(buffer.state_dict()))
                buffer = buffer_of(chunk=3, extra_batches=2, staleness=1)
                buffer.load_state_dict(state)
            engine.version = step
            phase = buffer.phase(step, LOCAL, make_draw(drawn), engine.generate)
            out.append([(g.record, [s.tokens for s in g.samples]) for g in phase.groups])
        return out

    assert run(split_at=3) == run()


def test_rows_and_staleness_metrics():
    engine = ScriptedEngine(seed=5)
    buffer = buffer_of(chunk=2, extra_batches=1, staleness=3)
    phases = []
    for step in range(3):
        engine.version = step
        phases.append(buffer.phase(step, LOCAL, make_draw([]), engine.generate))
    groups = phases[-1].groups
    batch, per_row, records = PartialRollouts.to_rows(groups, 0, 2)
    assert records == [g.record for g in groups for _ in range(N)]
    assert batch.group_index.tolist() == [k for k in range(LOCAL) for _ in range(N)]
    versions = per_row["async/token_versions"]
    expected = []
    for g in groups:
        for s in g.samples:
            row = s.versions + [-1] * (versions.shape[1] - len(s.versions))
            expected.append(row)
            assert batch.row_tokens(len(expected) - 1)[1] == s.tokens
    assert versions.tolist() == expected
    all_versions = [v for row in expected for v in row if v >= 0]
    got = staleness_metrics(versions, batch.response_mask, 2)
    assert got["async/staleness_max"] == 2 - min(all_versions)
    assert got["async/staleness_mean"] == pytest.approx(
        sum(2 - v for v in all_versions) / len(all_versions)
    )
    partial = [float(len(set(s.versions)) > 1) for g in groups for s in g.samples]
    assert per_row["async/partial"].tolist() == partial


def test_bad_on_stale_is_refused():
    with pytest.raises(ValueError, match="rollout.on_stale"):
        PartialRollouts(N, MAX_NEW, 4, 0, 1, "skip")


def test_a_phase_generates_even_when_carried_groups_fill_the_step():
    # Groups finished in an earlier phase can fill this step alone; the phase still runs a
    # chunk for the rest, so the records drawn for later steps start now.
    engine, drawn = ScriptedEngine(seed=1), []
    buffer = buffer_of(chunk=2, extra_batches=3, staleness=MAX_NEW)
    buffer.phase(0, 0, make_draw(drawn), engine.generate)  # one chunk, nothing taken
    assert sum(g.finished for g in buffer.groups) >= 1
    unfinished = [s for g in buffer.groups for s in g.samples if not s.finished]
    assert unfinished
    calls = len(engine.calls)
    engine.version = 1
    phase = buffer.phase(1, 1, make_draw(drawn), engine.generate)
    assert phase.metrics["async/chunks"] == 1 and len(engine.calls) > calls
    carried = [s for g in buffer.groups for s in g.samples]
    partial = sum(bool(s.tokens) and not s.finished for s in carried)
    assert phase.metrics["async/carried_groups"] == len(buffer.groups)
    assert phase.metrics["async/carried_partial_samples"] == partial > 0


def test_tokens_carry_the_phase_version_when_the_engine_reports_none():
    engine, drawn = ScriptedEngine(seed=2, version=None), []
    phase = buffer_of(chunk=MAX_NEW, extra_batches=0).phase(
        5, LOCAL, make_draw(drawn), engine.generate
    )
    assert {v for g in phase.groups for s in g.samples for v in s.versions} == {5}
