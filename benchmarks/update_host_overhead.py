"""The host work of the trainer's actor update against a plain megatron-core loop doing the
same work, on CPU, where a tiny model makes the compute negligible and the host's work
per op is what is timed (the launch-bound MoE update of `trainer_bench.py
--interleave-update`, whose H200 gap this reproduces on a development machine).

A tiny MoE (`bench_h200_moe.yaml` at `--tiny` sizes, but with `--experts` experts top-8
and `--layers` layers: the per-layer and per-expert op counts of the H200 shape at
hidden 64) is trained for one warm-up step; its next step's actor-update phase is kept
(`update_traces.step_with_actor_update`) and a `PlainLoop` is built beside it with the
same rows per micro-batch (`plain_loop.py`; its sequences are the configured prompt +
response length). Then, per update (A: the kept phase, every optimizer step; B: as many
plain iterations):

* `ab`: A against B as interleaved rounds (`ab.py`), milliseconds and the per-round
  ratio B ÷ A, garbage collection as `trainer.manual_gc` has it. On CPU the time includes
  `cpu_compat`'s TorchFunctionMode on every tensor call, in both.
* `torch_calls`: Python-level torch calls (each one a dispatch, on a GPU most of them a
  kernel launch) and `aten_ops` (torch.profiler's op count), in A and B, and the ones
  whose counts differ.
* `value_reads`: calls that copy a tensor's values to the host (`.item()`, `.tolist()`,
  `.cpu()`, `bool`/`int`/`float` of a tensor, `nonzero`): on a GPU, where the tensor is on
  the device, each waits for it. Counted in A and B alike, so megatron-core's own
  (its per-parameter gradient-norm reads) show in both.
* with `--profile-dir`: one A and one B under cProfile (`update_traces.python_profile`:
  their top functions as text, `update_python.txt`, `plain_python.txt`), to compare
  function by function.

Writes one JSON object to stdout (and to `--out-json`). One rank, ~3 min on 2 cores at the
default 16 layers × 64 experts:

    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/update_host_overhead.py \
        --rounds 7 --profile-dir /tmp/update_host
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

from ab import interleave  # benchmarks/, on sys.path in the scripts
from bench_utils import sync, trainer_gc_policy
from plain_loop import PlainLoop
from torch.overrides import TorchFunctionMode
from trainer_bench import load_bench_config
from update_traces import kept_actor_update, python_profile

VALUE_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


class _CallCounts(TorchFunctionMode):
    """Every Python-level torch call, by function name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def _torch_calls(fn) -> collections.Counter:
    with _CallCounts() as mode:
        fn()
    return mode.counts


def _aten_ops(fn) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter({e.key: e.count for e in prof.key_averages()})


def _differing(a: collections.Counter, b: collections.Counter, top: int = 30) -> dict:
    """{name: [count in a, count in b]} where they differ, the largest differences first."""
    keys = sorted((k for k in a.keys() | b.keys() if a[k] != b[k]), key=lambda k: -abs(a[k] - b[k]))
    return {k: [a[k], b[k]] for k in keys[:top]}


def measure(args: argparse.Namespace) -> dict:
    from rl_megatron.distributed import distributed_run, launch_env
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.ppo_trainer import build_trainer
    from rl_megatron.utils.logging import get_logger

    bench_args = argparse.Namespace(
        config=args.config,
        tiny=True,
        warmup_steps=1,
        steps=1,
        run_dir=args.run_dir,
        overrides=[
            f"model.num_experts={args.experts}",
            f"model.moe_router_topk={args.topk}",
            "model.moe_ffn_hidden_size=32",
            f"model.num_layers={args.layers}",
            # The H200 run's batch shape: mini-batches of one micro-batch, 2 steps.
            f"data.train_batch_size={args.rows // 8}",
            "rollout.n=8",
            f"actor.mini_batch_size={args.rows // 2}",
            f"actor.micro_batch_size={args.rows // 2}",
            "rollout.max_response_length=16",
            *args.overrides,
        ],
        plain_micro_batch=None,
        plain_seq=None,
        plain_micro_batches=None,
    )
    config = load_bench_config(bench_args, "grpo")
    layout = ParallelLayout.from_config(config.parallel, launch_env().world_size, moe=True)
    with distributed_run(layout, seed=config.trainer.seed) as run:
        trainer = build_trainer(config, run, get_logger(run.env.rank, "WARNING"))
        trainer.train_step()  # warm-up
        trainer.step += 1
        update, _ = kept_actor_update(trainer)
        steps = config.actor.ppo_epochs * config.data.train_batch_size * config.rollout.n
        steps //= config.actor.mini_batch_size
        loop = PlainLoop(config, trainer.info, bench_args)
        loop.iteration()  # warm-up

        def plain():
            return [loop.iteration() for _ in range(steps)]

        try:
            with trainer_gc_policy(config.trainer.manual_gc):
                r = interleave(update, plain, args.rounds, warmup=1, sync=sync)
            calls = {"update": _torch_calls(update), "plain": _torch_calls(plain)}
            aten = {"update": _aten_ops(update), "plain": _aten_ops(plain)}
            if args.profile_dir is not None:
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                python_profile(update, 1, args.profile_dir, "update")
                python_profile(plain, 1, args.profile_dir, "plain")
        finally:
            loop.close()
    ms = {"update": [t * 1e3 for t in r.a_s], "plain": [t * 1e3 for t in r.b_s]}
    return {
        "benchmark": "update_host_overhead",
        "shape": f"{args.layers}L h64, {args.experts} experts top-{args.topk}",
        "optimizer_steps": steps,
        "rows_per_step": config.actor.mini_batch_size,
        "plain_seq_length": loop.seq,
        "ab": {
            "update_ms": ms["update"],
            "plain_ms": ms["plain"],
            "update_ms_median": statistics.median(ms["update"]),
            "plain_ms_median": statistics.median(ms["plain"]),
            "ratio_median": r.ratio_median,
            "ratio_min": r.ratio_min,
            "ratio_max": r.ratio_max,
        },
        "torch_calls": {k: sum(c.values()) for k, c in calls.items()},
        "aten_ops": {
            k: sum(n for op, n in c.items() if op.startswith("aten::")) for k, c in aten.items()
        },
        "value_reads": {k: {n: c[n] for n in VALUE_READS if c[n]} for k, c in calls.items()},
        "torch_calls_differing": _differing(calls["update"], calls["plain"]),
        "aten_ops_differing": _differing(aten["update"], aten["plain"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="yaml_configs/bench_h200_moe.yaml")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--rows", type=int, default=128, help="rows per update (2 steps)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved A/B rounds")
    parser.add_argument("--profile-dir", type=Path, default=None, help="cProfile A and B")
    parser.add_argument("--run-dir", default="runs/update_host_overhead")
    parser.add_argument("--out-json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    result = measure(args)
    text = json.dumps(result, indent=2)
    if args.out_json is not None:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
