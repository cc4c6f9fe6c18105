"""environments/loader.py and workers.py: the class a config names, run per trajectory in
forked workers; a raise, a hang, an exit or garbage ends only its own trajectory."""

from __future__ import annotations

import math
import os
import re
import time

import pytest

from rl_megatron.environments.base import Environment, Observation
from rl_megatron.environments.loader import BUILTIN, EnvironmentLoadError, load_environment
from rl_megatron.environments.workers import (
    CUT_MARK,
    EnvironmentCallError,
    EnvironmentPool,
    check_messages,
    check_observation,
)


class Counter(Environment):
    """Answers each turn with the turn's number; state is per trajectory."""

    def __init__(self, scale: float = 1.0) -> None:
        self.turn, self.scale, self.pid = 0, scale, os.getpid()

    def start(self, sample):
        self.key = sample["key"]
        return [{"role": "user", "content": f"key {self.key}"}]

    def step(self, response):
        self.turn += 1
        behaviour = self.key
        if behaviour == "raise":
            raise KeyError("no such tool")
        elif behaviour == "hang":
            time.sleep(60)
        if behaviour == "exit":
            os._exit(3)
        if behaviour == "not_obs":
            return "result 3"
        if behaviour == "nan":
            return Observation(reward=math.nan)
        if behaviour == "no_content":
            return Observation(messages=[{"role": "tool"}])
        if behaviour == "huge":
            return Observation(messages=[{"role": "tool", "content": "x" * 1_000_000}])
        return Observation(
            messages=[{"role": "tool", "content": f"{response} {self.turn} {os.getpid()}"}],
            reward=self.scale * self.turn,
            metrics={"tool_calls": 1},
        )


def collect(pool: EnvironmentPool, want: int, timeout_s: float = 20.0) -> dict:
    """Results of `want` calls, by trajectory."""
    out, end = {}, time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < end:
        for traj_id, result in pool.ready(0.5):
            out[traj_id] = result
    assert len(out) == want, f"only {sorted(out)} within {timeout_s} s"
    return out


@pytest.fixture
def pool():
    p = EnvironmentPool(Counter, name="test:Counter", timeout_s=2.0, max_concurrent=4)
    yield p
    p.shutdown()


def test_start_step_close_round_trip_and_worker_reuse(pool):
    pool.start("a", {"key": "ok"})
    assert collect(pool, 1) == {"a": [{"role": "user", "content": "key ok"}]}
    for turn in (1, 2):
        pool.step("a", "look up")
        obs = collect(pool, 1)["a"]
        assert isinstance(obs, Observation) and obs.reward == turn  # the instance's state
        assert obs.metrics == {"tool_calls": 1.0}
        text, number, pid = obs.messages[0]["content"].rsplit(" ", 2)
        assert (text, number) == ("look up", str(turn)) and int(pid) != os.getpid()
    pool.close("a")
    assert pool.ready(0.3) == []  # the close's acknowledgement frees the worker
    pool.start("b", {"key": "ok"})  # reuses the worker, with a fresh instance
    collect(pool, 1)
    pool.step("b", "again")
    obs = collect(pool, 1)["b"]
    assert obs.reward == 1 and obs.messages[0]["content"].rsplit(" ", 1)[1] == pid
    assert pool.forks == 1 and pool.seconds["a"] > 0


def test_kwargs_reach_the_instance():
    pool = EnvironmentPool(
        Counter, name="t", timeout_s=2.0, max_concurrent=1, kwargs={"scale": 0.25}
    )
    try:
        pool.start(0, {"key": "ok"})
        collect(pool, 1)
        pool.step(0, "x")
        assert collect(pool, 1)[0].reward == 0.25
    finally:
        pool.shutdown()


@pytest.mark.parametrize(
    "key, expected, timeout",
    [
        ("raise", "step: KeyError: 'no such tool'", False),
        ("hang", "step gave no result within environment.timeout_s=2 (the call was stopped)", True),
        ("exit", "the environment worker process died during step (exit code 3)", False),
        ("not_obs", "step returned str, not an Observation", False),
        ("nan", "step's Observation: reward or metric returned nan, not a finite", False),
        ("no_content", "step's Observation.messages: message 0 has no string 'content'", False),
    ],
)  # fmt: skip
def test_a_failing_environment_ends_only_its_trajectory(pool, key, expected, timeout):
    pool.start("bad", {"key": key})
    pool.start("good", {"key": "ok"})
    collect(pool, 2)
    pool.step("bad", "x")
    pool.step("good", "y")
    results = collect(pool, 2, timeout_s=10)
    error = results["bad"]
    assert isinstance(error, EnvironmentCallError) and str(error).startswith(expected)
    assert "\n" not in str(error) and error.timeout is timeout
    assert isinstance(results["good"], Observation) and results["good"].reward == 1
    assert (pool.errors, pool.timeouts) == (1, int(timeout))
    # The good trajectory goes on in its own worker, state intact.
    pool.step("good", "z")
    assert collect(pool, 1)["good"].reward == 2
    # A later trajectory gets a worker (a fresh one where the bad one was killed).
    pool.close("bad")
    pool.start("next", {"key": "ok"})
    assert collect(pool, 1)["next"] == [{"role": "user", "content": "key ok"}]


def test_a_worker_killed_between_calls_fails_the_next_call(pool):
    import signal

    pool.start(0, {"key": "ok"})
    collect(pool, 1)
    os.kill(pool._owner[0].pid, signal.SIGKILL)  # the OOM killer, say
    time.sleep(0.1)
    pool.step(0, "x")
    error = collect(pool, 1)[0]
    assert str(error) == "the environment worker process died during step (killed by SIGKILL)"


def test_garbage_from_start_is_one_line():
    class BadStart(Environment):
        def start(self, sample):
            return {"role": "user", "content": "not a list"}

        def step(self, response):
            return Observation()

    pool = EnvironmentPool(BadStart, name="t", timeout_s=2.0, max_concurrent=1)
    try:
        pool.start(0, {})
        error = collect(pool, 1)[0]
        assert str(error) == "start returned dict, not a list of message dicts"
    finally:
        pool.shutdown()


def test_a_factory_whose_instance_lacks_step_is_one_line():
    pool = EnvironmentPool(lambda: object(), name="f.py:make", timeout_s=2.0, max_concurrent=1)
    try:
        pool.start(0, {})
        assert str(collect(pool, 1)[0]) == (
            "start: EnvironmentLoadError: environment.function: 'f.py:make': object has no "
            "start or step method (subclass rl_megatron.environments.Environment)"
        )
    finally:
        pool.shutdown()


def test_a_huge_observation_is_cut_and_marked(pool):
    pool.start("h", {"key": "huge"})
    collect(pool, 1)
    pool.step("h", "x")
    obs = collect(pool, 1)["h"]
    content = obs.messages[0]["content"]
    assert content == "x" * 16384 + CUT_MARK.format(1_000_000 - 16384)
    assert obs.metrics["observations_cut"] == 1.0


def test_the_observation_budget_counts_all_messages_and_cuts_only_past_it():
    def observe(max_chars):
        two = [{"role": "tool", "content": "abcd"}, {"role": "tool", "content": "efgh"}]
        return check_observation(Observation(messages=two, reward=0.5), max_chars)

    exact = observe(8)  # the two messages fill the budget exactly: nothing is cut
    assert [m["content"] for m in exact.messages] == ["abcd", "efgh"]
    assert "observations_cut" not in exact.metrics and exact.reward == 0.5
    short = observe(6)  # the second message keeps what is left after the first
    assert [m["content"] for m in short.messages] == ["abcd", "ef" + CUT_MARK.format(2)]
    assert short.metrics["observations_cut"] == 1.0
    cut_first = observe(3)
    assert [m["content"] for m in cut_first.messages] == ["abc", CUT_MARK.format(5)]


def test_messages_must_be_a_list_of_dicts_with_string_role_and_content():
    good = [{"role": "user", "content": "hi"}]
    assert check_messages(good, "start") == good
    for value, error in (
        ("hi", "start returned str, not a list of message dicts"),
        (good + ["hi"], "start returned list, not a list of message dicts"),
        ([{"role": "user"}], "start: message 0 has no string 'content' (None)"),
        ([{"role": 1, "content": "x"}], "start: message 0 has no string 'role' (1)"),
    ):
        with pytest.raises(EnvironmentCallError, match=re.escape(error)):
            check_messages(value, "start")


def test_at_most_max_concurrent_workers_the_rest_queue():
    pool = EnvironmentPool(Counter, name="t", timeout_s=5.0, max_concurrent=2)
    try:
        for i in range(5):
            pool.start(i, {"key": "ok"})
        assert pool.pending == 5 and pool.forks == 2 and pool.waited == 3
        first = collect(pool, 2)
        assert sorted(first) == [0, 1]
        assert pool.ready(0.3) == []  # the queue waits for a close
        pool.close(0)
        assert list(collect(pool, 1)) == [2]
        assert pool.forks == 2
    finally:
        pool.shutdown()


def test_no_cap_forks_one_worker_per_trajectory_and_none_waits():
    pool = EnvironmentPool(Counter, name="t", timeout_s=5.0, max_concurrent=0)
    try:
        for i in range(6):
            pool.start(i, {"key": "ok"})
        assert pool.forks == 6 and pool.waited == 0
        assert sorted(collect(pool, 6)) == list(range(6))
        pool.close(3)
        assert pool.ready(0.5) == []  # the close's acknowledgement frees the worker
        pool.start(6, {"key": "ok"})  # the freed worker is reused, not a seventh fork
        assert list(collect(pool, 1)) == [6] and pool.forks == 6
    finally:
        pool.shutdown()


class Closing(Counter):
    """Counter whose close takes 0.3 s, or hangs for key "hang_close"."""

    def close(self):
        time.sleep(60 if self.key == "hang_close" else 0.3)


def test_wait_for_closes_frees_the_workers_and_kills_a_hung_close():
    pool = EnvironmentPool(Closing, name="t", timeout_s=1.0, max_concurrent=0)
    try:
        for i, key in enumerate(["ok", "ok", "hang_close"]):
            pool.start(i, {"key": key})
        collect(pool, 3)
        for i in range(3):
            pool.close(i)
        started = time.monotonic()
        pool.wait_for_closes()
        waited = time.monotonic() - started
        assert 0.9 <= waited < 5.0  # the hung close's 1 s limit, not its 60 s
        assert len(pool._workers) == 2 and pool.timeouts == 0  # a close is not a call
        assert all(w.call is None and w.traj_id is None for w in pool._workers)
        for i in range(3, 5):
            pool.start(i, {"key": "ok"})
        assert pool.forks == 3  # the two freed workers took the new trajectories
    finally:
        pool.shutdown()


def test_the_worker_ignores_sigterm_and_dies_with_a_kill(pool):
    import signal

    pool.start(0, {"key": "ok"})
    collect(pool, 1)
    pid = pool._owner[0].pid
    os.kill(pid, signal.SIGTERM)  # Slurm's SIGTERM reaches the trainer, not the worker
    pool.step(0, "still here")
    assert collect(pool, 1)[0].reward == 1
    pool.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --------------------------------------------------------------------------- loader


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_loader_file_module_and_builtin_names(tmp_path, monkeypatch):
    env_file = write(
        tmp_path,
        "my_env.py",
        "from rl_megatron.environments.base import Environment\n"
        "class Lookup(Environment):\n"
        "    def start(self, sample): return []\n"
        "    def step(self, response): return None\n",
    )
    cls = load_environment(f"{env_file}:Lookup")
    assert cls.__name__ == "Lookup" and issubclass(cls, Environment)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_environment("my_env:Lookup").__name__ == "Lookup"
    assert BUILTIN["tool_calling"] == "rl_megatron.environments.tool_env:ToolEnvironment"


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("nowhere.py:Env", "environment.function: file not found: nowhere.py"),
        ("{dir}/my_env2.py:Missing", "environment.function: '{dir}/my_env2.py' has no attribute 'Missing'"),
        ("{dir}/my_env2.py:VALUE", "environment.function: '{dir}/my_env2.py:VALUE' is a int, not a class or callable"),
        ("{dir}/my_env2.py:NoStep", "environment.function: '{dir}/my_env2.py:NoStep': NoStep has no step method"),
        ("{dir}/broken.py:Env", "environment.function: cannot import '{dir}/broken.py' for '{dir}/broken.py:Env' (ZeroDivisionError: division by zero)"),
        ("no_colon", "environment.function: 'no_colon' must look like 'path/to/file.py:Name'"),
    ],
)  # fmt: skip
def test_loader_errors_are_one_line_naming_the_key(tmp_path, spec, expected):
    write(tmp_path, "my_env2.py", "VALUE = 3\nclass NoStep:\n    def start(self, s): return []\n")
    write(tmp_path, "broken.py", "1 / 0\n")
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment(spec.format(dir=tmp_path))
    message = str(info.value)
    assert message.startswith(expected.format(dir=tmp_path)) and "\n" not in message
