"""benchmarks/async_ab.py's length sampler: the mixture's frequencies, the cap a request
gets (its record's target less the tokens it has), the relabelled finish reason, and the
partial-rollout buffer driven through it finishing every sample exactly at its target."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.trainer.partial_rollouts import PartialRollouts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from async_ab import LengthSampler, _digest, _tokens_bytes, target_length  # noqa: E402

MAX_LEN = 64


def fake_trainer(prompts: list[list[int]], calls: list) -> SimpleNamespace:
    """What the sampler reads of a trainer, and a `_generate` that honours the caps (each
    row's tokens are 7s: the engine's own behaviour is the engine tests')."""

    def generate(batch_prompts, sampling):
        calls.append(sampling)
        rows = [(i, p) for i, p in enumerate(batch_prompts) for _ in range(sampling.n)]
        lengths = [sampling.prompt_max_new(i) for i, _ in rows]
        return RolloutBatch.from_sequences(
            prompts=[p for _, p in rows],
            responses=[[7] * n for n in lengths],
            log_probs=[[0.0] * n for n in lengths],
            finish_reasons=["length"] * len(rows),
            group_index=[i for i, _ in rows],
        )

    return SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(max_response_length=MAX_LEN)),
        data=SimpleNamespace(train=SimpleNamespace(input_ids=prompts)),
        _generate=generate,
    )


def prompts_of(count: int) -> list[list[int]]:
    return [[3 + i % 5, 100 + i, 7 * i] + [1] * (i % 3) for i in range(count)]


def target_of(prompt: list[int]) -> int:
    return target_length(_digest(_tokens_bytes(prompt)), MAX_LEN)[1]


def test_mixture_frequencies_and_ranges():
    draws = [target_length(_digest(_tokens_bytes([i, i + 1])), MAX_LEN) for i in range(20000)]
    share = {
        c: sum(name == c for name, _ in draws) / len(draws) for c in ("short", "medium", "long")
    }
    assert share == pytest.approx({"short": 0.70, "medium": 0.25, "long": 0.05}, abs=0.015)
    bounds = {"short": (1, 8), "medium": (9, 32), "long": (64, 64)}
    for name, target in draws:
        lo, hi = bounds[name]
        assert lo <= target <= hi
    # Every length of a class is drawn (the uniform reaches both ends).
    assert {t for name, t in draws if name == "short"} == set(range(1, 9))
    assert {t for name, t in draws if name == "medium"} == set(range(9, 33))


def test_requests_are_capped_at_the_target_less_the_tokens_so_far():
    prompts = prompts_of(40)
    calls: list = []
    trainer = fake_trainer(prompts, calls)
    LengthSampler(trainer).install()
    from rl_megatron.rollout.sampling import SamplingParams

    # Synchronous shape: record prompts, n samples each, one cap per prompt.
    batch = trainer._generate(prompts, SamplingParams(max_new_tokens=MAX_LEN, n=2))
    targets = [target_of(p) for p in prompts]
    assert calls[-1].ignore_eos and calls[-1].prompt_max_new_tokens == tuple(targets)
    assert batch.response_lengths.tolist() == [t for t in targets for _ in range(2)]
    # Reaching a target below the maximum is a "stop"; at the maximum it stays "length".
    want = ["length" if t == MAX_LEN else "stop" for t in targets for _ in range(2)]
    assert batch.finish_reasons == want and "length" in want and "stop" in want
    # A continuation (the record's prompt + 1 token), with a chunk budget of 4: capped at
    # target - 1, "stop" only where that is reached within the chunk.
    ongoing = [p + [9] for p, t in zip(prompts, targets) if t > 1]
    left = [t - 1 for t in targets if t > 1]
    batch = trainer._generate(ongoing, SamplingParams(max_new_tokens=4, n=1))
    assert calls[-1].prompt_max_new_tokens == tuple(left)
    assert batch.response_lengths.tolist() == [min(4, n) for n in left]
    assert batch.finish_reasons == [
        "stop" if n <= 4 and n + 1 < MAX_LEN else "length" for n in left
    ]
    with pytest.raises(RuntimeError, match="starts with no training prompt"):
        trainer._generate([[99999, 5]], SamplingParams(max_new_tokens=4))


def test_partial_rollouts_through_the_sampler_end_every_sample_at_its_target():
    """The buffer, fed by the wrapped generate in chunks of 8, finishes each sample at its
    record's target (chunks across phases), never beyond, never sent again after it."""
    prompts = prompts_of(24)
    trainer = fake_trainer(prompts, [])
    sampler = LengthSampler(trainer).install()
    from rl_megatron.rollout.sampling import SamplingParams

    def generate(batch_prompts, max_new_tokens, seeds):
        return sampler(batch_prompts, SamplingParams(max_new_tokens=max_new_tokens, n=1))

    buffer = PartialRollouts(2, MAX_LEN, 8, 4, max_staleness=100, on_stale="restart")
    draws = iter(range(0, 24, 4))

    def draw(d):
        lo = next(draws)
        return list(range(lo, lo + 4)), prompts[lo : lo + 4], None

    finished = []
    for version in range(4):
        finished += buffer.phase(version, 4, draw, generate).groups
    assert len(finished) == 16
    for group in finished:
        target = target_of(group.prompt)
        for sample in group.samples:
            assert len(sample.tokens) == target
            assert sample.finish_reason == ("length" if target == MAX_LEN else "stop")
