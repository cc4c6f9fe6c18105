"""Checkpoint-conversion throughput and peak host memory, as JSON.

Writes a random Llama-shaped HF checkpoint (default ~1B parameters, bf16, sharded
safetensors with an index), converts it HF → Megatron (dist_checkpointing) and back with
the bundled tools, and reports for each direction: wall seconds, GB/s of weights
converted, CPU seconds (user + system: steadier than wall time on a shared machine), and
the peak RSS of the converting processes (ru_maxrss of the children). The load average
at the start of each direction is recorded too.

    .venv/bin/python benchmarks/convert_bench.py --out-json bench_convert.json
    .venv/bin/python benchmarks/convert_bench.py --layers 2 --hidden 256   # quick check

Each direction runs in fresh child processes so their peak RSS is theirs alone; with
`--nproc N` both conversions run under torchrun with N ranks (tp = N for hf_to_megatron;
megatron_to_hf shares its output shards, `--out-shard-gb` each, among the N ranks) and the
peak RSS is that of the largest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def llama_tensors(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int):
    """(name, shape) of every tensor of a Llama checkpoint, in file order."""
    head_dim = hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "self_attn.q_proj.weight", (heads * head_dim, hidden)
        yield p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)
        yield p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (ffn, hidden)
        yield p + "mlp.up_proj.weight", (ffn, hidden)
        yield p + "mlp.down_proj.weight", (hidden, ffn)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def write_random_checkpoint(out: Path, args: argparse.Namespace, shard_bytes: int) -> int:
    """Sharded bf16 safetensors + index + config.json; returns the bytes of weights."""
    out.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, shard_size, total, index = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_size, index
        if shard:
            index += 1
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, shard_size = {}, 0

    dims = (args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab)
    for name, shape in llama_tensors(*dims):
        tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        shard_size += tensor.numel() * 2
        total += tensor.numel() * 2
        if shard_size >= shard_bytes:
            flush()
    flush()
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return total


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per conversion (tp·pp)")
    parser.add_argument("--shard-gb", type=float, default=0.5, help="input HF shard size")
    parser.add_argument("--out-shard-gb", type=float, default=2.0, help="exported shard size")
    parser.add_argument("--direction", choices=["both", "to_megatron", "to_hf"], default="both")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        hf_dir, mcore_dir, back_dir = tmp / "hf", tmp / "mcore", tmp / "hf_back"
        start = time.perf_counter()
        weight_bytes = write_random_checkpoint(hf_dir, args, int(args.shard_gb * 2**30))
        result = {
            "benchmark": "checkpoint_conversion",
            "shape": {
                k: getattr(args, k)
                for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
            },
            "params_b": weight_bytes / 2 / 1e9,
            "weight_gb": weight_bytes / 1e9,
            "nproc": args.nproc,
            "out_shard_gb": args.out_shard_gb,
            "write_random_s": time.perf_counter() - start,
            "torch": torch.__version__,
        }
        # Fresh interpreters per direction so ru_maxrss(children) belongs to one tool.
        tools = ROOT / "checkpoints_tools"
        to_mcore = [
            *launcher(args.nproc),
            str(tools / "hf_to_megatron.py"),
            "--hf-dir",
            str(hf_dir),
        ]
        to_mcore += [
            "--out",
            str(mcore_dir),
            "--tp",
            str(args.nproc),
            "--pp",
            "1",
            "--dtype",
            "bf16",
        ]
        to_hf = [*launcher(args.nproc), str(tools / "megatron_to_hf.py"), "--ckpt", str(mcore_dir)]
        to_hf += [
            "--out",
            str(back_dir),
            "--dtype",
            "bf16",
            "--max-shard-gb",
            str(args.out_shard_gb),
        ]
        for key, cmd in (("hf_to_megatron", to_mcore), ("megatron_to_hf", to_hf)):
            load = os.getloadavg()[0]
            probe = [sys.executable, "-c", _PROBE, json.dumps(cmd)]
            out = subprocess.run(probe, cwd=ROOT, check=True, capture_output=True, text=True)
            wall, cpu, peak_gib = json.loads(out.stdout.strip().splitlines()[-1])
            result[key] = {
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "gb_per_s": round(weight_bytes / 1e9 / wall, 3),
                "peak_rss_gib": round(peak_gib, 2),
                "peak_rss_over_model": round(peak_gib * 2**30 / weight_bytes, 2),
                "load_avg_1min_at_start": round(load, 2),
            }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out_json:
        args.out_json.write_text(text + "\n")


# Runs one tool in a child of a fresh interpreter; prints [wall_s, cpu_s, peak_rss_gib].
_PROBE = """
import json, resource, subprocess, sys, time
cmd = json.loads(sys.argv[1])
start = time.perf_counter()
subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
wall = time.perf_counter() - start
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps([wall, use.ru_utime + use.ru_stime, use.ru_maxrss / 2**20]))
"""

if __name__ == "__main__":
    main()
