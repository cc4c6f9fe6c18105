"""Weight sync, training layout → generation layout: resharding vs the name-based full gather.

For every training layout (t, p, d) that fits the world and every rollout TP t_g dividing
t·p, one run of both paths on the same random actor (built by the trainer's builder:
parameters only, no DDP grad buffers, no optimizer):

* `reshard`: a `WeightSync` into vLLM's layout (a `TensorStoreTarget`: the engine's
  parameters without the engine, so the number is the transfer itself), one per target,
  called as the trainer calls its engine's;
* `full_gather`: `full_gather_sync` (TP all-gather, PP broadcast, HF names) into the same
  layout through `SpecNameLoader` (each rank slices its rows, as vLLM's loaders do).

Both results are checked equal bit for bit. Per rank and per path it records bytes sent
and received, peak extra memory, wall time, and next to them the plan's minimum bytes for
this rank, HybridFlow's (d_g − 1)/(t·p)·M, and what the plan would move under HybridFlow's
strided generation groups (not realisable with vLLM's consecutive TP groups; DESIGN.md §3).

Times. `e2e_wall_s`: median over `--repeats` (after `--warmup` untimed calls) of the whole
call, from a device synchronize + one-element all-reduce across ranks to a device
synchronize after it; the ratios use it. `wall_s` is the path's own host timer (kept for
RESULTS.md; on GPUs it does not wait for the last kernels). For the reshard path,
`prepare_s`, `begin_s`, `wall_s` and `finish_s` (medians) are `WeightSync.sync`'s host time
per phase (sources, agreement and checks; the engine's begin and its agreement; the
transfer; the engine's finish), printed in a second table. On GPUs `graphs_vs_direct` is
the same sync against one whose kept copies are issued directly rather than replayed as
CUDA graphs (`WeightSync(copy_graphs=False)`), as interleaved rounds (`ab.py`; ratio of a
round: direct ÷ graphs), in a third table.

Peak extra memory (GPU). The target tensors and the actor exist before each call and are
not counted. `device_peak_extra_bytes` is the full gather's own figure (CUDA allocator peak
above its start; the weight sync measures its own only when asked, `measure_peak`, which
costs host time this bench times, so it is None there); `device_peak_extra_bytes_call` is
the bench's, for both paths, around the
whole call (`reset_peak_memory_stats` before, `max_memory_allocated() − memory_allocated()`
at the start). NCCL's internal buffers are outside the allocator and not counted.
`peak_staging_bytes` is the executor's transfer arena (reshard) or the buffered HF tensors
(full gather), measured on CPU too.

Floors, measured in the same run on the same devices (`floor` in each row, bytes are the
max over ranks, times this rank's median):

* `copy_*`: one device copy `dst.copy_(src)` of a flat buffer of the rank's generation
  bytes (`copy_s`), and the same bytes as the target's tensors copied one by one
  (`copy_per_tensor_s`) and with one `torch._foreach_copy_` (`copy_foreach_s`);
* `allgather_*` (world > 1): `all_gather_into_tensor` over the world in which each rank
  receives the bytes the reshard path receives (the plan's minimum); `allgather_full_gather_*`
  the same for the bytes the full gather receives.

The row's floor `floor.s` is the all-gather of the reshard bytes when any rank receives
data, else the flat copy (one GPU; or t_g = t, p = 1). On one rank the reshard call and
the flat copy are also timed as interleaved rounds (`ab.py`: copy, sync / sync, copy, …;
`floor.sync_vs_copy`, a round's ratio sync ÷ copy), the form issue 19's ≤ 3× is judged
in. Each path reports `ratio_to_floor` (its e2e time over that floor: the same floor for
both paths) and `ratio_to_own_floor` (over the floor of the bytes that path itself
moves), and GB/s (`recv_GBps`: bytes received, `write_GBps`: generation bytes written, per
second).

Host overhead per sync, on a CPU: `--model llama-1b-tiny` has Llama-3.2-1B's tensors
(99 in vLLM's layout: 16 layers, 8 query groups of 4 heads) at tiny sizes, so the copies
cost next to nothing and the phases' times are the sync's fixed host cost.
`--without-cpu-shim` times each call with `cpu_compat`'s TorchFunctionMode off: the shim
intercepts every tensor call and attribute read, which a GPU host does not pay.

    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/reshard_bench.py \
        --model llama-1b-tiny --rollout-tp 1 --repeats 200 --warmup 20 --without-cpu-shim

`--model qwen3-moe-2b-tiny` likewise for qwen3-moe-2b's tensor count (2048 expert tensors in
Megatron's one-parameter-per-expert layout, 147 in vLLM's); its full-gather baseline takes
~1.4 s a call on 2 cores, so `--repeats 20 --warmup 3` (under a minute).

CPU (gloo; tests, CI-sized checks):

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/reshard_bench.py \
        --model tiny --out-json /tmp/reshard_tiny.json
    .venv/bin/torchrun --standalone --nproc_per_node 4 benchmarks/reshard_bench.py \
        --model small --out-json benchmarks/results/reshard_cpu_small.json

One GPU (layout 1,1,1 → t_g 1; floor: the device copy):

    torchrun --standalone --nproc_per_node 1 benchmarks/reshard_bench.py --model llama2-7b \
        --dtype bfloat16 --bucket-mb 512 --repeats 10 --out-json reshard_h200_7b.json

Two GPUs (NCCL; t=2 with t_g ∈ {2, 1}, p=2 with t_g ∈ {1, 2}, and pure DP):

    torchrun --standalone --nproc_per_node 2 benchmarks/reshard_bench.py --model llama2-7b \
        --dtype bfloat16 --bucket-mb 512 --repeats 10 --layouts "1,1,2 1,2,1 2,1,1" \
        --rollout-tp 1,2 --out-json reshard_h200x2_7b.json

(`--model llama-1b` likewise; where `torchrun` is not on PATH, `python3 -m
torch.distributed.run`. Each of these takes 20–35 s on H200s, start-up included.)

Mixtures of experts (issue 19): `--model qwen3-moe-2b` is bench_h200_moe.yaml's Qwen3-MoE
shape, synced into vLLM's fused-MoE layout (`w13_weight` / `w2_weight`, every expert on
every rank); bytes, floors and ratios as for the dense models. A layout may name the
expert-parallel and expert-TP sizes, `t,p,d,ep[,etp]` (etp defaults to 1, the trainer's
default); "all" adds every ep that fits the world. One GPU (the experts come out of
Megatron's one parameter per expert into the stacked tensors; floor: the device copy;
under a minute, estimate):

    torchrun --standalone --nproc_per_node 1 benchmarks/reshard_bench.py \
        --model qwen3-moe-2b --dtype bfloat16 --bucket-mb 512 --repeats 10 \
        --out-json reshard_h200_qwen3_moe_2b.json

CPU (gloo; 4 layers, 4 experts; at 2 ranks "all" includes EP2 over DP and TP2·EP2):

    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/reshard_bench.py \
        --model qwen3-moe-tiny --out-json /tmp/reshard_moe_tiny.json
    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/reshard_bench.py \
        --model qwen3-moe-tiny --out-json /tmp/reshard_moe_tiny2.json

`--profile-dir DIR`: three more reshard calls per row, each under torch.profiler (the top
ops by host time, the last one's Chrome trace as `trace_*.json.gz`): where the host time of
a sync goes on the machine that measured it.

Prints one JSON object (rank 0, stdout) and then a table (stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The name-based full gather, the baseline here, is test support (tests/full_gather.py).
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from ab import interleave  # noqa: E402
from update_traces import profile_calls  # noqa: E402

from rl_megatron.parallel import ParallelLayout

# Qwen3-MoE fields shared by the MoE entries of MODELS (every layer sparse, QK-norm).
_QWEN3_MOE = dict(model_type="qwen3_moe", norm_topk_prob=True, intermediate_size=128)
MODELS = {
    # The resharding tests' Llama-GQA.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=96, vocab_size=512),
    # Big enough that bytes, not per-message latency, dominate on CPU.
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=1536, vocab_size=32000),
    # Few bytes, Llama-2-7B's block count (32 layers x 32 query groups): the executor's
    # host time, measurable on a CPU.
    "many-blocks": dict(hidden_size=256, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, intermediate_size=512, vocab_size=1024),
    # Llama-3.2-1B's tensors (99 in vLLM's layout, 16 layers, 8 query groups of 4 heads)
    # at tiny sizes: copies cost next to nothing, what remains is the sync's host time.
    "llama-1b-tiny": dict(hidden_size=64, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=64, vocab_size=256),
    # Llama-3.2-1B's shape (1.24 B parameters).
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
    # Llama-2-7B's shape (6.74 B parameters, 13.5 GB in bf16).
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
    # Mixtures of experts into vLLM's fused-MoE layout (`w13_weight [E, 2·Fe/t_g, h]`,
    # `w2_weight [E, h, Fe/t_g]` per layer, every expert on every rank; DESIGN.md "MoE
    # resharding"). Tiny: tiny_moe_cpu.yaml's shape (4 layers, 4 experts of FFN 64, top-2).
    "qwen3-moe-tiny": dict(_QWEN3_MOE, hidden_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           vocab_size=512),
    # qwen3-moe-2b's tensor count (16 layers x 64 experts: 2048 expert tensors in Megatron,
    # 147 in vLLM's layout) at tiny sizes: the sync's host time per tensor, on a CPU.
    "qwen3-moe-2b-tiny": dict(_QWEN3_MOE, hidden_size=64, num_hidden_layers=16,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=64, num_experts_per_tok=8, moe_intermediate_size=16,
                              vocab_size=512),
    # bench_h200_moe.yaml's shape: 16 layers, 64 experts of FFN 512, top-8, head_dim 128,
    # vocab 151936 (1.97 B parameters, 3.95 GB in bf16, 3.2 GB of it experts).
    "qwen3-moe-2b": dict(_QWEN3_MOE, hidden_size=1024, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                         num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                         vocab_size=151936),
}  # fmt: skip

GB = 1e9


def parse_layouts(text: str, world: int, experts: int = 0) -> list[tuple[int, ...]]:
    """(t, p, d, ep, etp) per layout: `text` is "t,p,d[,ep[,etp]] ..." or "all".

    experts: the model's routed experts (0 = dense: ep = etp = 1). "all" for an MoE model
    adds every ep that divides the experts and fits the world (etp 1, the trainer's
    default; with p > 1, megatron-core's order needs ep = t).
    """
    if text == "all":
        out = []
        for t in (1, 2, 4, 8):
            for p in (1, 2, 4, 8):
                if world % (t * p):
                    continue
                for ep in (1, 2, 4, 8) if experts else (1,):
                    fits = world % (ep * p) == 0 and (p == 1 or ep == t)
                    if not experts or experts % ep == 0 and fits:
                        out.append((t, p, world // (t * p), ep, 1))
        return out
    layouts = []
    for item in text.split():
        t, p, d, *expert = (int(x) for x in item.split(","))
        ep, etp = (list(expert) + [1, 1])[:2]
        layouts.append((t, p, d, ep, etp))
    return layouts


SUMMARY_KEYS = (
    "bytes_sent",
    "bytes_received",
    "peak_staging_bytes",
    "device_peak_extra_bytes",
    "messages_sent",
    "rounds",
    "wall_s",
    "prepare_s",
    "begin_s",
    "finish_s",
)
HOST_PHASES = ("prepare_s", "begin_s", "wall_s", "finish_s")  # WeightSync.sync's host timers


# ---------------------------------------------------------------------- timing


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _line_up(device: torch.device) -> None:
    """All ranks here, nothing in flight (a one-element all-reduce: no NCCL barrier warning)."""
    _synchronize(device)
    dist.all_reduce(torch.zeros(1, device=device))
    _synchronize(device)


def timed(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int, unshimmed: bool
) -> dict:
    """Run `fn` (collective) `warmup` + `repeats` times; synchronised wall times and peaks.

    `unshimmed`: run `fn` with the CPU shim's TorchFunctionMode (`cpu_compat`) popped.
    Returns `times` (s, the timed repeats), `results` (fn's returns, timed repeats) and
    `peak_extra` (CUDA allocator bytes above the start, max over repeats; None on CPU).
    """
    cuda = device.type == "cuda"
    times, results, peak = [], [], 0
    for i in range(warmup + repeats):
        _line_up(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        with torch.overrides._pop_mode_temporarily() if unshimmed else contextlib.nullcontext():
            out = fn()
        _synchronize(device)
        elapsed = time.perf_counter() - t0
        if i < warmup:
            continue
        times.append(elapsed)
        results.append(out)
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(device) - start)
    return {"times": times, "results": results, "peak_extra": peak if cuda else None}


def _max_over_ranks(values: list[int], device: torch.device) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _rate(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / GB if nbytes and seconds > 0 else None


# ---------------------------------------------------------------------- floors


def copy_floors(
    tensors: dict, target_bytes: int, dtype, device, args, sync: Callable[[], object] | None = None
) -> dict:
    """Device copies of the generation bytes: one flat copy, per tensor, one foreach.

    `tensors`: name → (src, dst) pairs of this rank's target shapes (written over).
    `target_bytes`: the flat copy's size (the max over ranks, so every rank copies alike).
    `sync`: the reshard call, timed in interleaved rounds against the flat copy
        (`sync_vs_copy`; where the row's floor is the copy: one rank).
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    src, dst = zip(*tensors.values(), strict=True) if tensors else ((), ())
    out = {
        "tensors": len(tensors),
        "copy_per_tensor_s": _median(
            timed(lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)], device, *_rw(args))
        ),
        "copy_foreach_s": _median(
            timed(lambda: torch._foreach_copy_(list(dst), list(src)), device, *_rw(args))
        ),
    }
    flat_src = torch.empty(target_bytes // elem, dtype=dtype, device=device)
    flat_dst = torch.empty_like(flat_src)
    copy = partial(flat_dst.copy_, flat_src)
    out["copy_s"] = _median(timed(copy, device, *_rw(args)))
    out["copy_GBps"] = _rate(target_bytes, out["copy_s"])
    if sync is not None:
        # The ratio as issue 19 states it, as interleaved rounds (ab.py): A the copy, B the
        # sync, so a round's ratio is sync ÷ copy.
        out["sync_vs_copy"] = interleave(
            copy, sync, args.repeats, warmup=args.warmup, sync=partial(_synchronize, device)
        ).as_dict()
    del flat_src, flat_dst
    return out


def allgather_floor(nbytes: int, dtype, device, args) -> dict:
    """An all-gather over the world in which each rank receives about `nbytes`."""
    world = dist.get_world_size()
    elem = torch.tensor([], dtype=dtype).element_size()
    chunk = math.ceil(nbytes / elem / (world - 1))
    inp = torch.zeros(chunk, dtype=dtype, device=device)
    out = torch.empty(chunk * world, dtype=dtype, device=device)
    # torch ≥ 2.13 renames all_gather_into_tensor (same call); the GPU machine has 2.11.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    seconds = _median(timed(partial(gather, out, inp), device, *_rw(args)))
    received = chunk * elem * (world - 1)
    del inp, out
    return {"bytes": received, "s": seconds, "GBps": _rate(received, seconds)}


def _rw(args) -> tuple[int, int, bool]:
    return args.repeats, args.warmup, args.without_cpu_shim


def _median(result: dict) -> float:
    return statistics.median(result["times"])


# ---------------------------------------------------------------------- layouts


def summary(run: dict) -> dict:
    """The last repeat's counters (identical every time), the median wall times."""
    stats = run["results"]
    last = stats[-1].as_dict()
    out = {k: last[k] for k in SUMMARY_KEYS}
    for key in HOST_PHASES:  # the full gather times only its whole call (wall_s)
        out[key] = statistics.median(getattr(s, key) for s in stats)
    out["e2e_wall_s"] = statistics.median(run["times"])
    out["e2e_wall_s_min"] = min(run["times"])
    out["device_peak_extra_bytes_call"] = run["peak_extra"]
    return out


def run_layout(t: int, p: int, d: int, ep: int, etp: int, args, info, rank: int) -> list[dict]:
    """Both paths for one training layout and every rollout TP; this rank's rows.

    ep, etp: expert-parallel and expert-TP sizes (1, 1 for a dense model)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.conversions import padded_vocab_size
    from rl_megatron.resharding.agreement import MIB
    from rl_megatron.resharding.layouts import (
        MEGATRON_RANK_ORDER,
        TrainingLayout,
        generation_layout_for,
        hybridflow_generation_layout,
    )
    from rl_megatron.resharding.plan import PlanKey, build_plan
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.full_gather import SpecNameLoader, full_gather_sync

    dtype = getattr(torch, args.dtype)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if info.is_moe:
        ps.initialize_model_parallel(
            t, p, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            order=MEGATRON_RANK_ORDER,
        )  # fmt: skip
        training = TrainingLayout(t, p, d, ep=ep, etp=etp)
    else:
        ps.initialize_model_parallel(t, p, order=MEGATRON_RANK_ORDER)
        training = TrainingLayout(t, p, d)
    model_parallel_cuda_manual_seed(0)
    # Parameters only (no DDP wrapper, grad buffers or optimizer), initialised on the device.
    chunks = build_gpt_chunks(info, ParallelLayout.from_megatron(), dtype=dtype)
    world = dist.get_world_size()
    rows = []
    for t_g in args.rollout_tp:
        if (t * p) % t_g:
            continue
        gen = generation_layout_for(training, t_g)
        padded = vllm_layout.vllm_padded_vocab(info.vocab_size, t_g)
        store = TensorStoreTarget(vllm_layout.vllm_specs, info, gen, rank, padded, dtype, device)
        weight_sync = WeightSync(store, info=info, training=training, bucket_mb=args.bucket_mb)
        # The tensor store and the loader ignore versions: every call is version 0.
        ours = timed(partial(weight_sync.sync, chunks, version=0), device, *_rw(args))
        graphs_ab = None
        if cuda:
            # The same sync with its kept copies issued directly, not replayed as CUDA
            # graphs, interleaved with it (ratio of a round: direct ÷ graphs).
            direct = WeightSync(
                store, info=info, training=training, bucket_mb=args.bucket_mb, copy_graphs=False
            )
            graphs_ab = interleave(
                partial(weight_sync.sync, chunks, version=0),
                partial(direct.sync, chunks, version=0),
                args.repeats,
                warmup=2,
                sync=partial(_synchronize, device),
            ).as_dict()
            del direct
        profile = {}
        if args.profile_dir is not None:
            stem = f"reshard_{args.model}_{'_'.join(map(str, (t, p, d, ep, etp)))}_tg{t_g}"
            shim_off = args.without_cpu_shim  # as the timed calls ran (`timed`)
            mode = torch.overrides._pop_mode_temporarily() if shim_off else contextlib.nullcontext()
            with mode:
                profile = profile_calls(
                    partial(weight_sync.sync, chunks, version=0), 3, args.profile_dir, stem,
                    write=rank == 0,
                )  # fmt: skip
        baseline_store = TensorStoreTarget(
            vllm_layout.vllm_specs, info, gen, rank, padded, dtype, device
        )
        theirs = timed(
            partial(
                full_gather_sync,
                chunks,
                SpecNameLoader(baseline_store),
                info=info,
                training=training,
                version=0,
                bucket_mb=args.bucket_mb,
                tp_group=ps.get_tensor_model_parallel_group(),
                pp_group=ps.get_pipeline_model_parallel_group(),
                ep_group=ps.get_expert_model_parallel_group() if info.is_moe else None,
                etp_group=ps.get_expert_tensor_parallel_group() if info.is_moe else None,
            ),
            device,
            *_rw(args),
        )
        same = all(torch.equal(store.tensors[n], baseline_store.tensors[n]) for n in store.tensors)
        elem = torch.tensor([], dtype=dtype).element_size()
        bucket = int(args.bucket_mb * MIB)
        train_padded = padded_vocab_size(info.vocab_size, 128, t)
        plan = weight_sync.plan  # the one the sync ran
        strided_layout = hybridflow_generation_layout(training, t_g)
        strided = build_plan(
            PlanKey(
                info,
                training,
                strided_layout,
                vllm_layout.vllm_specs,
                train_padded,
                padded,
                bucket,
                elem,
            )
        )
        local = plan.local_rank(rank)
        row = {
            "rank": rank,
            "t": t,
            "p": p,
            "d": d,
            "ep": ep,
            "etp": etp,
            "t_g": t_g,
            "d_g": t * p // t_g,
            "bit_exact_vs_full_gather": same,
            "reshard": summary(ours),
            "full_gather": summary(theirs),
            "plan_min_bytes_received": plan.traffic[local].received * elem,
            "hybridflow_formula_bytes": plan.hybridflow_bytes(),
            "hybridflow_layout_bytes_received": strided.traffic[local].received * elem,
            "target_bytes": sum(x.nbytes for x in store.tensors.values()),
            "reshard_profile": profile,
            "graphs_vs_direct": graphs_ab,
        }

        # Floors. The target's own tensors serve as the per-tensor copy's source and
        # destination (the comparison above is done), then the baseline is freed before
        # the flat buffers are allocated.
        target_max, ours_recv, theirs_recv = _max_over_ranks(
            [row["target_bytes"], row["reshard"]["bytes_received"],
             row["full_gather"]["bytes_received"]],
            device,
        )  # fmt: skip
        pairs = {n: (store.tensors[n], baseline_store.tensors[n]) for n in store.tensors}
        del baseline_store
        against = partial(weight_sync.sync, chunks, version=0) if world == 1 else None
        floors = copy_floors(pairs, target_max, dtype, device, args, sync=against)
        floor = {"target_bytes": target_max, **floors}
        del pairs
        for key, nbytes in (("allgather", ours_recv), ("allgather_full_gather", theirs_recv)):
            measured = allgather_floor(nbytes, dtype, device, args) if world > 1 and nbytes else {}
            for field in ("bytes", "s", "GBps"):
                floor[f"{key}_{field}"] = measured.get(field)
        floor["kind"] = "allgather" if floor["allgather_s"] else "copy"
        floor["s"] = floor["allgather_s"] or floor["copy_s"]
        for path, key in (("reshard", "allgather"), ("full_gather", "allgather_full_gather")):
            res = row[path]
            res["recv_GBps"] = _rate(res["bytes_received"], res["e2e_wall_s"])
            res["write_GBps"] = _rate(row["target_bytes"], res["e2e_wall_s"])
            res["ratio_to_floor"] = res["e2e_wall_s"] / floor["s"]
            res["ratio_to_own_floor"] = res["e2e_wall_s"] / (floor[f"{key}_s"] or floor["copy_s"])
        row["floor"] = floor
        rows.append(row)
        del store, weight_sync
        if cuda:
            torch.cuda.empty_cache()
    ps.destroy_model_parallel()
    del chunks
    if cuda:
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------- report


def table(rows: list[dict]) -> str:
    """One line per (layout, t_g): bytes and peaks are the max over ranks, times the slowest."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        layout = f"{r['t']},{r['p']},{r['d']}"
        if (r["ep"], r["etp"]) != (1, 1):
            layout += f",{r['ep']},{r['etp']}"
        groups.setdefault((layout, r["t_g"]), []).append(r)

    def top(rs, path, key):
        values = [r[path][key] for r in rs if r[path][key] is not None]
        return max(values) if values else None

    def peak(rs, path):
        cuda = top(rs, path, "device_peak_extra_bytes_call")
        return cuda if cuda is not None else top(rs, path, "peak_staging_bytes")

    head = (
        "t,p,d[,ep,etp]  t_g | recv MB  ours / fg | peak MB  ours / fg | ms  ours / fg | floor ms "
        "(kind) | ×floor ours / fg | exact"
    )
    lines = [head, "-" * len(head)]
    for (layout, t_g), rs in groups.items():
        ours_s, fg_s = top(rs, "reshard", "e2e_wall_s"), top(rs, "full_gather", "e2e_wall_s")
        floor_s = max(r["floor"]["s"] for r in rs)
        lines.append(
            f"{layout:<13}  {t_g:>3} | {top(rs, 'reshard', 'bytes_received') / 1e6:8.1f} / "
            f"{top(rs, 'full_gather', 'bytes_received') / 1e6:8.1f} | "
            f"{peak(rs, 'reshard') / 1e6:7.1f} / {peak(rs, 'full_gather') / 1e6:7.1f} | "
            f"{ours_s * 1e3:7.2f} / {fg_s * 1e3:7.2f} | {floor_s * 1e3:7.2f} "
            f"({rs[0]['floor']['kind']}) | {ours_s / floor_s:5.2f} / {fg_s / floor_s:5.2f} | "
            f"{all(r['bit_exact_vs_full_gather'] for r in rs)}"
        )
    head = "t,p,d[,ep,etp]  t_g | sync host ms: prepare  begin  execute  finish | e2e ms (slowest rank)"
    lines += ["", head, "-" * len(head)]
    for (layout, t_g), rs in groups.items():
        phases = "  ".join(f"{top(rs, 'reshard', k) * 1e3:7.3f}" for k in HOST_PHASES)
        e2e = top(rs, "reshard", "e2e_wall_s") * 1e3
        lines.append(f"{layout:<13}  {t_g:>3} |               {phases} | {e2e:7.3f}")
    paired = [(key, r["floor"].get("sync_vs_copy")) for key, rs in groups.items() for r in rs[:1]]
    paired = [(key, ab) for key, ab in paired if ab]
    if paired:
        head = "t,p,d[,ep,etp]  t_g | reshard ÷ flat copy, interleaved rounds: median (min–max)"
        lines += ["", head, "-" * len(head)]
        for (layout, t_g), ab in paired:
            lines.append(
                f"{layout:<13}  {t_g:>3} | {ab['ratio_median']:.2f} "
                f"({ab['ratio_min']:.2f}–{ab['ratio_max']:.2f}), {ab['repeats']} rounds"
            )
    graphs = [(key, r["graphs_vs_direct"]) for key, rs in groups.items() for r in rs[:1]]
    graphs = [(key, ab) for key, ab in graphs if ab]
    if graphs:
        head = "t,p,d[,ep,etp]  t_g | ms graphs / direct (medians, interleaved) | direct ÷ graphs"
        lines += ["", head, "-" * len(head)]
        for (layout, t_g), ab in graphs:
            a, b = statistics.median(ab["a_s"]) * 1e3, statistics.median(ab["b_s"]) * 1e3
            lines.append(
                f"{layout:<13}  {t_g:>3} | {a:7.3f} / {b:7.3f}{'':26}| "
                f"{ab['ratio_median']:.2f} ({ab['ratio_min']:.2f}–{ab['ratio_max']:.2f})"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument(
        "--layouts", default="all", help='"t,p,d[,ep[,etp]] ..." or "all"; ep, etp: MoE'
    )
    parser.add_argument("--rollout-tp", default="1,2,4,8")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before them")
    parser.add_argument("--out-json", default=None)
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="profile three more reshard calls per row (top ops, a Chrome trace) into it",
    )
    parser.add_argument(
        "--without-cpu-shim",
        action="store_true",
        help="CPU: time each call with cpu_compat's TorchFunctionMode off, as on a GPU host",
    )
    args = parser.parse_args()
    args.rollout_tp = [int(x) for x in args.rollout_tp.split(",")]
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")

    from rl_megatron.distributed import init_process_group, launch_env
    from rl_megatron.models.hf_config import parse_hf_config
    from rl_megatron.resharding.plan import model_numel

    env = launch_env()
    device = init_process_group(env, timeout_s=600)  # NCCL on cuda:LOCAL_RANK, else gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = {"model_type": "llama", **MODELS[args.model], "tie_word_embeddings": False}
    info = parse_hf_config(shape)
    rows = []
    for t, p, d, ep, etp in parse_layouts(args.layouts, world, info.num_experts):
        mine = run_layout(t, p, d, ep, etp, args, info, rank)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        rows += [row for part in gathered for row in part]
    if rank == 0:
        elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        out = {
            "benchmark": "reshard",
            "model": args.model,
            "model_type": info.model_type,
            "model_bytes": model_numel(info) * elem,
            "dtype": args.dtype,
            "world_size": world,
            "bucket_mb": args.bucket_mb,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "rows": rows,
        }
        text = json.dumps(out, indent=1)
        print(text, flush=True)
        if args.out_json:
            Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out_json).write_text(text + "\n")
        print(
            f"\n{args.model}, {args.dtype}, world {world}, bucket {args.bucket_mb:g} MiB, "
            f"M = {out['model_bytes'] / 1e9:.2f} GB, median of {args.repeats}\n{table(rows)}",
            file=sys.stderr,
            flush=True,
        )
    _line_up(device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
