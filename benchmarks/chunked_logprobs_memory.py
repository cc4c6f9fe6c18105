"""Peak memory and time of log-probs + entropy (forward and backward): full logits vs chunked.

One LM head (hidden `[N, h]` @ weight `[V, h]`.T, tp = 1) and a loss
sum(g_lp * log_prob + g_ent * entropy), computed two ways:

* `full`: logits = hidden @ weight.T (all N rows at once), then
  `vocab_parallel_log_probs_and_entropy` — the trainer's path today, but only for the N
  response positions (the trainer's GPTModel also makes logits for every prompt position
  and copies the response columns out, so its real peak is higher than this one);
* `chunked`: `chunked_log_probs_and_entropy(hidden, weight, ...)`, `--chunk-tokens` rows of
  logits at a time.

Each configuration runs in its own subprocess (a fresh allocator; an OOM stays there) and
prints one JSON line; `--out` gets them all with the versions and the device.

What "peak" measures:
* CUDA: `torch.cuda.max_memory_allocated()` during forward + backward, minus what was
  allocated before it (hidden, weight, labels, upstream gradients): the extra bytes the
  log-prob computation itself needed, gradients of hidden and weight included.
* CPU: the process's peak resident set (Linux `ru_maxrss`) minus the resident set after the
  inputs were made: measured, but coarser (the allocator's own caching and page reuse).
Every line also gives `analytical_gib`, an upper estimate of the vocabulary-sized buffers
alive at once: full: N x V x (2 x dtype + 8) bytes (the logits saved for backward, their
fp32 copy and its exp / the probabilities, the gradient in the model dtype); chunked: the
same for one chunk, plus the fp32 weight-gradient accumulator V x h x 4.

GPU (Qwen2.5-1.5B head: V = 151936, h = 1536, bf16):

    python benchmarks/chunked_logprobs_memory.py --out benchmarks/results/chunked_logprobs_h200.json

CPU smoke run (small shapes):

    .venv/bin/python benchmarks/chunked_logprobs_memory.py --tokens 1024,2048 --vocab 8192 \\
        --hidden 256 --dtype float32 --chunk-tokens 256 --out /tmp/chunked_cpu.json

Needs plain PyTorch only (no megatron-core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_megatron.models.chunked_logprobs import chunked_log_probs_and_entropy  # noqa: E402
from rl_megatron.models.vocab_parallel import vocab_parallel_log_probs_and_entropy  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384,32768", help="N, comma-separated")
    p.add_argument("--vocab", type=int, default=151936, help="V (Qwen2.5: 151936)")
    p.add_argument("--hidden", type=int, default=1536, help="h (Qwen2.5-1.5B: 1536)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--chunk-tokens", default="1024", help="chunk sizes, comma-separated")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--modes", default="full,chunked")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--out", type=Path, default=None, help="JSON file for all results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # mode:N:chunk (child)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_one(args: argparse.Namespace, mode: str, n: int, chunk: int) -> dict:
    """One configuration, in this process: times and peak memory of forward + backward."""
    device, dtype = args.device, DTYPES[args.dtype]
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator(device=device).manual_seed(0)
    v, h = args.vocab, args.hidden
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype)
    weight = (torch.randn(v, h, device=device, generator=gen) * h**-0.5 * 3).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    g_lp, g_ent = torch.randn(2, n, device=device, generator=gen).unbind()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def step():
        hidden.grad = weight.grad = None
        _sync(device)
        t0 = time.perf_counter()
        if mode == "full":
            logits = hidden @ weight.t()
            lp, ent = vocab_parallel_log_probs_and_entropy(
                logits, labels, None, args.temperature, v
            )
            del logits
        else:
            lp, ent = chunked_log_probs_and_entropy(
                hidden,
                weight,
                labels,
                None,
                temperature=args.temperature,
                vocab_size=v,
                chunk_tokens=chunk,
            )
        loss = (lp * g_lp).sum() + (ent * g_ent).sum()
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, lp.detach()

    step()  # warm-up (kernels, allocator)
    hidden.grad = weight.grad = None
    if device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    fwd, bwd = [], []
    for _ in range(args.repeats):
        f, b, lp = step()
        fwd.append(f)
        bwd.append(b)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        measure = "cuda.max_memory_allocated - allocated before"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        measure = "ru_maxrss - rss after inputs (process, CPU)"
    b = torch.finfo(dtype).bits // 8
    rows = n if mode == "full" else min(chunk, n)
    analytical = rows * v * (2 * b + 8) + (v * h * 4 if mode == "chunked" else 0)
    return {
        "mode": mode,
        "tokens": n,
        "chunk_tokens": chunk if mode == "chunked" else None,
        "vocab": v,
        "hidden": h,
        "dtype": args.dtype,
        "device": device,
        "fwd_s": statistics.median(fwd),
        "bwd_s": statistics.median(bwd),
        "total_s": statistics.median([f + b for f, b in zip(fwd, bwd)]),
        "peak_extra_gib": round(peak / 2**30, 3),
        "peak_measure": measure,
        "analytical_gib": round(analytical / 2**30, 3),
        # For a cross-check between modes (same seed, same inputs).
        "log_prob_sum": float(lp.double().sum()),
        "grad_weight_norm": float(weight.grad.double().norm()),
        "grad_hidden_norm": float(hidden.grad.double().norm()),
    }


def main() -> None:
    args = parse_args()
    if args.one:
        mode, n, chunk = args.one.split(":")
        print(json.dumps(run_one(args, mode, int(n), int(chunk))), flush=True)
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    modes = args.modes.split(",")
    configs = [
        (mode, n, c)
        for n in tokens
        for mode in modes
        for c in (chunks if mode == "chunked" else chunks[:1])
    ]
    results = []
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--out")]
    if "--out" in sys.argv:  # drop the value of --out too
        i = sys.argv.index("--out")
        passthrough = sys.argv[1:i] + sys.argv[i + 2 :]
    for mode, n, c in configs:
        cmd = [sys.executable, __file__, *passthrough, "--one", f"{mode}:{n}:{c}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        line = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
        if line:
            result = json.loads(line[0])
        else:
            err = (r.stderr.strip().splitlines() or ["?"])[-1]
            oom = "out of memory" in r.stderr.lower()
            result = {"mode": mode, "tokens": n, "chunk_tokens": c, "error": err, "oom": oom}
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "cpu_count": os.cpu_count(),
            "args": {k: str(v) for k, v in vars(args).items() if k != "one"},
            "results": results,
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
