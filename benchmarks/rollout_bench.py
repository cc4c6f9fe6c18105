"""Generated tokens/s: vLLM engine, Megatron engine and `transformers.generate`, one run.

All three generate from the same random Llama checkpoint, the same prompts (batch ×
prompt_len random ids) and `max_new_tokens` with `ignore_eos`, greedy — so every engine
produces exactly batch × max_new tokens. Run under torchrun (vLLM's in-process
`external_launcher` joins the torchrun world):

    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/rollout_bench.py \
        --out-json benchmarks/results/rollout_cpu_tiny.json

Defaults are CPU-sized; on a GPU pass a real shape (`--layers 16 --hidden 2048 ...`,
`--dtype bfloat16 --batch 64 --max-new 256`). Prints one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def make_checkpoint(path: Path, args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.max_new + 16,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(getattr(torch, args.dtype)).save_pretrained(path)


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def bench_transformers(ckpt: Path, prompts: torch.Tensor, args) -> float:
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype)).to(device)
    model.generation_config.eos_token_id = None
    ids = prompts.to(device)

    def run():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new,
            min_new_tokens=args.max_new,
            do_sample=False,
            pad_token_id=0,
        )

    run()  # warm-up
    seconds, out = timed(run)
    assert out.shape[1] == prompts.shape[1] + args.max_new
    return seconds


def bench_vllm(ckpt: Path, prompts: list[list[int]], args) -> tuple[float, float]:
    from rl_megatron.rollout.sampling import SamplingParams
    from rl_megatron.rollout.vllm_engine import VllmEngine, VllmEngineArgs

    start = time.perf_counter()
    engine = VllmEngine(
        VllmEngineArgs(
            model=str(ckpt),
            tp=args.rollout_tp,
            dtype=args.dtype,
            max_model_len=args.prompt_len + args.max_new + 16,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=0,
        )
    )
    startup = time.perf_counter() - start
    sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new, ignore_eos=True)
    engine.generate(prompts[:2], sampling)  # warm-up
    seconds, batch = timed(lambda: engine.generate(prompts, sampling))
    assert int(batch.response_mask.sum()) == len(prompts) * args.max_new
    return seconds, startup


def bench_megatron(ckpt: Path, prompts: list[list[int]], args) -> float:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron import cpu_compat
    from rl_megatron.models.builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.megatron_engine import MegatronEngine
    from rl_megatron.rollout.sampling import SamplingParams

    cpu_compat.enable_if_no_gpu()
    parallel_state.initialize_model_parallel(dist.get_world_size(), 1)
    model_parallel_cuda_manual_seed(0)
    chunks = build_actor(
        str(ckpt), tp=dist.get_world_size(), pp=1, dtype=getattr(torch, args.dtype)
    )
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    engine = MegatronEngine(
        chunks,
        load_hf_config(ckpt),
        max_model_len=args.prompt_len + args.max_new + 16,
        max_batch_size=len(prompts),
    )
    sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new, ignore_eos=True)
    engine.generate(prompts[:2], sampling)  # warm-up
    seconds, batch = timed(lambda: engine.generate(prompts, sampling))
    assert int(batch.response_mask.sum()) == len(prompts) * args.max_new
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args()

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=gen)
    prompts = prompt_ids.tolist()
    tokens = args.batch * args.max_new
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        if rank == 0:
            make_checkpoint(ckpt, args)
        dist.barrier()
        result = {"benchmark": "rollout_throughput", "config": vars(args) | {"out_json": None}}
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result["torch"] = torch.__version__
        hf_s = bench_transformers(ckpt, prompt_ids, args)
        vllm_s, vllm_startup = bench_vllm(ckpt, prompts, args)
        # vLLM must come before Megatron's parallel_state: both set up TP groups, and the
        # engine must stay alive (deleting it tears down the default group).
        mcore_s = bench_megatron(ckpt, prompts, args)
    result["tokens"] = tokens
    result["transformers_generate"] = {"seconds": hf_s, "tokens_per_s": tokens / hf_s}
    result["vllm_engine"] = {
        "seconds": vllm_s,
        "tokens_per_s": tokens / vllm_s,
        "startup_s": vllm_startup,
    }
    result["megatron_engine"] = {"seconds": mcore_s, "tokens_per_s": tokens / mcore_s}
    if rank == 0:
        text = json.dumps(result, indent=2, default=str)
        print(text)
        if args.out_json:
            args.out_json.write_text(text + "\n")
    os._exit(0)  # see rollout/vllm_engine.py: no teardown under the in-process engine


if __name__ == "__main__":
    main()
