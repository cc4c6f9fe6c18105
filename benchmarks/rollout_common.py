"""What every engine of `rollout_bench.py` shares: result keys, timing, comparison.

`bench_batches` times one engine at every `--batches` size the same way; `rows_equal` compares
greedy tokens between engines; `greedy` / `batch_tokens` are the trainer engines' sampling
settings and token rows (`VllmEngine`, `MegatronEngine`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from bench_utils import sync
from phase_probes import GC_PAUSES  # benchmarks/, this script's directory

# Per-batch result keys (the first three existed before batches did).
KEYS = {
    "hf": "transformers_generate",
    "hf-static": "transformers_static_compile",
    "vllm-standalone": "vllm_standalone",
    "vllm": "vllm_engine",
    "megatron": "megatron_engine",
    "megatron-eager": "megatron_engine_eager",
}
VLLM_NO_LOGPROBS = "vllm_engine_no_logprobs"  # the in-trainer engine, log-probs off


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def max_model_len(args: argparse.Namespace) -> int:
    return args.prompt_len + args.max_new + 16


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def free_gib() -> float | None:
    """Free device memory (whole GPU, all processes), GiB; None on CPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[0] / 2**30


def error_text(exc: BaseException) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"


def throughput(seconds: float, warmup_s: float, batch: int, args) -> dict[str, float]:
    tokens = batch * args.max_new
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "warmup_s": warmup_s}


def bench_batches(
    name: str, run: Callable[[int], list[list[int]]], args, result: dict
) -> dict[int, list[list[int]]]:
    """Warm-up + `--repeats` timed calls of `run(batch)` per batch size (the median counts);
    records into result["batches"].

    `run` returns the generated tokens `[batch][max_new]`; a batch size that fails
    records its error and the others still run. Returns the tokens per batch size.
    """
    tokens = {}
    for b in args.batches:
        slot = result["batches"][str(b)]
        try:
            warmup_s, _ = timed(lambda b=b: run(b))
            times, gc_pauses = [], []
            for _ in range(args.repeats):
                GC_PAUSES.reset()
                seconds, out = timed(lambda b=b: run(b))
                times.append(seconds)
                gc_pauses.append(GC_PAUSES.seconds)
            if len(out) != b or any(len(row) != args.max_new for row in out):
                raise RuntimeError(f"expected {b} rows of {args.max_new} tokens")
            slot[name] = throughput(statistics.median(times), warmup_s, b, args)
            slot[name]["seconds_each"] = times
            # This process's garbage-collector pauses in each call (an engine-core process
            # of its own, as the standalone engine's, collects apart).
            slot[name]["gc_pause_s_each"] = gc_pauses
            tokens[b] = out
        except Exception as exc:
            slot[name] = {"error": error_text(exc)}
    return tokens


def rows_equal(a: list[list[int]] | None, b: list[list[int]] | None) -> float | None:
    """Fraction of rows whose greedy tokens are identical (None if either is missing)."""
    if not a or not b or len(a) != len(b):
        return None
    return sum(x == y for x, y in zip(a, b)) / len(a)


def greedy(args) -> Any:
    from rl_megatron.rollout.sampling import SamplingParams

    return SamplingParams(temperature=0, max_new_tokens=args.max_new, ignore_eos=True)


def batch_tokens(batch) -> list[list[int]]:
    return [batch.row_tokens(i)[1] for i in range(len(batch))]
