"""Ways to copy an MoE actor's per-expert tensors into vLLM's stacked ones, on one GPU.

Megatron without grouped GEMM holds one tensor per expert (fc1 [2·Fe, h], fc2 [h, Fe]);
vLLM stacks a layer's experts (`w13_weight [E, 2·Fe, h]`, `w2_weight [E, h, Fe]`). This
times, for bench_h200_moe.yaml's shape (16 layers, 64 experts, h 1024, Fe 512, bf16), the
same bytes copied:

* `flat`: one copy of a flat buffer of that size (the floor `reshard_bench.py` uses);
* `foreach`: one `torch._foreach_copy_` of the 2 048 expert pairs (multi-tensor launches
  of at most 320 blocks of 64k elements);
* `cat`: one `torch.cat(experts, out=stacked)` per stacked tensor (32 calls);
* `per_tensor`: 2 048 `copy_` calls;

each issued directly and replayed from a CUDA graph (`*_graph`), and `sync_graph`: the
graph the weight sync replays for one multi-tensor copy of these pairs
(`copy_program.graph_of`: pairs of 4 MiB and more one `copy_` each, the rest in one
`_foreach_copy_`); in rounds (every way once a round), the median of the rounds after
three warm-ups. What `copy_program.Concat` is built on (runs/2026-12-02-h200-run12-moe-resharding.md).

`--shape dense-0.85b`: the dense 0.85B Llama shape's whole tensors instead (16 layers of
QKV, O, gate-up and down projections, two norms; embeddings and output layer), one source
tensor per destination, where `cat` is a one-piece `torch.cat` per tensor. Does the
concatenation kernel's speed under a graph (above a captured copy's memcpy node, and the
multi-tensor copy's 1.3 TB/s in the trainer's sync) hold for whole tensors too?

    python3 benchmarks/stacked_copy_bench.py [--rounds 15] [--shape dense-0.85b]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rl_megatron.resharding.copy_program import Bound, captured, graph_of


def graphed(fn):
    """`fn` captured into a CUDA graph after one direct call (loading its kernels), as the
    weight sync's kept copies are (`copy_program.captured`); the result replays it."""
    fn()
    torch.cuda.synchronize()
    return captured(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shape", choices=("moe-2b", "dense-0.85b"), default="moe-2b")
    args = parser.parse_args()
    if args.shape == "dense-0.85b":
        time_ways(*dense_tensors(), args.rounds)
        return
    layers, experts, hidden, ffn = 16, 64, 1024, 512
    dev, bf16 = "cuda", torch.bfloat16
    fc1 = [[torch.randn(2 * ffn, hidden, device=dev, dtype=bf16) for _ in range(experts)]
           for _ in range(layers)]  # fmt: skip
    fc2 = [[torch.randn(hidden, ffn, device=dev, dtype=bf16) for _ in range(experts)]
           for _ in range(layers)]  # fmt: skip
    w13 = [torch.empty(experts, 2 * ffn, hidden, device=dev, dtype=bf16) for _ in range(layers)]
    w2 = [torch.empty(experts, hidden, ffn, device=dev, dtype=bf16) for _ in range(layers)]
    dst = [w[e] for i in range(layers) for w in (w13[i], w2[i]) for e in range(experts)]
    src = [t for i in range(layers) for t in fc1[i] + fc2[i]]
    outs = [w.view(-1) for w in w13 + w2]
    pieces = [[t.view(-1) for t in group] for group in fc1 + fc2]

    time_ways(dst, src, outs, pieces, args.rounds)


def dense_tensors():
    """The dense 0.85B shape's tensors (bf16): destinations, sources, and each destination
    flat with its one flat piece."""
    layers, hidden, q_heads, kv_heads, head, ffn, vocab = 16, 2048, 32, 8, 64, 5632, 32000
    dev, bf16 = "cuda", torch.bfloat16
    shapes = [(vocab, hidden), (vocab, hidden), (hidden,)]
    for _ in range(layers):
        qkv = (q_heads + 2 * kv_heads) * head
        shapes += [(qkv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]
        shapes += [(hidden,), (hidden,)]
    src = [torch.randn(s, device=dev, dtype=bf16) for s in shapes]
    dst = [torch.empty(s, device=dev, dtype=bf16) for s in shapes]
    return dst, src, [d.view(-1) for d in dst], [[s.view(-1)] for s in src]


def time_ways(dst, src, outs, pieces, rounds: int) -> None:
    """Time the four ways of copying `src` into `dst` (see the module docstring)."""
    dev, bf16 = "cuda", torch.bfloat16
    nbytes = sum(t.nbytes for t in dst)
    flat_src = torch.empty(nbytes // 2, device=dev, dtype=bf16)
    flat_dst = torch.empty_like(flat_src)

    def cat() -> None:
        for out, ins in zip(outs, pieces, strict=True):
            torch.cat(ins, out=out)

    def per_tensor() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    ways = {
        "flat": lambda: flat_dst.copy_(flat_src),
        "foreach": lambda: torch._foreach_copy_(dst, src),
        "cat": cat,
        "per_tensor": per_tensor,
    }
    ways |= {f"{name}_graph": graphed(fn) for name, fn in list(ways.items())}
    ways["sync_graph"] = graph_of(Bound(dst, src, [], [], []))  # kernels loaded above
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    exact = all(map(torch.equal, dst, src))
    print(f"{nbytes / 1e9:.2f} GB in {len(dst)} tensors, equal after the copies: {exact}")
    for name, ts in times.items():
        median = statistics.median(ts[3:])
        print(f"{name:18s} {median * 1e3:7.3f} ms  {nbytes / median / 1e12:5.2f} TB/s")


if __name__ == "__main__":
    main()
