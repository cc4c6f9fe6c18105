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

    from ab import interleave
    r = interleave(lambda: engine_a(...), lambda: engine_b(...), repeats=5,
                   sync=torch.cuda.synchronize)
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


@dataclass
class ABResult:
    """Per-round times (seconds) of A and B, which ran first, and the last outputs."""

    a_s: list[float]
    b_s: list[float]
    a_first: list[bool]  # round k: True if A ran before B
    warmup_a_s: list[float] = field(default_factory=list)
    warmup_b_s: list[float] = field(default_factory=list)
    last_a: Any = None  # what A's last timed call returned
    last_b: Any = None

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
        """JSON-ready numbers; `work` (e.g. tokens per call) adds A's and B's rates."""
        out: dict[str, Any] = {
            "repeats": len(self.a_s),
            "a_s": self.a_s,
            "b_s": self.b_s,
            "a_first": self.a_first,
            "warmup_a_s": self.warmup_a_s,
            "warmup_b_s": self.warmup_b_s,
            "ratios": self.ratios,
            "ratio_median": self.ratio_median,
            "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max,
        }
        if work is not None:
            out["a_per_s"] = [work / t for t in self.a_s]
            out["b_per_s"] = [work / t for t in self.b_s]
            out["a_per_s_median"] = work / statistics.median(self.a_s)
            out["b_per_s_median"] = work / statistics.median(self.b_s)
        return out


def interleave(
    a: Callable[[], Any],
    b: Callable[[], Any],
    repeats: int,
    *,
    warmup: int = 1,
    sync: Callable[[], None] = _no_sync,
    clock: Callable[[], float] = time.perf_counter,
    pause: Callable[[], None] | None = None,
) -> ABResult:
    """Time `a` and `b` in `repeats` rounds, alternating which goes first.

    warmup: untimed-for-the-ratio rounds before (CUDA graphs, caches, allocator); their
        times are kept in the result. Round k (warm-ups included) runs A first when k is even.
    sync: called before and after every call (e.g. `torch.cuda.synchronize`) so that the
        clock covers the device's work.
    clock: seconds, monotonic (tests pass a fake).
    pause: called before every call, outside its time (e.g. a sleep that lets the other
        engine's idle threads stop spinning, or `gc.collect`).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        if pause is not None:
            pause()
        sync()
        start = clock()
        out = fn()
        sync()
        return clock() - start, out

    result = ABResult(a_s=[], b_s=[], a_first=[])
    for k in range(warmup + repeats):
        a_first = k % 2 == 0
        order = ("a", "b") if a_first else ("b", "a")
        seconds: dict[str, float] = {}
        outputs: dict[str, Any] = {}
        for name in order:
            seconds[name], outputs[name] = timed(a if name == "a" else b)
        if k < warmup:
            result.warmup_a_s.append(seconds["a"])
            result.warmup_b_s.append(seconds["b"])
            continue
        result.a_s.append(seconds["a"])
        result.b_s.append(seconds["b"])
        result.a_first.append(a_first)
        result.last_a, result.last_b = outputs["a"], outputs["b"]
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
        "target": target,
        "worst_target": worst_target,
        "higher_is_better": higher_is_better,
        "met": result.met(target, worst_target, higher_is_better),
        "command": command,
        "json": json_path,
    }
