"""Interleaved A/B timing: the one way a benchmark here measures a speed ratio.

Two engines timed one after the other (all of A, then all of B) see different machines:
another process's load, clock boosts, the allocator's state. Their ratio does not survive a
rerun (issue 21: 1.20× in one run, 0.81× in the next). Here both run in one process, in
rounds: A B, then B A, then A B, … (which goes first alternates, so that neither always
runs right after the other's warm caches or right after a pause), every call between two
`sync()`s. Each round gives one ratio, so what a run reports is a median with its spread.

Ratio of a round = time(B) / time(A): A's speed as a multiple of B's (A's tokens/s ÷ B's
when both calls do the same work). Put the candidate in A and the baseline in B.

A target is **met** only when the median reaches it and the worst round still reaches the
worst-round bound (`ABResult.met`): a spread that straddles the target is not a pass.

Longer rounds (`calls_per_round=K`): where one call is short against the host's noise (a
1 s vLLM call on an H200 spreads ±25 %, and its neighbours drift together), a round runs
K calls of each, interleaved inside the round in the order `round_order` gives (A B B A
for K = 2, A B B A B A A B for K = 4), each call between its own two `sync()`s. The
round's time of A is the sum of its K calls (per-call times are kept: `a_call_s`), so its
ratio is sum(B) / sum(A). The order cancels a drift that grows linearly from call to call
within each round when K is even; which engine opens a round alternates between rounds.

    from ab import interleave
    r = interleave(lambda: engine_a(...), lambda: engine_b(...), repeats=5,
                   sync=torch.cuda.synchronize, calls_per_round=2)
    r.ratio_median, r.ratio_min, r.ratio_max, r.met(0.98, 0.95)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _no_sync() -> None:
    pass


def _timed_call(
    fn: Callable[[], Any], sync: Callable[[], None], clock: Callable[[], float]
) -> tuple[float, Any]:
    """`fn()`'s seconds, `sync` before and after so that the clock covers the device's
    work, and its output."""
    sync()
    start = clock()
    out = fn()
    sync()
    return clock() - start, out


def meets(
    median: float,
    lo: float,
    hi: float,
    target: float,
    worst_target: float,
    higher_is_better: bool = True,
) -> bool:
    """The rule: the median reaches `target` and the worst round `worst_target`."""
    if higher_is_better:
        return median >= target and lo >= worst_target
    return median <= target and hi <= worst_target


def round_order(calls_per_round: int, a_first: bool) -> str:
    """The calls of one round, e.g. "abba": `calls_per_round` pairs, pair j run as "ab"
    when the Thue–Morse bit of j (the parity of its set bits) is 0, else as "ba"; all
    swapped when B opens the round.

    Why this order: a call's time drifts slowly with the host (consecutive calls are
    correlated), and a drift linear in the call's position adds to each engine's sum in
    proportion to the sum of its positions. Pairs "ab" and "ba" alternating as the
    Thue–Morse bits do give A and B equal position sums whenever the pairs are even in
    number (ABBA: 0 + 3 = 1 + 2), so a linear drift cancels within every round, and equal
    sums of squared positions too when they are a multiple of four (ABBA BAAB, Prouhet),
    so a quadratic one cancels as well. Plain alternation (ABAB) always leaves B one
    position per pair later. With an odd count a difference of one position is left, as
    in a one-call round, but its share of the round's time is 1/K and its sign alternates
    from round to round. One call per round gives "ab" / "ba": the original rounds.
    """
    pairs = [("ab" if bin(j).count("1") % 2 == 0 else "ba") for j in range(calls_per_round)]
    order = "".join(pairs)
    return order if a_first else order.translate(str.maketrans("ab", "ba"))


@dataclass
class ABResult:
    """Per-round times (seconds) of A and B, which ran first, and the last outputs."""

    a_s: list[float]  # round k: the sum of A's calls in it
    b_s: list[float]
    a_first: list[bool]  # round k: True if A opened it
    warmup_a_s: list[float] = field(default_factory=list)
    warmup_b_s: list[float] = field(default_factory=list)
    last_a: Any = None  # what A's last timed call returned
    last_b: Any = None
    calls_per_round: int = 1  # timed calls of each engine in a round
    # Round k: each of A's calls in it, in call order (empty when built from round times).
    a_call_s: list[list[float]] = field(default_factory=list)
    b_call_s: list[list[float]] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Per round: time(B) / time(A), A's speed as a multiple of B's."""
        return [b / a for a, b in zip(self.a_s, self.b_s)]

    @property
    def ratio_median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def ratio_min(self) -> float:
        return min(self.ratios)

    @property
    def ratio_max(self) -> float:
        return max(self.ratios)

    def met(self, target: float, worst_target: float, higher_is_better: bool = True) -> bool:
        """Median on the right side of `target` and the worst round of `worst_target`.

        higher_is_better: True for "A at least target× B" (worst round: the minimum);
            False for "at most" targets (worst round: the maximum).
        """
        return meets(
            self.ratio_median,
            self.ratio_min,
            self.ratio_max,
            target,
            worst_target,
            higher_is_better,
        )

    def as_dict(self, work: float | None = None) -> dict[str, Any]:
        """JSON-ready numbers; `work` (e.g. tokens per call) adds A's and B's rates (per
        round: `calls_per_round` calls' work over the round's time)."""
        out: dict[str, Any] = {
            "repeats": len(self.a_s),
            "calls_per_round": self.calls_per_round,
            "a_s": self.a_s,
            "b_s": self.b_s,
            "a_call_s": self.a_call_s,
            "b_call_s": self.b_call_s,
            "a_first": self.a_first,
            "warmup_a_s": self.warmup_a_s,
            "warmup_b_s": self.warmup_b_s,
            "ratios": self.ratios,
            "ratio_median": self.ratio_median,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
        }
        if work is not None:
            round_work = work * self.calls_per_round
            out["a_per_s"] = [round_work / t for t in self.a_s]
            out["b_per_s"] = [round_work / t for t in self.b_s]
            out["a_per_s_median"] = round_work / statistics.median(self.a_s)
            out["b_per_s_median"] = round_work / statistics.median(self.b_s)
        return out


def settle(
    call: Callable[[], Any],
    tolerance: float,
    max_calls: int,
    *,
    sync: Callable[[], None] = _no_sync,
    clock: Callable[[], float] = time.perf_counter,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Seconds of each `call()`, repeated until two in a row are within `tolerance` of
    each other (relative to the faster) or `max_calls` ran. For an engine whose first
    calls are slow an unknown number of times (fp8_rollout.py), before `interleave`."""
    seconds: list[float] = []
    while len(seconds) < max_calls:
        seconds.append(_timed_call(call, sync, clock)[0])
        if log is not None:
            log(len(seconds), seconds[-1])
        if len(seconds) >= 2 and abs(seconds[-1] - seconds[-2]) <= tolerance * min(seconds[-2:]):
            break
    return seconds


def interleave(
    a: Callable[[], Any],
    b: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    sync: Callable[[], None] = _no_sync,
    clock: Callable[[], float] = time.perf_counter,
    pause: Callable[[], None] | None = None,
    calls_per_round: int = 1,
    on_round: Callable[[ABResult], None] | None = None,
) -> ABResult:
    """Time `a` and `b` in `repeats` rounds, alternating which goes first.

    warmup: untimed-for-the-ratio rounds before (CUDA graphs, caches, allocator), one call
        of each whatever `calls_per_round` (the first call is what warms); their times are
        kept in the result. Round k (warm-ups included) is opened by A when k is even.
    sync: called before and after every call (e.g. `torch.cuda.synchronize`) so that the
        clock covers the device's work.
    clock: seconds, monotonic (tests pass a fake).
    pause: called before every call, outside its time (e.g. a sleep that lets the other
        engine's idle threads stop spinning, or `gc.collect`).
    calls_per_round: timed calls of each engine in a round, in `round_order`; a round's
        time is the sum of its calls, each timed on its own.
    on_round: called with the result so far after every timed round (a benchmark writes
        its JSON there, so a run its call's limit cuts short keeps the rounds it finished).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if calls_per_round < 1:
        raise ValueError(f"calls_per_round must be >= 1, got {calls_per_round}")

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        if pause is not None:
            pause()
        return _timed_call(fn, sync, clock)

    result = ABResult(a_s=[], b_s=[], a_first=[], calls_per_round=calls_per_round)
    for k in range(warmup + repeats):
        a_first = k % 2 == 0
        order = round_order(1 if k < warmup else calls_per_round, a_first)
        seconds: dict[str, list[float]] = {"a": [], "b": []}
        outputs: dict[str, Any] = {}
        for name in order:
            took, outputs[name] = timed(a if name == "a" else b)
            seconds[name].append(took)
        if k < warmup:
            result.warmup_a_s.append(seconds["a"][0])
            result.warmup_b_s.append(seconds["b"][0])
            continue
        result.a_s.append(sum(seconds["a"]))
        result.b_s.append(sum(seconds["b"]))
        result.a_call_s.append(seconds["a"])
        result.b_call_s.append(seconds["b"])
        result.a_first.append(a_first)
        result.last_a, result.last_b = outputs["a"], outputs["b"]
        if on_round is not None:
            on_round(result)
    return result


def target_record(
    name: str,
    result: ABResult,
    target: float,
    worst_target: float,
    *,
    higher_is_better: bool = True,
    command: str = "",
    json_path: str = "",
) -> dict[str, Any]:
    """One row of `headline.py`'s table: what a benchmark JSON lists under "targets"."""
    return {
        "name": name,
        "ratio_median": result.ratio_median,
        "ratio_min": result.ratio_min,
        "ratio_max": result.ratio_max,
        "repeats": len(result.a_s),
        "calls_per_round": result.calls_per_round,
        "target": target,
        "worst_target": worst_target,
        "higher_is_better": higher_is_better,
        "met": result.met(target, worst_target, higher_is_better),
        "command": command,
        "json": json_path,
    }
