"""`CoreLoop` (rollout/vllm/core_loop.py) on a scripted in-process engine core.

No model: the engine core below hands back scripted `EngineCoreOutputs` step by step, so
the loop's own bookkeeping is checked value by value (the fan-out of n samples, the
accumulation over steps, log-probs, expert routing, the abort on an error). That it
samples what `LLM.generate` samples on a real engine is tests/vllm/test_vllm_engine.py's.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import vllm

from rl_megatron.rollout.vllm.core_loop import CoreLoop, in_process_client

# No skip when vLLM is missing (as test_vllm_engine.py): `make test` installs the CPU build.
pytestmark = pytest.mark.vllm


def core_output(rid, tokens, *, logprobs=None, routed=None, finish=None):
    lp = None
    if logprobs is not None:  # LogprobsLists' layout: column 0 is the sampled token
        lp = SimpleNamespace(
            logprobs=np.array([[v, -9.0] for v in logprobs]),
            logprob_token_ids=np.array([[t, 0] for t in tokens]),
        )
    return SimpleNamespace(
        request_id=rid,
        new_token_ids=list(tokens),
        new_logprobs=lp,
        routed_experts=routed,
        finished=finish is not None,
        finish_reason=finish,
    )


class ScriptedCore:
    """An `InprocClient` whose steps return the outputs `script(requests)` lists."""

    def __init__(self, script):
        self.engine_core = object()  # the in-process marker `in_process_client` checks
        self.script, self.requests, self.aborted, self.steps = script, [], [], None

    def add_request(self, request):
        self.requests.append(request)

    def get_output(self):
        if self.steps is None:
            self.steps = iter(self.script(self.requests))
        return SimpleNamespace(outputs=next(self.steps))

    def abort_requests(self, ids):
        self.aborted.extend(ids)


class InputProcessor:
    model_config = SimpleNamespace(max_model_len=8)

    def __init__(self):
        self.processed = 0

    def process_inputs(self, request_id, prompt, params, supported_tasks, **adapter):
        assert prompt == {"type": "token", "prompt_token_ids": prompt["prompt_token_ids"]}
        assert supported_tasks == ("generate",)
        self.processed += 1
        return SimpleNamespace(
            request_id=request_id,
            external_req_id=None,
            prompt_token_ids=prompt["prompt_token_ids"],
            sampling_params=params.clone(),
            params=None,
            arrival_time=0.0,
            lora_request=adapter.get("lora_request"),
        )

    @staticmethod
    def assign_request_id(request):
        request.params = request.sampling_params
        request.request_id = f"{request.request_id}-abcd"


def make_loop(script):
    core = ScriptedCore(script)
    engine = SimpleNamespace(
        engine_core=core,
        input_processor=InputProcessor(),
        get_supported_tasks=lambda: ("generate",),
    )
    return CoreLoop(SimpleNamespace(llm_engine=engine)), core


def test_fans_out_n_samples_with_vllms_seeds_and_gathers_steps():
    def script(reqs):
        a0, a1, b = (r.request_id for r in reqs)
        return [
            [],  # a step that only scheduled
            [core_output(a0, [5], logprobs=[-0.5]), core_output(b, [7], logprobs=[-0.25])],
            [
                core_output(a1, [6, 8], logprobs=[-1.0, -2.0], finish="length"),
                core_output("stale-request", [1]),  # an earlier call's: ignored
                core_output(a0, [9], logprobs=[-0.75], finish="stop"),
            ],
            [core_output(b, [4], logprobs=[-3.0], finish="length")],
        ]

    loop, core = make_loop(script)
    seeded = vllm.SamplingParams(n=2, seed=40, max_tokens=2, logprobs=0)
    single = vllm.SamplingParams(n=1, seed=None, max_tokens=2, logprobs=0)
    out = loop.run([[1, 2], [3]], [seeded, single])

    # vLLM's fan-out: child j of an n-sample prompt is "j_<id>" with seed + j and n = 1.
    assert [r.request_id for r in core.requests] == ["0_rl-0-abcd", "1_rl-0-abcd", "rl-1-abcd"]
    assert [r.sampling_params.seed for r in core.requests] == [40, 41, None]
    assert [r.sampling_params.n for r in core.requests] == [1, 1, 1]
    assert [r.prompt_token_ids for r in core.requests] == [[1, 2], [1, 2], [3]]
    assert seeded.seed == 40 and seeded.n == 2  # the caller's params are left alone

    assert [[s.token_ids for s in p] for p in out] == [[[5, 9], [6, 8]], [[7, 4]]]
    assert [[s.log_probs for s in p] for p in out] == [
        [[-0.5, -0.75], [-1.0, -2.0]],
        [[-0.25, -3.0]],
    ]
    assert [[s.finish_reason for s in p] for p in out] == [["stop", "length"], ["length"]]
    assert core.aborted == []


def test_without_log_probs_none_are_kept_and_routing_is_concatenated():
    def script(reqs):
        (rid,) = (r.request_id for r in reqs)
        first, second = np.zeros((3, 2, 1), np.int16), np.ones((1, 2, 1), np.int16)
        return [
            [core_output(rid, [5], routed=first)],
            [core_output(rid, [6], routed=second, finish="length")],
        ]

    loop, _ = make_loop(script)
    (samples,) = loop.run([[1, 2, 3]], [vllm.SamplingParams(max_tokens=2)])
    (sample,) = samples
    assert sample.log_probs is None and sample.token_ids == [5, 6]
    assert sample.routed_experts.tolist() == [[[0], [0]]] * 3 + [[[1], [1]]]


def test_an_error_mid_run_aborts_the_unfinished_requests():
    def script(reqs):
        a, b = (r.request_id for r in reqs)
        yield [core_output(a, [5], finish="length")]
        raise RuntimeError("model failed")

    loop, core = make_loop(script)
    params = vllm.SamplingParams(max_tokens=1)
    with pytest.raises(RuntimeError, match="model failed"):
        loop.run([[1], [2]], [params, params])
    assert core.aborted == [core.requests[1].request_id]


def test_refuses_an_engine_core_in_another_process_and_mismatched_params():
    with pytest.raises(RuntimeError, match="does not run in this process.*external_launcher"):
        in_process_client(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object())))
    loop, _ = make_loop(lambda reqs: [])
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        loop.run([[1], [2]], [vllm.SamplingParams()])


def test_requests_added_one_by_one_finish_step_by_step_under_their_keys():
    """The incremental API: a request added between steps joins the running ones, each
    step returns exactly the requests that finished in it, and abort ends the rest."""

    def script(reqs):
        a, b = (r.request_id for r in reqs)
        yield [core_output(a, [5], logprobs=[-0.5]), core_output(b, [7], logprobs=[-0.25])]
        yield [core_output(a, [6], logprobs=[-1.0], finish="stop")]
        c = reqs[2].request_id  # added after the second step, while b still decodes
        yield [core_output(b, [8], logprobs=[-2.0]), core_output(c, [9], logprobs=[-3.0])]
        yield [core_output(c, [4], logprobs=[-4.0], finish="length")]

    loop, core = make_loop(script)
    params = vllm.SamplingParams(n=1, seed=3, max_tokens=2, logprobs=0)
    loop.add("0-0", [1, 2], params)
    loop.add("1-0", [3], params.clone())
    assert loop.running == 2
    assert loop.step() == []
    ((key, sample),) = loop.step()
    assert (key, sample.token_ids, sample.log_probs) == ("0-0", [5, 6], [-0.5, -1.0])
    assert sample.finish_reason == "stop" and loop.running == 1
    loop.add("0-1", [1, 2, 5, 6, 11], params)
    assert loop.step() == []
    ((key, sample),) = loop.step()
    assert (key, sample.token_ids, sample.log_probs) == ("0-1", [9, 4], [-3.0, -4.0])
    assert sample.finish_reason == "length"
    assert [r.prompt_token_ids for r in core.requests] == [[1, 2], [3], [1, 2, 5, 6, 11]]
    assert [r.request_id for r in core.requests] == ["rl-0-abcd", "rl-1-abcd", "rl-2-abcd"]
    # "1-0" is still running: abort hands exactly it to the engine core, once.
    loop.abort()
    assert core.aborted == ["rl-1-abcd"] and loop.running == 0
    loop.abort()
    assert core.aborted == ["rl-1-abcd"]
    with pytest.raises(ValueError, match="one sample per request.*n = 2"):
        loop.add("x", [1], vllm.SamplingParams(n=2))


def test_turns_are_copies_of_the_first_processed_request_with_their_prompt_seed_and_cap():
    """`add_turn`: vLLM's input processor runs once per `like` (and adapter); every later
    turn is a copy carrying its own prompt, seed and max_tokens, its params its own."""
    loop, core = make_loop(lambda reqs: [])
    processor = loop._engine.input_processor
    like = vllm.SamplingParams(n=1, seed=None, max_tokens=5, logprobs=0, stop_token_ids=[2])
    loop.add_turn("0-0", [1, 2], like, 100, 3)
    loop.add_turn("1-0", [3], like, 101, 4)
    loop.add_turn("0-1", [1, 2, 5, 6, 7, 8, 9, 10], like, 102, 1)
    assert processor.processed == 1
    assert [r.prompt_token_ids for r in core.requests] == [[1, 2], [3], [1, 2, 5, 6, 7, 8, 9, 10]]
    assert [r.sampling_params.seed for r in core.requests] == [100, 101, 102]
    assert [r.sampling_params.max_tokens for r in core.requests] == [3, 4, 1]
    assert [r.sampling_params.stop_token_ids for r in core.requests] == [[2]] * 3
    assert [r.request_id for r in core.requests] == ["rl-0-abcd", "rl-1-abcd", "rl-2-abcd"]
    assert [r.params.seed for r in core.requests] == [100, 101, 102]
    assert len({id(r.sampling_params) for r in core.requests}) == 3
    assert like.seed is None and like.max_tokens == 5  # the caller's params are left alone
    assert loop.running == 3

    other = like.clone()
    loop.add_turn("2-0", [4], other, 103, 2)  # other params: processed anew
    assert processor.processed == 2
    loop.lora_request = object()  # a new adapter version: processed anew, and carried
    loop.add_turn("3-0", [4], other, 104, 2)
    loop.add_turn("3-1", [4, 5], other, 105, 2)
    assert processor.processed == 3
    assert [r.lora_request for r in core.requests[-2:]] == [loop.lora_request] * 2

    with pytest.raises(ValueError, match="turn 4-0: a prompt of 9 tokens .*1 to 8"):
        loop.add_turn("4-0", list(range(9)), like, 106, 1)
    with pytest.raises(ValueError, match="turn 4-0: a prompt of 0 tokens"):
        loop.add_turn("4-0", [], like, 106, 1)
    with pytest.raises(ValueError, match="turn 4-0: max_tokens 0 < 1"):
        loop.add_turn("4-0", [1], like, 106, 0)
    assert len(core.requests) == 6


def test_each_steps_seconds_are_logged_when_asked_and_sum_to_the_total(monkeypatch):
    """`step_seconds`/`steps` count every engine-core step; `step_log`, when a list, gets
    each step's own seconds (a benchmark's per-step view): the slow step is the one logged
    slow, and the log sums to the total. The loop's clock is a fake the scripted steps
    advance, so a loaded host cannot make a fast step look slow."""

    def script(reqs):
        (rid,) = (r.request_id for r in reqs)
        return [[], [], [core_output(rid, [5], finish="length")]]

    loop, core = make_loop(script)
    scripted, now = core.get_output, [0.0]
    durations = iter([2**-6, 2**-4, 2**-6])  # exact in binary
    clock = SimpleNamespace(perf_counter=lambda: now[0], time=time.time)
    monkeypatch.setattr("rl_megatron.rollout.vllm.core_loop.time", clock)

    def get_output():  # the second step takes 62.5 ms, the others 15.6
        now[0] += next(durations)
        return scripted()

    core.get_output = get_output
    loop.step_log = []
    loop.run([[1, 2]], [vllm.SamplingParams(max_tokens=1)])
    assert loop.steps == len(loop.step_log) == 3
    assert loop.step_log[1] >= 0.05 > max(loop.step_log[0], loop.step_log[2])
    assert sum(loop.step_log) == pytest.approx(loop.step_seconds)

    monkeypatch.undo()  # the real clock again
    loop, _ = make_loop(script)  # not asked: counted, not logged
    loop.run([[1, 2]], [vllm.SamplingParams(max_tokens=1)])
    assert loop.steps == 3 and loop.step_seconds > 0 and loop.step_log is None
