"""Split placement (`trainer.mode: split_async`) against the synchronous loop co-located on the
same GPUs: issue 39's two-GPU row (one generates, one trains; target >= 1.3x trained
tokens/s per GPU at the median and in the worst round).

A process cannot change placement (each side's process groups are made at launch), so the
two sides cannot alternate inside one trainer as `async_ab.py`'s do. The rounds alternate
whole launches instead, in `ab.round_order` (split, sync, then sync, split, ...): each round
starts one torchrun of `--gpus` ranks per side (this script with `--worker`), which builds
the trainer as `launch/ppo.py` does, trains `--warmup-steps` untimed steps (start-up,
engine warm-up, CUDA graphs; split's first batch has nothing to overlap with), then
`--steps` timed ones, and writes their trained tokens and seconds to a JSON file. A
round's rate per side is its timed steps' trained tokens over their seconds, divided by
the GPUs of the launch, generation ranks included; its ratio is split's rate over sync's.

* split: the last `--gpus // 2` ranks generate (`placement.rollout_ranks`), with
  `rollout.max_staleness` from the overrides (default 1: one step off);
* sync: every rank trains and generates (its engine co-located, as today's default).

Response lengths: `async_ab.py`'s length sampler (70 % short, 25 % medium, 5 % at the
maximum; a record's target keyed by a hash of its prompt tokens), installed where the
samples are made: around the trainer's `_generate` (sync) or the generation side's
(split), so both sides generate the same lengths for the same records.

What is counted: as `async_ab.py` (the rows each step trains on: `rollout/num_samples` x
(prompt + response mean length)), over the step's wall time between two device syncs on
training rank 0.

GPU (two H100s or H200s; `gpu/two_gpus.sh` step `split_ab_1.5b`):

    python3 benchmarks/split_ab.py --config yaml_configs/bench_h200_e2e_1.5b.yaml \\
        --gpus 2 --rounds 3 --warmup-steps 2 --steps 4 --out-json $OUT/split_ab_1.5b.json

CPU smoke test (the mechanics, not the target; tiny model, 4 ranks, Megatron engine):

    .venv/bin/python benchmarks/split_ab.py --config yaml_configs/tiny_cpu.yaml --gpus 4 \\
        --rounds 1 --warmup-steps 1 --steps 2 parallel.tp=1 rollout.tp=1 actor.micro_batch_size=8 \\
        rollout.max_response_length=32

Writes one JSON object to `--out-json` after every round (default `$OUT/split_ab.json`
when `$OUT` is set) and prints one line per round and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import ABResult, round_order, target_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPLIT_VS_SYNC_TARGET = 1.3  # issue 39 (b): trained tokens/s per GPU, split ÷ sync, median
SPLIT_VS_SYNC_WORST = 1.3  # and the worst round


def side_overrides(side: str, gpus: int) -> list[str]:
    if side == "split":
        return ["trainer.mode=split_async", f"placement.rollout_ranks={gpus // 2}"]
    return ["trainer.mode=sync"]


# ------------------------------------------------------------------------- worker


def worker(args) -> int:
    """One launch of one side (under torchrun): warm-up and timed steps, JSON on rank 0."""
    from async_ab import LengthSampler, timed_step

    from rl_megatron.config import load_config
    from rl_megatron.config_checks import validate
    from rl_megatron.distributed import distributed_run, launch_env
    from rl_megatron.trainer.ppo_trainer import build_trainer
    from rl_megatron.trainer.split_rollouts import GenerationSide
    from rl_megatron.utils.logging import get_logger

    env = launch_env()
    config = load_config(args.config, args.overrides)
    layout = validate(config, env.world_size)
    world = None
    if config.trainer.mode == "split_async":
        from rl_megatron.placement import generating_layout, init_split_world

        p = config.parallel
        world, _ = init_split_world(env, config.placement.rollout_ranks, p.timeout_s)
        if world.generates:
            training_layout = layout
            layout = generating_layout(config.rollout.tp, world.rollout_ranks)
    with distributed_run(layout, seed=config.trainer.seed) as run:
        run.split = world
        log = get_logger(run.env.rank, "WARNING")
        if world is not None and world.generates:
            side = GenerationSide(config, world, run, training_layout, log)
            LengthSampler(side).install()
            side.handshake()
            side.run()
            return 0
        trainer = build_trainer(config, run, log)
        if world is None:
            LengthSampler(trainer).install()
        steps = [timed_step(trainer) for _ in range(args.warmup_steps + args.steps)]
        trainer.metrics.close()
        if run.env.rank == 0:
            timed = steps[args.warmup_steps :]
            record = {
                "warmup_steps": steps[: args.warmup_steps],
                "steps": timed,
                "seconds": sum(s["wall_s"] for s in timed),
                "trained_tokens": sum(s["trained_tokens"] for s in timed),
                "gpus": env.world_size if world is None else world.world_size,
            }
            args.worker_json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


# ------------------------------------------------------------------------- driver


def launch(args, side: str, run_dir: Path, out: Path) -> dict:
    """One torchrun of `side`; its worker's record, with the launch's wall time."""
    overrides = [
        *args.overrides,
        *side_overrides(side, args.gpus),
        f"trainer.output_dir={run_dir}",
        f"trainer.experiment_name={side}",
        f"trainer.total_steps={args.warmup_steps + args.steps}",
        "trainer.val_interval=0",
        "checkpoint.save_interval=0",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={args.gpus}", __file__, "--worker", "--config", args.config]
    cmd += [f"--worker-json={out}", f"--warmup-steps={args.warmup_steps}"]
    cmd += [f"--steps={args.steps}", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} launch failed ({proc.returncode}):\n{proc.stderr[-20000:]}")
    record = json.loads(out.read_text())
    record["launch_s"] = time.perf_counter() - start
    record["tokens_per_s_per_gpu"] = record["trained_tokens"] / record["seconds"] / record["gpus"]
    return record


def summary(rounds: list[dict], side: str) -> dict:
    rates = [r[side]["tokens_per_s_per_gpu"] for r in rounds]
    steps = [s for r in rounds for s in r[side]["steps"]]
    return {
        "tokens_per_s_per_gpu": rates,
        "tokens_per_s_per_gpu_median": statistics.median(rates),
        "tokens_per_s_per_gpu_min": min(rates),
        "tokens_per_s_per_gpu_max": max(rates),
        "trained_response_length_mean": statistics.fmean(
            s["rollout/response_length_mean"] for s in steps
        ),
        "step_s_median": statistics.median(s["wall_s"] for s in steps),
    }


def driver(args) -> int:
    command = "benchmarks/split_ab.py " + " ".join(sys.argv[1:])
    result: dict = {
        "benchmark": "split_ab",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sides": {s: side_overrides(s, args.gpus) for s in ("split", "sync")},
        "rounds": [],
    }

    def write() -> None:  # after every round: a run cut short keeps what it measured
        if args.out_json:
            args.out_json.parent.mkdir(parents=True, exist_ok=True)
            args.out_json.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="split_ab_") as tmp:
        for k in range(args.first_round, args.first_round + args.rounds):
            record: dict = {"round": k, "a_first": k % 2 == 0}
            for side in round_order(1, a_first=k % 2 == 0):
                name = "split" if side == "a" else "sync"
                out = Path(tmp) / f"round{k}_{name}.json"
                record[name] = launch(args, name, Path(tmp) / f"round{k}", out)
            record["ratio"] = (
                record["split"]["tokens_per_s_per_gpu"] / record["sync"]["tokens_per_s_per_gpu"]
            )
            result["rounds"].append(record)
            print(
                f"round {k}: split {record['split']['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
                f"sync {record['sync']['tokens_per_s_per_gpu']:.0f}, ratio "
                f"{record['ratio']:.3f}",
                flush=True,
            )
            rounds = result["rounds"]
            # Seconds per million trained tokens per GPU: ABResult's ratio is then the
            # rate ratio split ÷ sync.
            ab = ABResult(
                a_s=[1e6 / r["split"]["tokens_per_s_per_gpu"] for r in rounds],
                b_s=[1e6 / r["sync"]["tokens_per_s_per_gpu"] for r in rounds],
                a_first=[r["a_first"] for r in rounds],
            )
            result["split"], result["sync"] = summary(rounds, "split"), summary(rounds, "sync")
            result["ab"] = ab.as_dict()
            result["targets"] = [
                target_record(
                    f"split_async ÷ sync co-located, trained tokens/s per GPU on {args.gpus} "
                    f"GPUs, long-tailed response lengths ({args.config})",
                    ab,
                    SPLIT_VS_SYNC_TARGET,
                    SPLIT_VS_SYNC_WORST,
                    command=command,
                    json_path=str(args.out_json or ""),
                )
            ]
            write()
    t = result["targets"][0]
    print(
        f"split ÷ sync: median {t['ratio_median']:.3f} [{t['ratio_min']:.3f}, "
        f"{t['ratio_max']:.3f}] over {t['repeats']} rounds; target >= {SPLIT_VS_SYNC_TARGET} "
        f"(worst round >= {SPLIT_VS_SYNC_WORST}): {'met' if t['met'] else 'not met'}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="yaml_configs/bench_h200_e2e_1.5b.yaml")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per launch (both sides)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="index of the first round (its parity picks which side opens it): rounds "
        "spread over several calls keep alternating",
    )
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per launch")
    parser.add_argument("--out-json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    if args.gpus < 2 or args.rounds < 1 or args.steps < 1 or args.warmup_steps < 1:
        parser.error("--gpus >= 2, --rounds >= 1, --steps >= 1, --warmup-steps >= 1")
    if args.out_json is None and os.environ.get("OUT"):
        args.out_json = Path(os.environ["OUT"]) / "split_ab.json"
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
