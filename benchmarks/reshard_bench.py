"""Weight sync, training layout → generation layout: resharding vs the name-based full gather.

For every training layout (t, p, d) that fits the world and every rollout TP t_g dividing
t·p, one run of both paths on the same random actor (built by the trainer's builder):

* `reshard`: `sync_weights` into vLLM's layout (a `TensorStoreTarget`: the engine's
  parameters without the engine, so the number is the transfer itself);
* `full_gather`: `full_gather_sync` (TP all-gather, PP broadcast, HF names) into the same
  layout through `SpecNameLoader` (each rank slices its rows, as vLLM's loaders do).

Both results are checked equal bit for bit. Per rank and per path it records bytes sent
and received, peak extra memory (the executor's transfer buffers; on GPUs also the CUDA
allocator's peak above the start), wall time (median of `--repeats`), and next to them the
plan's minimum bytes for this rank, HybridFlow's (d_g − 1)/(t·p)·M, and what the plan would
move under HybridFlow's strided generation groups (not realisable with vLLM's consecutive
TP groups; see DESIGN.md §3).

    .venv/bin/torchrun --standalone --nproc_per_node 4 benchmarks/reshard_bench.py \
        --model small --out-json benchmarks/results/reshard_cpu_small.json

Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

MODELS = {
    # The resharding tests' Llama-GQA.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=96, vocab_size=512),
    # Big enough that bytes, not per-message latency, dominate on CPU.
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=1536, vocab_size=32000),
    # Llama-3.2-1B's shape (1.24 B parameters).
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
}  # fmt: skip


def parse_layouts(text: str, world: int) -> list[tuple[int, int, int]]:
    if text == "all":
        out = []
        for t in (1, 2, 4, 8):
            for p in (1, 2, 4, 8):
                if world % (t * p) == 0:
                    out.append((t, p, world // (t * p)))
        return out
    return [tuple(int(x) for x in item.split(",")) for item in text.split()]


SUMMARY_KEYS = (
    "bytes_sent",
    "bytes_received",
    "peak_staging_bytes",
    "device_peak_extra_bytes",
    "messages_sent",
    "rounds",
    "wall_s",
)


def summary(stats: list) -> dict:
    """The last repeat's counters (identical every time), the median wall time."""
    last = stats[-1].as_dict()
    last["wall_s"] = statistics.median(s.wall_s for s in stats)
    return {k: last[k] for k in SUMMARY_KEYS}


def run_layout(t: int, p: int, d: int, args, info, rank: int) -> list[dict]:
    """Both paths for one training layout and every rollout TP; this rank's rows."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.conversions import padded_vocab_size
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.resharding import shards
    from rl_megatron.resharding.executor import MIB, sync_weights
    from rl_megatron.resharding.full_gather import SpecNameLoader, full_gather_sync
    from rl_megatron.resharding.layouts import (
        MEGATRON_RANK_ORDER,
        TrainingLayout,
        generation_layout_for,
        hybridflow_generation_layout,
    )
    from rl_megatron.resharding.plan import PlanKey, build_plan
    from rl_megatron.resharding.targets import TensorStoreTarget

    dtype = getattr(torch, args.dtype)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )
    ps.initialize_model_parallel(t, p, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    training = TrainingLayout(t, p, d)
    chunks = build_gpt_chunks(info, tp=t, pp=p, dtype=dtype)
    rows = []
    for t_g in args.rollout_tp:
        if (t * p) % t_g:
            continue
        gen = generation_layout_for(training, t_g)
        padded = shards.vllm_padded_vocab(info.vocab_size, t_g)
        store = TensorStoreTarget("vllm", info, gen, rank, padded, dtype, device)
        ours = []
        for i in range(args.repeats):
            ours.append(
                sync_weights(
                    chunks, store, info=info, training=training, version=i, bucket_mb=args.bucket_mb
                )
            )
        baseline_store = TensorStoreTarget("vllm", info, gen, rank, padded, dtype, device)
        loader = SpecNameLoader(baseline_store)
        theirs = []
        for i in range(args.repeats):
            theirs.append(
                full_gather_sync(
                    chunks,
                    loader,
                    info=info,
                    training=training,
                    version=i,
                    bucket_mb=args.bucket_mb,
                    tp_group=ps.get_tensor_model_parallel_group(),
                    pp_group=ps.get_pipeline_model_parallel_group(),
                )
            )
        same = all(torch.equal(store.tensors[n], baseline_store.tensors[n]) for n in store.tensors)
        elem = torch.tensor([], dtype=dtype).element_size()
        bucket = int(args.bucket_mb * MIB)
        train_padded = padded_vocab_size(info.vocab_size, 128, t)
        plan, strided = (
            build_plan(PlanKey(info, training, g, "vllm", train_padded, padded, bucket, elem))
            for g in (gen, hybridflow_generation_layout(training, t_g))
        )
        local = plan.local_rank(rank)

        rows.append(
            {
                "rank": rank,
                "t": t,
                "p": p,
                "d": d,
                "t_g": t_g,
                "d_g": t * p // t_g,
                "bit_exact_vs_full_gather": same,
                "reshard": summary(ours),
                "full_gather": summary(theirs),
                "plan_min_bytes_received": plan.traffic[local].received * elem,
                "hybridflow_formula_bytes": plan.hybridflow_bytes(),
                "hybridflow_layout_bytes_received": strided.traffic[local].received * elem,
            }
        )
        del store, baseline_store, loader
    ps.destroy_model_parallel()
    del chunks
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--layouts", default="all", help='"t,p,d t,p,d ..." or "all"')
    parser.add_argument("--rollout-tp", default="1,2,4,8")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-json", default=None)
    args = parser.parse_args()
    args.rollout_tp = [int(x) for x in args.rollout_tp.split(",")]
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")

    from rl_megatron.distributed import init_process_group, launch_env
    from rl_megatron.models.hf_config import parse_hf_config
    from rl_megatron.resharding.plan import model_numel

    env = launch_env()
    init_process_group(env, timeout_s=600)
    rank, world = dist.get_rank(), dist.get_world_size()
    info = parse_hf_config(dict(MODELS[args.model], model_type="llama", tie_word_embeddings=False))
    rows = []
    for t, p, d in parse_layouts(args.layouts, world):
        mine = run_layout(t, p, d, args, info, rank)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        rows += [row for part in gathered for row in part]
    if rank == 0:
        elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        out = {
            "benchmark": "reshard",
            "model": args.model,
            "model_bytes": model_numel(info) * elem,
            "dtype": args.dtype,
            "world_size": world,
            "bucket_mb": args.bucket_mb,
            "repeats": args.repeats,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "rows": rows,
        }
        text = json.dumps(out, indent=1)
        print(text)
        if args.out_json:
            Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out_json).write_text(text + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
