"""rollout/turn_waves.py: each turn draws with its own seed, whatever shares its wave."""

from __future__ import annotations

import pytest

from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.multi_turn import turn_seed
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.turn_channel import LeaderChannel
from rl_megatron.rollout.turn_waves import _Waves

MAX_TURNS = 3
STOP = 1


class SeedEchoEngine:
    """Samples, for prompt i, the token its seed names (the stop token without one) (a stand-in for a seeded sampler
    whose draws depend on the row's seed only); records every call."""

    pad_token_id = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, output_layout="full"):
        sampling.check_prompt_seeds(len(prompts))
        self.calls.append((len(prompts), sampling))
        seeds = [sampling.prompt_seed(i) for i in range(len(prompts))]
        responses = [[STOP if s is None else 100 + s, STOP] for s in seeds]
        return RolloutBatch.from_sequences(
            prompts=[list(p) for p in prompts],
            responses=responses,
            log_probs=[[-0.5, -0.5] for _ in prompts],
            finish_reasons=["stop"] * len(prompts),
            group_index=list(range(len(prompts))),
            pad_token_id=0,
        )


REQUESTS = [("0-0", [5, 6], 4), ("1-0", [5, 7], 4), ("0-1", [5, 6, 9], 2), ("2-2", [8], 4)]


def sampled_by_request(waves_of_requests, seed=1000):
    engine = SeedEchoEngine()
    waves = _Waves(engine, SamplingParams(seed=seed), LeaderChannel(None, 0), MAX_TURNS)
    got = {}
    for wave in waves_of_requests:
        for request in wave:
            waves.submit(*request)
        got.update({t.request_id: t.token_ids[0] - 100 for t in waves.finished(0.0)})
    return got, engine, waves


def test_a_turn_draws_with_its_trajectory_and_turn_seed_whatever_its_wave():
    together, engine, waves = sampled_by_request([REQUESTS])
    expected = {
        rid: turn_seed(1000, int(rid.split("-")[0]), int(rid.split("-")[1]), MAX_TURNS)
        for rid, _, _ in REQUESTS
    }
    assert together == expected == {"0-0": 1000, "1-0": 1003, "0-1": 1001, "2-2": 1008}
    # One wave, two budgets (4 and 2): two calls, each with the per-prompt seeds only.
    assert waves.waves == 1 and waves.calls == 2
    assert all(s.seed is None and s.n == 1 for _, s in engine.calls)
    alone, _, waves = sampled_by_request([[r] for r in reversed(REQUESTS)])
    assert alone == together and waves.waves == 4


def test_without_a_seed_the_engine_draws_from_its_own_generator():
    engine = SeedEchoEngine()
    waves = _Waves(engine, SamplingParams(seed=None), LeaderChannel(None, 0), MAX_TURNS)
    waves.submit("0-0", [5], 4)
    assert [t.token_ids for t in waves.finished(0.0)] == [[STOP, STOP]]
    assert engine.calls[0][1].prompt_seeds is None and engine.calls[0][1].seed is None


def test_prompt_seeds_override_the_seed_and_must_cover_every_prompt():
    sampling = SamplingParams(seed=7, n=2, prompt_seeds=[40, 50])
    assert [sampling.prompt_seed(i) for i in (0, 1)] == [40, 50]
    assert SamplingParams(seed=7, n=2).prompt_seed(3) == 13
    assert SamplingParams().prompt_seed(0) is None
    with pytest.raises(ValueError, match="sampling.prompt_seeds holds 2 seeds for 3 prompts"):
        sampling.check_prompt_seeds(3)
