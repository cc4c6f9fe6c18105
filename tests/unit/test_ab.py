"""benchmarks/ab.py: interleaving order, per-round ratios, median and spread, the verdict."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ab import ABResult, interleave, round_order, settle, target_record  # noqa: E402


class FakeClock:
    """A clock that only moves when a fake call says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_calls(clock: FakeClock, a_times: list[float], b_times: list[float], log: list[str]):
    """Callables that log their name and advance the clock by their next duration."""
    a_iter, b_iter = iter(a_times), iter(b_times)

    def a() -> str:
        log.append("a")
        clock.now += next(a_iter)
        return f"a{len(log)}"

    def b() -> str:
        log.append("b")
        clock.now += next(b_iter)
        return f"b{len(log)}"

    return a, b


def test_alternates_who_goes_first_and_syncs_around_every_call():
    clock, log, syncs = FakeClock(), [], []
    a, b = fake_calls(clock, [1.0] * 5, [1.0] * 5, log)
    r = interleave(a, b, repeats=3, warmup=2, sync=lambda: syncs.append(len(log)), clock=clock)
    # Rounds 0..4 (two warm-ups): A first in even rounds.
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert r.a_first == [True, False, True]  # the timed rounds are rounds 2, 3, 4
    # One sync before and one after each of the 10 calls.
    assert syncs == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10]
    # The last timed round (round 4) ran A then B: B's call was the 10th.
    assert (r.last_a, r.last_b) == ("a9", "b10")


def test_times_ratios_median_and_spread():
    clock, log = FakeClock(), []
    # Warm-up round first (slow, kept apart), then three timed rounds.
    a_times = [9.0, 2.0, 1.0, 4.0]
    b_times = [7.0, 1.0, 1.5, 2.0]
    a, b = fake_calls(clock, a_times, b_times, log)
    r = interleave(a, b, repeats=3, warmup=1, clock=clock)
    assert r.warmup_a_s == [9.0] and r.warmup_b_s == [7.0]
    assert r.a_s == [2.0, 1.0, 4.0] and r.b_s == [1.0, 1.5, 2.0]
    assert r.ratios == [0.5, 1.5, 0.5]  # time(B) / time(A): A's speed in B's
    assert r.ratio_median == 0.5
    assert (r.ratio_min, r.ratio_max) == (0.5, 1.5)
    d = r.as_dict(work=12.0)
    assert d["a_per_s"] == [6.0, 12.0, 3.0]
    assert d["a_per_s_median"] == 12.0 / statistics.median(a_times[1:])
    assert d["b_per_s_median"] == 12.0 / 1.5
    assert d["repeats"] == 3 and d["ratio_median"] == 0.5


def test_median_of_even_count_is_the_mean_of_the_middle_two():
    r = ABResult(a_s=[1.0, 1.0, 1.0, 1.0], b_s=[0.9, 1.0, 1.2, 0.5], a_first=[True] * 4)
    assert r.ratio_median == pytest.approx(0.95)


def test_verdict_flips_when_the_worst_round_crosses_the_bound():
    # Median 1.0 in both; only the worst round differs.
    ok = ABResult(a_s=[1.0] * 5, b_s=[1.0, 1.0, 1.1, 0.96, 1.2], a_first=[True] * 5)
    bad = ABResult(a_s=[1.0] * 5, b_s=[1.0, 1.0, 1.1, 0.94, 1.2], a_first=[True] * 5)
    assert ok.ratio_median == bad.ratio_median == 1.0
    assert ok.met(0.98, 0.95) is True
    assert bad.met(0.98, 0.95) is False
    # A median below the target fails even with every round above the worst bound.
    low = ABResult(a_s=[1.0] * 3, b_s=[0.97, 0.97, 0.99], a_first=[True] * 3)
    assert low.met(0.98, 0.95) is False
    # "At most" targets look at the maximum.
    assert ok.met(1.1, 1.2, higher_is_better=False) is True
    assert ok.met(1.1, 1.15, higher_is_better=False) is False


def test_target_record_carries_the_verdict():
    r = ABResult(a_s=[1.0, 1.0, 1.0], b_s=[1.0, 0.99, 0.9], a_first=[True, False, True])
    rec = target_record("x", r, 0.98, 0.95, command="cmd", json_path="p.json")
    assert rec["ratio_median"] == 0.99 and rec["ratio_min"] == 0.9 and rec["met"] is False
    assert rec["command"] == "cmd" and rec["json"] == "p.json" and rec["repeats"] == 3


def test_pause_runs_before_every_call_outside_its_time():
    clock, log = FakeClock(), []
    a, b = fake_calls(clock, [1.0, 2.0], [3.0, 4.0], log)

    def pause() -> None:
        log.append("pause")
        clock.now += 100.0

    r = interleave(a, b, repeats=1, warmup=1, clock=clock, pause=pause)
    assert log == ["pause", "a", "pause", "b", "pause", "b", "pause", "a"]
    assert (r.a_s, r.b_s) == ([2.0], [4.0])


def test_rejects_no_repeats():
    with pytest.raises(ValueError, match="repeats"):
        interleave(lambda: None, lambda: None, repeats=0)


# Longer rounds (calls_per_round): the order inside a round, sums, per-call times, drift.


def test_round_order_pairs_follow_thue_morse_and_swap_when_b_opens():
    assert (round_order(1, True), round_order(1, False)) == ("ab", "ba")  # the original
    assert (round_order(2, True), round_order(2, False)) == ("abba", "baab")
    assert round_order(3, True) == "abbaba"
    assert round_order(4, True) == "abbabaab"
    for k in range(1, 9):
        order = round_order(k, k % 2 == 0)
        assert len(order) == 2 * k and order.count("a") == k


def test_calls_inside_rounds_alternate_and_each_is_synced_on_its_own():
    clock, log, syncs = FakeClock(), [], []
    a, b = fake_calls(clock, [1.0] * 7, [1.0] * 7, log)

    def sync() -> None:
        syncs.append(len(log))

    r = interleave(a, b, repeats=3, warmup=1, sync=sync, clock=clock, calls_per_round=2)
    # Warm-up round 0: one call each, A first; then rounds 1..3 of two calls each, opened
    # by B in odd rounds.
    assert "".join(log) == "ab" + "baab" + "abba" + "baab"
    assert r.a_first == [False, True, False]
    assert syncs == [n for i in range(len(log)) for n in (i, i + 1)]
    assert (r.last_a, r.last_b) == ("a13", "b14")  # round 3 ran B A A B


def test_a_round_is_the_sum_of_its_calls_and_each_call_is_kept():
    clock, log = FakeClock(), []
    # Warm-up (one call each), then two rounds of three calls each, in call order of
    # each engine: round 1 is B-opened ("baabab"), round 2 A-opened ("abbaba").
    a_times = [9.0, 1.0, 2.0, 4.0, 0.5, 0.25, 0.25]
    b_times = [7.0, 3.0, 3.0, 2.0, 1.0, 1.0, 2.0]
    a, b = fake_calls(clock, a_times, b_times, log)
    r = interleave(a, b, repeats=2, warmup=1, clock=clock, calls_per_round=3)
    assert "".join(log) == "ab" + "baabab" + "abbaba"
    assert (r.warmup_a_s, r.warmup_b_s) == ([9.0], [7.0])
    assert r.a_call_s == [[1.0, 2.0, 4.0], [0.5, 0.25, 0.25]]
    assert r.b_call_s == [[3.0, 3.0, 2.0], [1.0, 1.0, 2.0]]
    assert (r.a_s, r.b_s) == ([7.0, 1.0], [8.0, 4.0])
    assert r.ratios == [8.0 / 7.0, 4.0]  # sum(B) / sum(A) per round
    d = r.as_dict(work=10.0)  # work per call: a round does 3 × 10
    assert d["calls_per_round"] == 3 and d["repeats"] == 2
    assert d["a_call_s"] == r.a_call_s and d["b_call_s"] == r.b_call_s
    assert d["a_per_s"] == [30.0 / 7.0, 30.0] and d["b_per_s"] == [30.0 / 8.0, 7.5]
    assert target_record("x", r, 0.98, 0.95)["calls_per_round"] == 3


def drifting_ratios(calls_per_round: int, drift, repeats: int = 4) -> list[float]:
    """Per-round ratios of two calls of equal work whose time drifts with the call's
    position in the run (`drift(i)`: seconds of the i-th call, warm-ups included)."""
    clock, count = FakeClock(), [0]

    def call() -> None:
        clock.now += drift(count[0])
        count[0] += 1

    r = interleave(call, call, repeats, warmup=1, clock=clock, calls_per_round=calls_per_round)
    return r.ratios


def test_the_order_cancels_a_linear_drift_within_every_round():
    def linear(i: int) -> float:  # dyadic steps: the sums are exact in floating point
        return 1.0 + 0.125 * i

    assert drifting_ratios(2, linear) == [1.0] * 4
    assert drifting_ratios(4, linear) == [1.0] * 4
    assert drifting_ratios(6, linear) == [1.0] * 4
    # One call per round (and any odd count) keeps a one-position lag, alternating in sign.
    one = drifting_ratios(1, linear)
    assert one[0] < 1.0 < one[1] and one[2] < 1.0 < one[3]
    assert all(x != 1.0 for x in drifting_ratios(3, linear))


def test_four_calls_per_round_cancel_a_quadratic_drift_too():
    def quadratic(i: int) -> float:
        return 1.0 + 0.125 * i + 0.0625 * i * i

    assert drifting_ratios(4, quadratic) == [1.0] * 4
    assert drifting_ratios(8, quadratic) == [1.0] * 4
    assert all(x != 1.0 for x in drifting_ratios(2, quadratic))


def test_rejects_fewer_than_one_call_per_round():
    with pytest.raises(ValueError, match="calls_per_round must be >= 1, got 0"):
        interleave(lambda: None, lambda: None, repeats=3, calls_per_round=0)


def test_on_round_sees_every_timed_round_as_it_ends():
    """A benchmark writes its JSON in `on_round`: after round k it holds k rounds' times
    (the warm-up none), so a run cut short keeps what it finished."""
    clock, log = FakeClock(), []
    a, b = fake_calls(clock, [9.0, 1.0, 2.0, 3.0], [9.0, 2.0, 4.0, 9.0], log)
    seen: list[tuple[list[float], list[float]]] = []
    result = interleave(
        a, b, 3, warmup=1, clock=clock, on_round=lambda r: seen.append((r.a_s[:], r.b_s[:]))
    )
    assert seen == [([1.0], [2.0]), ([1.0, 2.0], [2.0, 4.0]), ([1.0, 2.0, 3.0], [2.0, 4.0, 9.0])]
    assert result.ratios == [2.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "times, tolerance, max_calls, expected",
    [
        # slow, fast, slow again (run 25b's pattern), then two that agree: stops there
        ([43.5, 19.3, 30.6, 19.3, 19.4, 99.0], 0.1, 8, [43.5, 19.3, 30.6, 19.3, 19.4]),
        # the bound: 10 % of the faster call is 2.0; 22.0 against 20.0 settles, 22.1 not
        ([20.0, 22.0, 5.0], 0.1, 8, [20.0, 22.0]),
        ([20.0, 22.1, 22.0], 0.1, 8, [20.0, 22.1, 22.0]),
        # never settles: max_calls ends it; 0 calls none
        ([10.0, 30.0, 10.0, 30.0], 0.1, 3, [10.0, 30.0, 10.0]),
        ([10.0, 10.0], 0.1, 0, []),
    ],
)
def test_settle_repeats_until_two_calls_agree(times, tolerance, max_calls, expected):
    clock, log = FakeClock(), []
    durations = iter(times)

    def call() -> None:
        clock.now += next(durations)

    seconds = settle(
        call, tolerance, max_calls, clock=clock, log=lambda n, took: log.append((n, took))
    )
    assert seconds == pytest.approx(expected)
    assert [n for n, _ in log] == list(range(1, len(expected) + 1))
