"""rollout/multi_turn.py: the driver, with a fake engine (deterministic tokens, a delay per
request) and environments in real forked workers."""

from __future__ import annotations

import heapq
import math
import os
import time
from pathlib import Path

import pytest

from rl_megatron.config import ConfigError, load_config
from rl_megatron.config_checks import validate
from rl_megatron.environments.base import Environment, Observation
from rl_megatron.environments.workers import EnvironmentPool
from rl_megatron.rollout.multi_turn import Turn, TurnBudget, run_trajectories
from rl_megatron.rollout.trajectory import ChatIncrements
from tests.chat_templates import make_chat_tokenizer

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


class KeyEnv(Environment):
    """'call ...' gets the record's key from the tool; 'answer <key>' ends with reward 1."""

    tools = TOOLS

    def start(self, sample):
        self.sample = sample
        return [{"role": "user", "content": f"what is the key of {sample['id']}"}]

    def step(self, response):
        fail = self.sample.get("fail")
        if fail == "raise":
            raise RuntimeError("tool broke")
        if fail == "hang" or self.sample.get("slow"):
            time.sleep(self.sample.get("slow", 60))
        if fail == "exit":
            os._exit(5)
        if fail == "garbage":
            return {"reward": 1}
        if response.startswith("answer"):
            right = response == f"answer {self.sample['key']}"
            return Observation(reward=float(right), done=True, metrics={"answers": 1})
        content = f"result {self.sample['key']}"
        return Observation(
            messages=[{"role": "tool", "content": content}], reward=0.1, metrics={"tool_calls": 1}
        )


class FakeEngine:
    """Turns from `script(trajectory, turn) -> text` (the stop token appended unless
    `stop=False`), each ready `delay(trajectory)` seconds after its submission."""

    def __init__(self, tokenizer, script, delay=lambda t: 0.0, stop=True):
        self.tokenizer, self.script, self.delay, self.stop = tokenizer, script, delay, stop
        self.queue: list = []
        self.submitted: list[tuple[float, str, list[int], int]] = []  # time, id, prompt, max
        self.outputs: dict[str, list[int]] = {}

    def submit(self, request_id, prompt_token_ids, max_tokens):
        t, k = (int(x) for x in request_id.split("-"))
        ids = self.tokenizer.encode(self.script(t, k), add_special_tokens=False)
        if self.stop:
            ids.append(self.tokenizer.eos_token_id)
        finish = "stop" if len(ids) <= max_tokens and self.stop else "length"
        ids = ids[:max_tokens]
        logprobs = [-(i + 1) / 64 for i in range(len(ids))]
        now = time.monotonic()
        self.submitted.append((now, request_id, list(prompt_token_ids), max_tokens))
        self.outputs[request_id] = ids
        turn = Turn(request_id, ids, logprobs, finish)
        heapq.heappush(self.queue, (now + self.delay(t), request_id, turn))

    def finished(self, timeout_s):
        if self.queue:
            time.sleep(max(0.0, min(timeout_s, self.queue[0][0] - time.monotonic())))
        done = []
        while self.queue and self.queue[0][0] <= time.monotonic():
            done.append(heapq.heappop(self.queue)[2])
        return done


def calls_then_answer(calls: int):
    """Each trajectory calls the tool `calls` times, then answers its record's key."""
    return lambda t, k: "call lookup" if k < calls else "answer 7"


def make_pool(max_concurrent=8, timeout_s=3.0):
    return EnvironmentPool(
        KeyEnv, name="test:KeyEnv", timeout_s=timeout_s, max_concurrent=max_concurrent
    )


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.shutdown()


BUDGET = TurnBudget(max_turns=5, max_turn_tokens=16, max_total_tokens=256)

# The whole trajectory of one record (key 7) with two tool calls, hand-written per format:
# the prompt, three sampled turns, each observation after its turn's tail.
EXPECTED = {
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\ntools : lookup <|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nwhat is the key of 3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        + "call lookup<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\nresult 7<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n" * 2 + "answer 7<|eot_id|>"
    ),
    "qwen2.5": (
        "<|im_start|>system\ntools : lookup <|im_end|>\n<|im_start|>user\nwhat is the key of 3"
        "<|im_end|>\n<|im_start|>assistant\n"
        + "call lookup<|im_end|>\n<|im_start|>user\n<tool_response>\nresult 7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n" * 2 + "answer 7<|im_end|>"
    ),
}
EXPECTED["qwen3"] = EXPECTED["qwen2.5"].replace(
    "assistant\ncall lookup", "assistant\n<think>\nhmm\n</think>\n\ncall lookup", 1
)


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3"])
def test_a_trajectory_is_prompt_sampled_tokens_tails_and_increments(pool, family):
    tokenizer = make_chat_tokenizer(family)
    increments = ChatIncrements(tokenizer, tools=KeyEnv.tools)

    def script(t, k):  # Qwen3 thinks in its first turn; the trajectory keeps it
        text = calls_then_answer(2)(t, k)
        return "<think>\nhmm\n</think>\n\n" + text if family == "qwen3" and k == 0 else text

    engine = FakeEngine(tokenizer, script)
    (traj,), metrics = run_trajectories([{"id": 3, "key": 7}], 1, pool, increments, engine, BUDGET)
    expected = tokenizer.encode(EXPECTED[family], add_special_tokens=False)
    assert traj.token_ids == expected and tokenizer.unk_token_id not in expected
    assert (traj.finish_reason, len(traj.turns)) == ("done", 3)
    assert traj.reward == pytest.approx(0.1 + 0.1 + 1.0)
    # Token in: each turn was generated after exactly the trajectory's tokens so far.
    for (start, end), (_, request_id, prompt, _) in zip(traj.turns, engine.submitted):
        assert prompt == traj.token_ids[:start]
        assert traj.token_ids[start:end] == engine.outputs[request_id]
    # Mask 1 exactly on the sampled tokens, 0 on prompt, tails and observations.
    sampled = {i for start, end in traj.turns for i in range(start, end)}
    assert [i for i, m in enumerate(traj.loss_mask) if m] == sorted(sampled)
    observed = {i for start, end in traj.observations for i in range(start, end)}
    assert observed and not observed & sampled
    assert all(traj.loss_mask[i] == 0 and traj.logprobs[i] == 0.0 for i in observed)
    assert [traj.logprobs[i] for i in range(*traj.turns[1])] == engine_logprobs(
        traj.turns[1][1] - traj.turns[1][0]
    )
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)
    assert metrics["multi_turn/turns_mean"] == 3 and metrics["env/tool_calls"] == 2
    assert metrics["env/answers"] == 1 and metrics["multi_turn/finish_done"] == 1
    assert metrics["multi_turn/observation_tokens_mean"] == len(observed)
    assert traj.texts[0] == {"role": "user", "content": "what is the key of 3"}
    assert traj.texts[-1] == {"role": "assistant", "content": "answer 7"}


def engine_logprobs(count: int) -> list[float]:
    return [-(i + 1) / 64 for i in range(count)]


def test_trajectories_come_back_by_record_then_n_with_their_groups(pool):
    tokenizer = make_chat_tokenizer("qwen2.5")
    records = [{"id": i, "key": 7} for i in range(3)]
    # Record 0's trajectories are the slowest to generate and make the most calls.
    engine = FakeEngine(tokenizer, lambda t, k: calls_then_answer(3 - t // 2)(t, k),
                        delay=lambda t: 0.02 * (6 - t))  # fmt: skip
    trajs, metrics = run_trajectories(
        records, 2, pool, ChatIncrements(tokenizer), engine, BUDGET, groups=[10, 11, 12]
    )
    assert [(t.group, t.sample) for t in trajs] == [(g, j) for g in (10, 11, 12) for j in (0, 1)]
    assert [len(t.turns) for t in trajs] == [4, 4, 3, 3, 2, 2]
    assert [t.reward for t in trajs] == pytest.approx([1.3, 1.3, 1.2, 1.2, 1.1, 1.1])
    what = tokenizer.encode("what is the key of 1", add_special_tokens=False)
    prompt = trajs[2].token_ids[: trajs[2].prompt_length]
    assert any(prompt[i : i + len(what)] == what for i in range(len(prompt)))
    assert metrics["multi_turn/turns_mean"] == pytest.approx(3.0)
    # The other metrics, recomputed from the trajectories (uneven on purpose).
    lengths = [len(t.token_ids) for t in trajs]
    observed = [sum(e - s for s, e in t.observations) for t in trajs]
    assert len(set(lengths)) == 3 and len(set(observed)) == 3
    assert metrics["multi_turn/turns_max"] == 4
    assert metrics["multi_turn/length_mean"] == pytest.approx(sum(lengths) / 6)
    assert metrics["multi_turn/length_max"] == max(lengths)
    assert metrics["multi_turn/observation_tokens_mean"] == pytest.approx(sum(observed) / 6)
    assert [t.metrics for t in trajs] == [
        {"tool_calls": c, "answers": 1} for c in (3.0, 3.0, 2.0, 2.0, 1.0, 1.0)
    ]
    assert (metrics["env/tool_calls"], metrics["env/answers"]) == (12, 6)


def test_max_turns_ends_after_the_last_turns_observation(pool):
    tokenizer = make_chat_tokenizer("qwen2.5")
    engine = FakeEngine(tokenizer, lambda t, k: "call lookup")  # never answers
    budget = TurnBudget(max_turns=2, max_turn_tokens=16, max_total_tokens=256)
    (traj,), metrics = run_trajectories(
        [{"id": 0, "key": 7}], 1, pool, ChatIncrements(tokenizer), engine, budget
    )
    assert (traj.finish_reason, len(traj.turns), len(traj.observations)) == ("max_turns", 2, 1)
    assert traj.reward == pytest.approx(0.2)  # the last turn's observation still scores
    assert traj.turns[-1][1] == len(traj.token_ids)  # its messages are not appended
    assert metrics["multi_turn/finish_max_turns"] == 1


def test_a_turn_cut_at_its_budget_ends_the_trajectory(pool):
    tokenizer = make_chat_tokenizer("qwen2.5")
    engine = FakeEngine(tokenizer, lambda t, k: "call lookup " * 10, stop=False)
    budget = TurnBudget(max_turns=5, max_turn_tokens=4, max_total_tokens=256)
    (traj,), _ = run_trajectories(
        [{"id": 0, "key": 7}], 1, pool, ChatIncrements(tokenizer), engine, budget
    )
    assert (traj.finish_reason, traj.turns) == (
        "turn_length",
        [(traj.prompt_length, traj.prompt_length + 4)],
    )
    assert engine.submitted[0][3] == 4 and sum(traj.loss_mask) == 4
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)


def test_an_observation_that_would_not_fit_is_not_appended(pool):
    tokenizer = make_chat_tokenizer("qwen2.5")
    incs = ChatIncrements(tokenizer)
    prompt = len(incs.prompt([{"role": "user", "content": "what is the key of 0"}]))
    turn = 3  # "call lookup" + stop
    observation = len(incs.tail + incs.increment([{"role": "tool", "content": "result 7"}]))
    # Room for the first turn and the observation, but not one token after it.
    budget = TurnBudget(
        max_turns=5, max_turn_tokens=16, max_total_tokens=prompt + turn + observation
    )
    engine = FakeEngine(tokenizer, calls_then_answer(2))
    (traj,), _ = run_trajectories([{"id": 0, "key": 7}], 1, pool, incs, engine, budget)
    assert (traj.finish_reason, len(traj.token_ids)) == ("context_length", prompt + turn)
    # A prompt that fills the context leaves no room for one token: never submitted.
    engine = FakeEngine(tokenizer, calls_then_answer(2))
    (full,), _ = run_trajectories(
        [{"id": 0, "key": 7}], 1, pool, incs, engine, TurnBudget(5, 16, prompt)
    )
    assert (full.finish_reason, full.turns, engine.submitted) == ("context_length", [], [])
    assert traj.observations == []
    # With one token more the observation fits and the next turn is cut by the total.
    budget = TurnBudget(5, 16, prompt + turn + observation + 1)
    (traj,), _ = run_trajectories([{"id": 0, "key": 7}], 1, pool, incs, FakeEngine(tokenizer, calls_then_answer(2)), budget)  # fmt: skip
    assert (traj.finish_reason, len(traj.token_ids)) == ("context_length", budget.max_total_tokens)
    assert traj.turns[-1][1] - traj.turns[-1][0] == 1 and sum(traj.loss_mask) == turn + 1


@pytest.mark.parametrize(
    "fail, error",
    [
        ("raise", "step: RuntimeError: tool broke"),
        ("hang", "step gave no result within environment.timeout_s=1"),
        ("exit", "the environment worker process died during step (exit code 5)"),
        ("garbage", "step returned dict, not an Observation"),
    ],
)
def test_a_failing_environment_is_counted_and_the_others_go_on(fail, error):
    tokenizer = make_chat_tokenizer("llama3")
    pool = make_pool(max_concurrent=3, timeout_s=1.0)
    records = [{"id": 0, "key": 7}, {"id": 1, "key": 7, "fail": fail}, {"id": 2, "key": 7}]
    try:
        trajs, metrics = run_trajectories(
            records, 2, pool, ChatIncrements(tokenizer), FakeEngine(tokenizer, calls_then_answer(1)), BUDGET
        )  # fmt: skip
        # The same pool serves the next call, whose counts are its own.
        good = [r for r in records if "fail" not in r]
        again, again_metrics = run_trajectories(
            good, 1, pool, ChatIncrements(tokenizer), FakeEngine(tokenizer, calls_then_answer(1)), BUDGET
        )  # fmt: skip
    finally:
        pool.shutdown()
    assert [t.finish_reason for t in again] == ["done", "done"]
    assert again_metrics["multi_turn/env_errors"] == again_metrics["multi_turn/env_timeouts"] == 0
    reasons = [t.finish_reason for t in trajs]
    assert reasons == ["done", "done", "environment_error", "environment_error", "done", "done"]
    assert all(t.error.startswith(error) for t in trajs[2:4])
    assert [t.reward for t in trajs] == pytest.approx([1.1, 1.1, 0, 0, 1.1, 1.1])
    assert metrics["multi_turn/env_errors"] == 2
    assert metrics["multi_turn/env_timeouts"] == (2 if fail == "hang" else 0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_a_slow_environment_holds_only_its_own_trajectory(pool):
    """No lock-step: while trajectory 0 waits 1 s for its environment, the others run
    all their turns to the end."""
    tokenizer = make_chat_tokenizer("qwen2.5")
    records = [{"id": 0, "key": 7, "slow": 1.0}] + [{"id": i, "key": 7} for i in range(1, 4)]
    engine = FakeEngine(tokenizer, calls_then_answer(2), delay=lambda t: 0.05)
    started = time.monotonic()
    trajs, metrics = run_trajectories(records, 1, pool, ChatIncrements(tokenizer), engine, BUDGET)
    wall = time.monotonic() - started
    assert [t.finish_reason for t in trajs] == ["done"] * 4
    submitted = {rid: when for when, rid, _, _ in engine.submitted}
    others_last = max(submitted[f"{t}-2"] for t in (1, 2, 3))
    assert others_last < submitted["0-1"]  # the others finished before 0's second turn
    assert submitted["0-1"] - started >= 1.0
    # The step takes the slow trajectory's own time (3 calls of 1 s), nothing added beyond
    # scheduling noise (a 0.5 s margin failed once with the two cores shared by 4 runs).
    assert wall < 3 * 1.0 + 2.0
    assert metrics["multi_turn/env_time_s"] >= 3.0


def test_engine_idle_counts_the_waits_on_environments_with_nothing_generating(pool):
    tokenizer = make_chat_tokenizer("qwen2.5")
    slow = [{"id": 0, "key": 7, "slow": 0.2}]  # each step 0.2 s, nothing else to generate
    engine = FakeEngine(tokenizer, calls_then_answer(2))
    started = time.monotonic()
    _, metrics = run_trajectories(slow, 1, pool, ChatIncrements(tokenizer), engine, BUDGET)
    wall = time.monotonic() - started
    assert 0.6 <= metrics["multi_turn/engine_idle_s"] <= metrics["timing_s/multi_turn"] <= wall
    # An instant environment and a slow engine: the wall time is the engine's, not idle.
    quick = [{"id": 0, "key": 7}]
    engine = FakeEngine(tokenizer, calls_then_answer(2), delay=lambda t: 0.2)
    _, metrics = run_trajectories(quick, 1, pool, ChatIncrements(tokenizer), engine, BUDGET)
    assert metrics["timing_s/multi_turn"] >= 0.6
    assert metrics["multi_turn/engine_idle_s"] < 0.2


class SlowCloseEnv(KeyEnv):
    def close(self):
        time.sleep(0.2)


def test_the_next_call_reuses_the_workers_the_last_one_closed():
    """The call ends only once its workers' closes are acknowledged: run 22's benchmark
    forked workers for every rollout while the last rollout's were still closing."""
    tokenizer = make_chat_tokenizer("qwen2.5")
    records = [{"id": i, "key": 7} for i in range(4)]
    pool = EnvironmentPool(SlowCloseEnv, name="t", timeout_s=3.0, max_concurrent=0)
    try:
        forked = []
        for _ in range(2):
            engine = FakeEngine(tokenizer, calls_then_answer(1))
            trajs, metrics = run_trajectories(
                records, 1, pool, ChatIncrements(tokenizer), engine, BUDGET
            )
            assert [t.finish_reason for t in trajs] == ["done"] * 4
            assert all(w.call is None and w.traj_id is None for w in pool._workers)
            forked.append(metrics["multi_turn/env_workers_forked"])
        assert forked == [4.0, 0.0] and pool.forks == 4
    finally:
        pool.shutdown()


# --------------------------------------------------------------------------- config

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"
ONE_RANK = ["parallel.tp=1", "rollout.tp=1"]


def test_dump_rollouts_is_accepted_for_single_turn_runs():
    config = load_config(TINY, ONE_RANK + ["trainer.dump_rollouts=true"])
    assert config.trainer.dump_rollouts is True
    validate(config, world_size=1)  # records are written (trainer/rollout_records.py)


def test_multi_turn_config_defaults_and_budget():
    config = load_config(TINY, ONE_RANK)
    assert config.environment.function is None  # single-turn, today's behaviour
    assert config.trainer.dump_rollouts is False
    config = load_config(
        TINY,
        ONE_RANK
        + ["environment.function=my_env.py:Lookup", "rollout.multi_turn.max_turns=3",
           "rollout.max_prompt_length=40", "rollout.max_response_length=20"],
    )  # fmt: skip
    validate(config, world_size=1)  # every limit in range
    budget = TurnBudget.from_config(config.rollout)
    assert budget == TurnBudget(max_turns=3, max_turn_tokens=20, max_total_tokens=60)
    config.rollout.multi_turn.max_turn_tokens = 8
    assert TurnBudget.from_config(config.rollout).max_turn_tokens == 8


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["environment.timeout_s=0"], "environment.timeout_s: must be > 0, got 0"),
        (["environment.timeout_s=900", "parallel.timeout_s=1800"],
         "environment.timeout_s: 900 must be below half of parallel.timeout_s=1800"),
        (["environment.max_concurrent=-1"], "environment.max_concurrent: must be >= 0"),
        (["rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns: must be >= 1, got 0"),
        (["rollout.multi_turn.max_turn_tokens=10000"],
         "rollout.multi_turn.max_turn_tokens: 10000 must be in [1, rollout.max_response_length="),
        (["reward.type=model", "reward.model_path=/rm"],
         "reward.type: 'model' with environment.function: a reward model does not score"),
    ],
)  # fmt: skip
def test_multi_turn_config_checks_name_the_key(overrides, expected):
    """Each refusal is one line naming the key."""
    config = load_config(TINY, ONE_RANK + ["environment.function=my_env.py:Lookup", *overrides])
    with pytest.raises(ConfigError) as info:
        validate(config, world_size=1)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_a_null_reward_function_needs_an_environment():
    """reward.function: null means "the environment's reward alone": without an
    environment there would be no reward at all."""
    config = load_config(TINY, ONE_RANK + ["reward.function=null"])
    with pytest.raises(ConfigError, match=r"^reward.function: null needs environment.function"):
        validate(config, world_size=1)
    config.environment.function = "my_env.py:Lookup"
    validate(config, world_size=1)
