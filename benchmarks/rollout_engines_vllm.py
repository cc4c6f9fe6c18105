"""`rollout_bench.py`'s vLLM engines: the standalone `vllm.LLM`, the trainer's in-process
`VllmEngine` (with and without log-probs, and its `vllm.LLM` called directly), and sleep/wake.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_utils import free_memory
from rollout_common import (
    KEYS,
    VLLM_NO_LOGPROBS,
    batch_tokens,
    bench_batches,
    error_text,
    free_gib,
    greedy,
    max_model_len,
    rows_equal,
    timed,
)


def shared_vllm_kwargs(args) -> dict[str, Any]:
    """Settings both vLLM variants get identically (fairness)."""
    kwargs: dict[str, Any] = {}
    if args.cudagraph_capture_sizes and torch.cuda.is_available():
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": args.cudagraph_capture_sizes}
    return kwargs


def standalone_sampling_params(args) -> Any:
    import vllm

    return vllm.SamplingParams(
        temperature=0.0, max_tokens=args.max_new, ignore_eos=True, detokenize=False
    )


def build_standalone(ckpt: Path, args, **extra: Any) -> tuple[Any, dict[str, Any]]:
    """The standalone `vllm.LLM` (its own engine-core process) and its start-up record:
    `bench_vllm_standalone` times and shuts it down, `rollout_ab.py` keeps it alive.
    extra: further `vllm.LLM` arguments (`fp8_rollout.py`: quantization)."""
    import vllm
    import vllm.envs as envs

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING=0: the standalone engine would run in this "
            "process; run `--engines vllm-standalone` alone and merge with --merge-json"
        )
    kwargs: dict[str, Any] = dict(
        model=str(ckpt),
        dtype=args.dtype,
        max_model_len=max_model_len(args),
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        skip_tokenizer_init=True,  # the random checkpoint has no tokenizer
        **shared_vllm_kwargs(args),
        **extra,
    )
    if not torch.cuda.is_available():
        kwargs["enforce_eager"] = True  # as VllmEngine on CPU
    # Its engine-core process sets up a one-rank group over a TCP store at the host's
    # address; the loopback is right for a one-rank engine. That process inherits
    # torchrun's environment, and TORCHELASTIC_USE_AGENT_STORE makes torch connect to the
    # store as a client only, so no one serves it and the start hung (runs/2026-11-29-h200x2-run03-
    # graphs-floors-gpu-tests.md and runs/2026-11-30-h200x2-run04-vllm-in-trainer-pp2.md) until the variable was left out of the child's environment.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    start = time.perf_counter()
    try:
        llm = vllm.LLM(**kwargs)
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
    return llm, {"startup_s": time.perf_counter() - start, "vllm_kwargs": kwargs}


def bench_vllm_standalone(ckpt: Path, prompts: list[list[int]], args, result):
    free_before = free_gib()
    llm, info = build_standalone(ckpt, args)
    params = standalone_sampling_params(args)

    def run(b: int) -> list[list[int]]:
        requests = [{"prompt_token_ids": p} for p in prompts[:b]]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    try:
        tokens = bench_batches(KEYS["vllm-standalone"], run, args, result)
    finally:
        llm = None  # its engine-core process exits and gives its GPU memory back
        free_memory()
        wait_for_memory(free_before)
    info["free_gib_after"] = free_gib()
    result[KEYS["vllm-standalone"]] = info
    return tokens


def wait_for_memory(free_before: float | None, timeout_s: float = 60.0) -> None:
    """Wait until a child process's GPU memory is back (within 1 GiB), at most timeout_s."""
    if free_before is None:
        return
    deadline = time.monotonic() + timeout_s
    while free_gib() < free_before - 1.0 and time.monotonic() < deadline:
        time.sleep(0.5)


def build_vllm_engine(ckpt: Path, args) -> tuple[Any, float]:
    from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs

    start = time.perf_counter()
    engine = VllmEngine(
        VllmEngineArgs(
            model=str(ckpt),
            tp=args.rollout_tp,
            load_format=args.vllm_load_format,
            dtype=args.dtype,
            max_model_len=max_model_len(args),
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=0,
            # As trainer/build.py: sleep mode on GPUs (the CPU build has none).
            enable_sleep_mode=torch.cuda.is_available(),
            extra=shared_vllm_kwargs(args),
        )
    )
    return engine, time.perf_counter() - start


def bench_vllm_engine(engine, prompts, args, result) -> dict[str, dict[int, list[list[int]]]]:
    """The engine's generate with and without log-probs, and its LLM called directly.

    Returns the greedy tokens per batch size of both `generate` variants, by result key.
    """
    sampling = greedy(args)

    def generate(b: int) -> list[list[int]]:
        batch = engine.generate(prompts[:b], sampling)
        if (batch.rollout_log_probs is not None) != engine.calculate_log_probs:
            raise RuntimeError(f"calculate_log_probs={engine.calculate_log_probs} not honoured")
        return batch_tokens(batch)

    tokens = {KEYS["vllm"]: bench_batches(KEYS["vllm"], generate, args, result)}
    asked = engine.calculate_log_probs
    engine.calculate_log_probs = False
    try:
        tokens[VLLM_NO_LOGPROBS] = bench_batches(VLLM_NO_LOGPROBS, generate, args, result)
    finally:
        engine.calculate_log_probs = asked
    for b, rows in tokens[VLLM_NO_LOGPROBS].items():
        # Log-probs are an output only: greedy tokens must not change.
        same = rows_equal(rows, tokens[KEYS["vllm"]].get(b))
        result["batches"][str(b)][VLLM_NO_LOGPROBS]["greedy_rows_equal_with_logprobs"] = same
    params = standalone_sampling_params(args)

    def raw(b: int) -> list[list[int]]:
        requests = [{"prompt_token_ids": p} for p in prompts[:b]]
        outputs = engine.llm.generate(requests, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    bench_batches("vllm_engine_llm_only", raw, args, result)
    return tokens


def bench_sleep_wake(engine, resync: Callable[[], Any], prompts, args) -> dict[str, Any]:
    """Sleep level 1 (weights to host) and 2 (weights dropped, re-synced), then wake."""
    if not torch.cuda.is_available():
        return {"skipped": "unsupported on cpu (the CPU build of vLLM has no sleep mode)"}
    sampling = greedy(args)
    before = batch_tokens(engine.generate(prompts, sampling))
    out: dict[str, Any] = {"check_batch": len(prompts)}
    for level in args.sleep_levels:
        row: dict[str, Any] = {}
        try:
            row["free_gib_awake"] = free_gib()
            row["sleep_s"], _ = timed(lambda level=level: engine.sleep(level=level))
            row["free_gib_asleep"] = free_gib()
            row["freed_gib"] = row["free_gib_asleep"] - row["free_gib_awake"]
            if level == 1:
                row["wake_s"], _ = timed(engine.wake)
            else:
                # The trainer's order: weights, load the actor's, then the KV cache.
                row["wake_weights_s"], _ = timed(lambda: engine.wake(["weights"]))
                row["resync_s"], _ = timed(resync)
                row["wake_kv_cache_s"], _ = timed(lambda: engine.wake(["kv_cache"]))
                row["wake_s"] = row["wake_weights_s"] + row["resync_s"] + row["wake_kv_cache_s"]
            row["free_gib_woken"] = free_gib()
            after = batch_tokens(engine.generate(prompts, sampling))
            row["greedy_rows_equal"] = rows_equal(before, after)
            assert after == before, f"greedy tokens changed after sleep level {level}"
        except Exception as exc:
            row = {"error": error_text(exc)}
        out[f"level{level}"] = row
    return out
