"""Where the Megatron engine's generate spends device time: torch.profiler tables per batch.

The same random Llama checkpoint, prompts and greedy settings as `rollout_bench.py` (whose
shape flags it takes); per batch size, one warm-up call, one timed call and one profiled
call, with and without the engine's CUDA graphs. Each profiled call's top kernels by
device time and top ops by host time go to `--out-dir/decode_graphs{0,1}_b{batch}.txt`.
This is how megatron-core was found re-rotating the whole KV cache at every decode step
(runs/2026-11-30-h200x2-run06-measurement-default-rollout.md).

    torchrun --standalone --nproc_per_node 1 benchmarks/decode_profile.py \
        --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 5632 --vocab 32000 \
        --dtype bfloat16 --batches 64,256 --prompt-len 128 --max-new 256 --out-dir $OUT
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import rollout_bench as rb  # benchmarks/, this script's directory
import rollout_common as common
import torch
import torch.distributed as dist
from bench_utils import free_memory, sync
from rollout_engines_megatron import build_megatron_actor
from torch.profiler import ProfilerActivity, profile


def _profile_generate(engine, prompts, sampling, graphs: bool, out_dir: Path) -> None:
    """One warm-up, one timed and one profiled `engine.generate(prompts)`; tables to a file."""
    engine.generate(prompts, sampling)
    seconds, _ = common.timed(lambda: engine.generate(prompts, sampling))
    print(f"graphs={graphs} batch={len(prompts)}: {seconds:.3f} s", flush=True)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities) as prof:
        engine.generate(prompts, sampling)
        sync()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    events = prof.key_averages()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"decode_graphs{int(graphs)}_b{len(prompts)}.txt").write_text(
        f"one generate, batch {len(prompts)}, {sampling.max_new_tokens} new tokens, "
        f"graphs={graphs}\n"
        + events.table(sort_by=device_key, row_limit=45)
        + "\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30)
    )


def main() -> None:
    args = rb.parse_args(extra=[("--out-dir", {"type": Path, "default": Path(".")})])
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.megatron.engine import MegatronEngine

    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(
        3, args.vocab, (max(args.batches), args.prompt_len), generator=generator
    ).tolist()
    sampling = common.greedy(args)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        rb.make_checkpoint(ckpt, args)
        chunks = build_megatron_actor(ckpt, args)
        for graphs in (True, False):
            engine = MegatronEngine(
                chunks,
                load_hf_config(ckpt),
                max_model_len=common.max_model_len(args),
                max_batch_size=max(args.batches),
                use_cuda_graphs=graphs,
            )
            for b in args.batches:
                _profile_generate(engine, prompts[:b], sampling, graphs, args.out_dir)
            del engine
            free_memory()
    dist.destroy_process_group()


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
