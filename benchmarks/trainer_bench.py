"""The trainer's PPO/GRPO step against a plain Megatron training loop, in one process.

Two measurements on the same model shape, builder and parallel layout (issue 8):

* `plain_loop` (`plain_loop.py`): megatron-core alone, none of our role code (and
  `plain_loop_after`, the same once more after the trainers, to bracket the host's drift
  over the run). `build_gpt_chunks` → Megatron
  DDP (distributed optimizer, fp32 grad reduce, as the roles use) → `get_megatron_optimizer`
  (Adam); each iteration runs `get_forward_backward_func` over `--plain-micro-batches` fixed
  `[micro_batch, seq]` random-token batches with GPTModel's own cross-entropy (labels =
  the inputs shifted; causal attention, no padding mask) and one optimizer step — the shape
  of one actor mini-batch. Training tokens/s and MFU. `plain_loop_masked` repeats it with
  an explicit causal mask, the attention path the trainer takes for left-padded rows.
* `trainer` (this file): `build_trainer(config, run, log)` then `trainer.train_step()` for each
  algorithm (GRPO; PPO+GAE with the critic on), `--warmup-steps` excluded from the summary.
  Per phase: seconds (`timing_s/*`, the trainer's own timers) and peak GPU memory
  (`memory_gb/*_peak`); per phase, garbage-collector pauses and CUDA allocator calls
  (`bench/<phase>_*`, `phase_probes.py`); the step's wall time; tokens/s per GPU over the
  wall time; the actor update's tokens/s per GPU and MFU (mean and median step), and their
  ratios to both plain loops' tokens/s; its seconds per optimizer step against a plain
  iteration's (`actor_step_time_vs_*`: the same rows and one optimizer step, whatever
  their lengths; `_summarise`).

The trainer counts real tokens (prompt + response lengths, no padding) in its throughput;
the plain loop's batches have no padding, so both count the same kind of token. Its
sequence length defaults to `max_prompt_length + max_response_length` (a few tokens more
than the trainer's mean sequence, which is prompt mean + response mean).

`--save` also times the checkpoint `fit` writes at the last step (first algorithm only),
and with `--profile-dir` one extra step under torch.profiler (top ops to a text file);
`--profile-update` profiles one actor update (its `train_steps`: every optimizer step of
the phase) and as many plain-loop iterations (the same work), to compare op by op, and
traces one whole actor-update phase on the GPU
(Chrome trace, device idle time and the longest waits for the host) next to two plain-loop
iterations (`plain_loop.device_idle`); one more actor-update phase and two plain
iterations run under torch's sync debug mode, which names every host-device sync's call
site (`update_actor_sync_sites`, `plain_loop.sync_sites`). The profiling and tracing
helpers are in `update_traces.py`; the sync and memory helpers in `bench_utils.py`.
`--interleave-update N` measures the update against the plain loop as an interleaved A/B
(`ab.py`), the issue-21 way, after the timed steps: one more step's actor-update phase is
kept (`update_traces.kept_actor_update`), a plain loop is built beside the trainer,
and N rounds alternate A = that update again (new weights each time, the same
work) and B = as many plain iterations as it has optimizer steps, garbage collection off
for both as `trainer.manual_gc` has it. Ratio of a round = B's time ÷ A's: the update's
speed as a multiple of the plain loop's for the same optimizer steps (target ≥ 0.9×,
worst round too; `headline.py` reads it). B's rows are the configured prompt + response
length, A's as the rollout made them (no longer), so in a compute-bound update the ratio
leans towards A; in a launch-bound one (an MoE without grouped GEMM) it does not. Then
N more rounds of the plain loop against itself (`control_plain_vs_plain`): the same work in
both slots, whose spread is the host's alone (the eleventh H200 run's update A/B spread
0.77–1.17 with its median at 0.94).
`--plain-update-batches` feeds B the update's own micro-batches instead of random tokens
(the like-for-like comparison for an MoE, whose speed depends on the tokens it routes);
`--update-calls-per-round K` makes every round K calls of each side, interleaved inside it
(`ab.round_order`), its ratio from their sums: a longer round averages the host's noise.
`--update-diagnostics N` (with `--interleave-update`) then splits that ratio into single
factors in N more rounds (`update_diagnostics.py`): the plain loop on the update's own
micro-batches (`data`), on the actor's own model, optimizer and config (`model`), and the
update against the latter (`role_code`, our role code and loss); per round the three
multiply to the update ÷ plain.
The first H200 run (RESULTS.md, 2026-11-29) patched two device-placement bugs of the
trainer in-process; they are fixed in the trainer since, and the bench patches nothing.

GPU (one H200; megatron-core from its wheel, see gpu/README.md):

    torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
        --config yaml_configs/bench_h200_1b.yaml --save --profile-dir $OUT \
        --out-json $OUT/trainer_h200_1b.json

A mixture of experts (issue 19; `yaml_configs/bench_h200_moe.yaml`: 1.97B parameters,
64 experts, top-8, 0.41B active), GRPO only, ~2 min (estimate, not measured):

    torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
        --config yaml_configs/bench_h200_moe.yaml --algorithms grpo --steps 2 \
        --out-json $OUT/trainer_h200_moe.json

and where its update ÷ plain gap comes from (~95 s more: eight rounds of the four slots;
`gpu/whole_step.sh`'s `moe_trainer` step):

    torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
        --config yaml_configs/bench_h200_moe.yaml --algorithms grpo --warmup-steps 1 \
        --steps 2 --no-plain-masked --interleave-update 8 --update-diagnostics 8 \
        --out-json $OUT/trainer_h200_moe.json \
        rollout.max_response_length=64 model.max_position_embeddings=128

CPU smoke test (the tiny_cpu model shape, a few tokens, seconds; with an MoE config, the
tiny shape keeps 4 experts, top-2, `TINY_MOE_OVERRIDES`):

    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
        --config yaml_configs/bench_h200_1b.yaml --tiny
    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
        --config yaml_configs/bench_h200_moe.yaml --tiny --algorithms grpo
    .venv/bin/torchrun --standalone --nproc_per_node 1 benchmarks/trainer_bench.py \
        --config yaml_configs/bench_h200_moe.yaml --tiny --algorithms grpo --steps 1 \
        --no-plain-masked --interleave-update 8 --update-diagnostics 8  # ~25 s

Writes one JSON object (rank 0) to `--out-json` (default `$OUT/trainer_bench.json` when
`$OUT` is set) and prints a summary table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# benchmarks/, this script's directory, is on sys.path: its siblings import as modules.
from ab import interleave, target_record
from bench_utils import allocated_gb, free_memory, gib, sync, trainer_gc_policy
from headline import UPDATE_VS_PLAIN_TARGET  # issues 8 and 19: one home for the target
from phase_probes import GC_PAUSES, probed_phases
from plain_loop import PlainLoop, plain_loop, plain_micro_batches
from update_diagnostics import recorded_micro_batches, update_diagnostics
from update_traces import (
    actor_update_sync_sites,
    kept_actor_update,
    profile_next_call,
    profile_step,
    trace_actor_update,
)

from rl_megatron.utils.flops import TransformerShape, device_peak_tflops

# The tiny_cpu model and a batch small enough for a 2-core smoke test.
TINY_OVERRIDES = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=100",
    "model.max_position_embeddings=64",
    "model.make_vocab_size_divisible_by=32",
    "model.dtype=fp32",
    "rollout.max_response_length=8",
    "rollout.n=4",
    "data.train_batch_size=4",
    "data.synthetic_size=64",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=4",
    "critic.mini_batch_size=8",
    "critic.micro_batch_size=4",
    "reference.micro_batch_size=4",
]
# With --tiny, a config with experts (model.num_experts > 0) keeps them, at tiny_moe_cpu's
# sizes.
TINY_MOE_OVERRIDES = [
    "model.num_experts=4",
    "model.moe_ffn_hidden_size=64",
    "model.moe_router_topk=2",
]


def tiny_overrides(config) -> list[str]:
    """`--tiny`'s overrides for `config`: `TINY_OVERRIDES`, and what its own settings need
    at that size: its experts kept (`TINY_MOE_OVERRIDES`); prompts cut to 16 tokens where
    they would not fit the tiny model's 64 positions; bf16 kept where the optimizer's state
    is offloaded (`optim.cpu_offload_fraction` needs it); with vLLM, heads of 32 dimensions
    (its CPU attention's smallest)."""
    out = list(TINY_OVERRIDES)
    if config.model.num_experts:
        out += TINY_MOE_OVERRIDES
    if config.rollout.max_prompt_length + 8 > 64:  # + the tiny max_response_length
        out += ["rollout.max_prompt_length=16"]
        if config.data.synthetic_prompt_length:
            out += ["data.synthetic_prompt_length=15"]
    if config.actor.optim.cpu_offload_fraction or config.critic.optim.cpu_offload_fraction:
        out += ["model.dtype=bf16"]
    if config.rollout.engine == "vllm":
        out += ["model.num_attention_heads=2", "model.num_query_groups=1"]
    return out


# Per algorithm: the overrides that make it (the critic follows from `gae`). KL terms
# (and with them the reference) come from the YAML or the command line's overrides.
ALGORITHMS = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "gae": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95"],
}


# -------------------------------------------------------------------------- trainer


def load_bench_config(args, algorithm: str):
    from rl_megatron.config import load_config
    from rl_megatron.config_checks import validate

    overrides = tiny_overrides(load_config(args.config, args.overrides)) if args.tiny else []
    overrides += ALGORITHMS[algorithm]
    overrides += [
        f"trainer.output_dir={args.run_dir}",
        f"trainer.experiment_name=trainer_bench_{algorithm}",
        f"trainer.total_steps={args.warmup_steps + args.steps}",
        "trainer.val_interval=0",
        "checkpoint.save_interval=0",
    ]
    overrides += args.overrides
    config = load_config(args.config, overrides)
    validate(config, int(os.environ.get("WORLD_SIZE", "1")))
    return config


def _summarise(
    steps: list[dict],
    flops_tok: float | None,
    plain: dict[str, float],
    plain_iter_s: dict[str, float] | None = None,
) -> dict:
    """Means over the timed steps (peaks: max), and the actor update vs the plain loops.

    plain: tokens/s per GPU of each plain loop by name (`plain_loop`, measured before the
    trainers; `plain_loop_after`, after them). The actor update's tokens/s is per GPU like
    theirs: the step's tokens are global (summed over DP), so they are divided by the world
    size. `..._median` is the median step's, which a single slow step does not move.
    plain_iter_s: seconds per iteration of each plain loop. An iteration is one optimizer
    step over the rows of one actor mini-batch (unless `--plain-micro-batch(es)` say
    otherwise), so `actor_step_time_vs_<name>` (its
    seconds ÷ the actor's per optimizer step) compares the same work whatever the tokens:
    the tokens/s ratio also counts that the trainer's rows are shorter than the plain
    loop's (prompt mean + response mean real tokens, against the full prompt + response
    length), which on a launch-bound model costs tokens/s and no time.
    """
    keys = sorted({k for s in steps for k in s})
    out: dict = {}
    for key in keys:
        values = [s[key] for s in steps if key in s]
        if key.startswith("memory_gb/"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    update_s = out.get("timing_s/update_actor")
    if not update_s:
        return out
    world = dist.get_world_size()
    per_step = [
        s["bench/actor_update_tokens"] / s["timing_s/update_actor"] / world
        for s in steps
        if s.get("timing_s/update_actor")
    ]
    rates = {
        "actor_update_tokens_per_s_per_gpu": out["bench/actor_update_tokens"] / update_s / world,
        "actor_update_tokens_per_s_per_gpu_median": statistics.median(per_step),
    }
    out.update(rates)
    peak = device_peak_tflops()
    if peak and flops_tok:
        out["actor_update_mfu"] = (
            rates["actor_update_tokens_per_s_per_gpu"] * flops_tok / (peak * 1e12)
        )
    mean_rate, median_rate = rates.values()
    for name, tok_s in plain.items():
        out[f"actor_update_vs_{name}"] = mean_rate / tok_s
        out[f"actor_update_vs_{name}_median"] = median_rate / tok_s
    step_s = update_s / out["bench/actor_optimizer_steps"]
    out["actor_update_s_per_optimizer_step"] = step_s
    for name, iter_s in (plain_iter_s or {}).items():
        out[f"actor_step_time_vs_{name}"] = iter_s / step_s
    return out


def run_trainer(
    config, run, log, args, plain: dict[str, float], plain_iter_s: dict[str, float], save: bool
) -> dict:
    """Build the trainer, run warm-up + timed steps; per-step and summary metrics."""
    from rl_megatron.config import to_dict
    from rl_megatron.trainer.ppo_trainer import build_trainer
    from rl_megatron.utils.flops import flops_per_token

    if run.env.rank == 0:
        shutil.rmtree(config.run_dir, ignore_errors=True)
    dist.barrier()
    result: dict = {"config": to_dict(config), "allocated_before_build_gb": allocated_gb()}
    start = time.perf_counter()
    trainer = build_trainer(config, run, log)
    sync()
    result["build_s"] = time.perf_counter() - start
    result["allocated_after_build_gb"] = allocated_gb()
    steps, flops_tok = [], None
    # The actor's optimizer steps per update phase (a plain-loop iteration is one).
    optimizer_steps = (
        config.actor.ppo_epochs
        * config.data.train_batch_size
        * config.rollout.n
        // config.actor.mini_batch_size
    )
    try:
        for i in range(args.warmup_steps + args.steps):
            sync()
            GC_PAUSES.reset()
            start = time.perf_counter()
            with probed_phases(trainer.phases):
                metrics = trainer.train_step()
            sync()
            wall = time.perf_counter() - start
            gc_count, gc_seconds = GC_PAUSES.count, GC_PAUSES.seconds
            trainer.step += 1
            trainer.metrics.log(trainer.step, metrics)
            phases = sum(v for k, v in metrics.items() if k.startswith("timing_s/"))
            seq = metrics["rollout/prompt_length_mean"] + metrics["rollout/response_length_mean"]
            tokens = metrics["rollout/num_samples"] * seq
            flops_tok = flops_per_token(TransformerShape.of(trainer.info), int(seq))
            row = {
                k: float(v)
                for k, v in metrics.items()
                if k.startswith(
                    (
                        *("timing_s/", "timing_parts_s/", "timing_overlap_s/", "reshard/"),
                        *("memory_gb/", "perf/", "rollout/", "bench/"),
                    )
                )
                or k in ("reward/mean", "actor/grad_norm", "actor/pg_loss", "critic/loss")
            }
            row.update(
                {
                    "bench/step_wall_s": wall,
                    "bench/gc_collections": gc_count,
                    "bench/gc_pause_s": gc_seconds,
                    "timing_s/other": wall - phases,
                    "bench/tokens": tokens,
                    "bench/actor_update_tokens": tokens * config.actor.ppo_epochs,
                    "bench/actor_optimizer_steps": optimizer_steps,
                    "bench/tokens_per_s_per_gpu_wall": tokens / wall / dist.get_world_size(),
                    # The largest of the step's phases (the allocator's own peak is
                    # reset at every phase's and part's boundary: `PhaseTimer`).
                    "bench/max_reserved_gb": max(
                        (
                            float(v)
                            for k, v in metrics.items()
                            if k.startswith("memory_gb/") and k.endswith("_reserved_peak")
                        ),
                        default=0.0,
                    ),
                }
            )
            steps.append(row)
            if run.env.rank == 0:
                print(
                    f"[{config.algorithm.adv_estimator}] step {i} "
                    f"{'(warm-up) ' if i < args.warmup_steps else ''}wall {wall:.2f}s "
                    + " ".join(
                        f"{k[9:]}={v:.2f}" for k, v in row.items() if k.startswith("timing_s/")
                    ),
                    flush=True,
                )
        result["warmup_steps"] = steps[: args.warmup_steps]
        result["timed_steps"] = steps[args.warmup_steps :]
        result["flops_per_token"] = flops_tok
        result["summary"] = _summarise(
            result["timed_steps"] or steps, flops_tok, plain, plain_iter_s
        )
        if args.interleave_update:
            result["update_vs_plain_ab"] = update_vs_plain_ab(
                trainer, config, args, optimizer_steps
            )
        if args.profile_update and args.profile_dir is not None:
            # One more step; its actor update (every optimizer step) is profiled, the same
            # work as the plain loop's profiled iterations.
            path = args.profile_dir / f"profile_actor_update_{config.algorithm.adv_estimator}.txt"
            profile_next_call(trainer.roles.actor, "train_steps", path, run.env.rank == 0)
            trainer.train_step()
            trainer.step += 1
            result["profile_actor_update"] = str(path)
            # And one more, its whole actor-update phase traced: where the device waits.
            stem = args.profile_dir / f"trace_update_actor_{config.algorithm.adv_estimator}"
            result["update_actor_device_idle"] = trace_actor_update(trainer, stem)
            # And one more, with every host-device sync of its actor update located.
            result["update_actor_sync_sites"] = actor_update_sync_sites(trainer)
        if args.profile_dir is not None and save:
            result["profile"] = profile_step(trainer, run, args.profile_dir)
        if save:
            result["checkpoint"] = _try_save(trainer, run)
    finally:
        trainer.metrics.close()
    return result  # the trainer goes with this frame (the caller measures that)


def update_vs_plain_ab(trainer, config, args, optimizer_steps: int) -> dict:
    """The actor update (A) against as many plain-loop iterations (B), interleaved rounds
    in this process (see the module docstring); the A/B record and its target, and with
    `--update-diagnostics` the gap split into single factors (`update_diagnostics`)."""
    # One more step: its actor-update phase kept, with its micro-batches (one list per
    # optimizer step, as the update made them).
    update, micro_batches = kept_actor_update(
        trainer, lambda: recorded_micro_batches(trainer.roles.actor)
    )
    loop = PlainLoop(config, trainer.info, args)
    loop.iteration()  # its warm-up: kernel selection, optimizer state
    # B's micro-batches: random tokens of the configured shape, or (--plain-update-batches)
    # the update's own, replayed: an MoE's speed depends on the tokens it routes, so for
    # one the like-for-like comparison is the same tokens through the same shapes.
    if args.plain_update_batches:
        steps = [plain_micro_batches(m) for m in micro_batches]
    else:
        steps = [None] * optimizer_steps

    def plain():
        return [loop.iteration(m) for m in steps]

    diagnostics = None
    try:
        with trainer_gc_policy(config.trainer.manual_gc):
            calls = args.update_calls_per_round
            r = interleave(
                update, plain, args.interleave_update, warmup=1, sync=sync, calls_per_round=calls
            )
            # The control: the plain loop against itself, as many rounds. The same work in
            # both slots, so its spread is the host's, the floor under the A/B's.
            control = interleave(
                plain, plain, args.interleave_update, warmup=0, sync=sync, calls_per_round=calls
            )
            if args.update_diagnostics:
                diagnostics = update_diagnostics(update, loop, trainer, config, args, micro_batches)
    finally:
        loop.close()
    m = config.model
    shape = f"{m.num_layers}L h{m.hidden_size}"
    if m.num_experts:
        shape += f", {m.num_experts} experts top-{m.moe_router_topk}"
    tokens = "the update's own micro-batches" if args.plain_update_batches else "random tokens"
    record = target_record(
        f"{config.algorithm.adv_estimator} actor update ÷ plain megatron-core loop on "
        f"{tokens}, interleaved, time for {optimizer_steps} optimizer steps ({shape})",
        r,
        UPDATE_VS_PLAIN_TARGET,
        UPDATE_VS_PLAIN_TARGET,
        command="benchmarks/trainer_bench.py " + " ".join(sys.argv[1:]),
        json_path=str(args.out_json or ""),
    )
    if dist.get_rank() == 0:
        print(
            f"update ÷ plain (interleaved, {args.interleave_update} rounds of "
            f"{args.update_calls_per_round} calls each): median "
            f"{r.ratio_median:.3f} [{r.ratio_min:.3f}, {r.ratio_max:.3f}]; control, plain ÷ "
            f"plain: median {control.ratio_median:.3f} [{control.ratio_min:.3f}, "
            f"{control.ratio_max:.3f}]",
            flush=True,
        )
    out = {
        "ab": r.as_dict(),
        "control_plain_vs_plain": control.as_dict(),
        "plain_tokens": "update_batches" if args.plain_update_batches else "random",
        "optimizer_steps": optimizer_steps,
        "target": record,
    }
    if diagnostics is not None:
        out["diagnostics"] = diagnostics
    return out


def _try_save(trainer, run) -> dict:
    """The save `fit` makes at the last step (checkpoint module in progress: report errors)."""
    sync()
    start = time.perf_counter()
    try:
        trainer.save()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the bench goes on
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    sync()
    seconds = time.perf_counter() - start
    root = trainer.config.run_dir / "checkpoints"
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
    return {"ok": True, "seconds": seconds, "bytes_on_disk": size, "path": str(root)}


# ----------------------------------------------------------------------------- main


def environment() -> dict:
    import megatron.core

    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "world_size": dist.get_world_size(),
        "command": " ".join(sys.argv),
    }
    try:
        import transformer_engine  # noqa: F401

        env["transformer_engine"] = True
    except ImportError:
        env["transformer_engine"] = False
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=torch.cuda.get_device_name(),
            device_memory_gb=gib(props.total_memory),
            cuda=torch.version.cuda,
            peak_tflops_bf16=device_peak_tflops(),
        )
    else:
        env.update(device="cpu", cpu_threads=torch.get_num_threads())
    return env


def print_summary(result: dict) -> None:
    plain = result.get("plain_loop", {})
    if "tokens_per_s_per_gpu" in plain:
        mfu = plain["mfu"]
        print(
            f"plain loop: {plain['tokens_per_s_per_gpu']:.0f} tok/s/GPU"
            f" (mb {plain['micro_batch_size']} x seq {plain['seq_length']} x "
            f"{plain['micro_batches_per_step']}), MFU {mfu if mfu is None else f'{mfu:.3f}'},"
            f" peak {plain['peak_memory_gb']:.1f} GiB"
        )
    after = result.get("plain_loop_after", {})
    if "tokens_per_s_per_gpu" in after:
        print(f"plain loop after the trainers: {after['tokens_per_s_per_gpu']:.0f} tok/s/GPU")
    masked = result.get("plain_loop_masked", {})
    if "tokens_per_s_per_gpu" in masked:
        print(
            f"plain loop, explicit mask: {masked['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
            f"peak {masked['peak_memory_gb']:.1f} GiB"
        )
    for name, res in result.get("trainer", {}).items():
        s = res.get("summary")
        if not s:
            print(f"{name}: {res.get('error', 'no summary')[-500:]}")
            continue
        phases = [k for k in s if k.startswith("timing_s/")]
        print(
            f"{name}: wall {s['bench/step_wall_s']:.2f}s/step, "
            f"{s['bench/tokens_per_s_per_gpu_wall']:.0f} tok/s/GPU, actor update "
            f"{s.get('actor_update_tokens_per_s_per_gpu', 0):.0f} tok/s "
            f"(MFU {s.get('actor_update_mfu', float('nan')):.3f}, "
            f"x{s.get('actor_update_vs_plain_loop', float('nan')):.2f} of plain, "
            f"median step x{s.get('actor_update_vs_plain_loop_median', float('nan')):.2f}; "
            f"of the plain loop after: "
            f"x{s.get('actor_update_vs_plain_loop_after', float('nan')):.2f}, "
            f"median x{s.get('actor_update_vs_plain_loop_after_median', float('nan')):.2f})"
        )
        if "actor_update_s_per_optimizer_step" in s:
            print(
                f"  actor update {s['actor_update_s_per_optimizer_step']:.3f} s per optimizer "
                f"step; a plain iteration's time ÷ it: "
                f"x{s.get('actor_step_time_vs_plain_loop', float('nan')):.2f} (before), "
                f"x{s.get('actor_step_time_vs_plain_loop_after', float('nan')):.2f} (after)"
            )
        for k in phases:
            mem = s.get(f"memory_gb/{k[9:]}_peak")
            print(f"  {k[9:]:>15}: {s[k]:7.3f} s" + (f"  peak {mem:6.1f} GiB" if mem else ""))
        if "checkpoint" in res:
            print(f"  checkpoint: {res['checkpoint']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="yaml_configs/bench_h200_1b.yaml")
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "gae"], choices=ALGORITHMS)
    parser.add_argument("--steps", type=int, default=4, help="timed trainer steps")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--plain-iters", type=int, default=10, help="timed plain-loop steps")
    parser.add_argument("--plain-warmup", type=int, default=3)
    parser.add_argument("--plain-micro-batch", type=int, default=None, help="default: actor's")
    parser.add_argument("--plain-seq", type=int, default=None, help="default: prompt+response")
    parser.add_argument("--plain-micro-batches", type=int, default=None)
    parser.add_argument("--no-plain", action="store_true", help="skip the plain loops")
    parser.add_argument(
        "--no-plain-masked", action="store_true", help="skip the explicit-mask plain loop"
    )
    parser.add_argument(
        "--save",
        action="store_true",
        help="profile (--profile-dir) and save a checkpoint after the first algorithm's steps",
    )
    parser.add_argument("--profile-dir", type=Path, default=None, help="profile one extra step")
    parser.add_argument(
        "--profile-update",
        action="store_true",
        help="with --profile-dir: profile one actor update and as many plain-loop iterations",
    )
    parser.add_argument(
        "--interleave-update",
        type=int,
        default=0,
        metavar="N",
        help="N interleaved A/B rounds of the actor update against the plain loop",
    )
    parser.add_argument(
        "--update-diagnostics",
        type=int,
        default=0,
        metavar="N",
        help="with --interleave-update: N more rounds splitting the update ÷ plain gap into "
        "single factors (data, model, role code)",
    )
    parser.add_argument(
        "--plain-update-batches",
        action="store_true",
        help="with --interleave-update: the plain loop on the update's own micro-batches "
        "(same tokens), not random ones",
    )
    parser.add_argument(
        "--update-calls-per-round",
        type=int,
        default=1,
        metavar="K",
        help="K calls of each side in every --interleave-update / --update-diagnostics "
        "round, interleaved inside it (a round's ratio from its sums)",
    )
    parser.add_argument("--run-dir", default="runs/trainer_bench")
    parser.add_argument("--tiny", action="store_true", help="tiny_cpu model: CPU smoke test")
    parser.add_argument("--out-json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    if args.update_diagnostics and not args.interleave_update:
        parser.error("--update-diagnostics needs --interleave-update")
    if args.plain_update_batches and not args.interleave_update:
        parser.error("--plain-update-batches needs --interleave-update")
    if args.update_calls_per_round < 1:
        parser.error(f"--update-calls-per-round must be >= 1, got {args.update_calls_per_round}")
    if args.tiny:
        args.plain_iters, args.plain_warmup = min(args.plain_iters, 2), min(args.plain_warmup, 1)
    if args.out_json is None and os.environ.get("OUT"):
        args.out_json = Path(os.environ["OUT"]) / "trainer_bench.json"

    from rl_megatron.distributed import distributed_run, launch_env
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.build import model_info
    from rl_megatron.utils.logging import get_logger

    configs = {name: load_bench_config(args, name) for name in args.algorithms}
    first = next(iter(configs.values()))
    moe = bool(first.model.num_experts)
    layout = ParallelLayout.from_config(first.parallel, launch_env().world_size, moe=moe)
    result: dict = {"benchmark": "trainer_step", "args": vars(args) | {"out_json": None}}
    with distributed_run(layout, seed=first.trainer.seed) as run:
        log = get_logger(run.env.rank, "WARNING")
        result["environment"] = environment()
        info = model_info(first)

        def write() -> None:
            # After every part, so a run cut short still leaves what it measured.
            if run.env.rank == 0 and args.out_json:
                args.out_json.parent.mkdir(parents=True, exist_ok=True)
                args.out_json.write_text(json.dumps(result, indent=2, default=str) + "\n")

        def measure_plain(key: str, masked: bool = False, profile: bool = True) -> None:
            result[key] = plain_loop(first, info, args, masked=masked, profile=profile)
            free_memory()
            result[key]["allocated_after_return_gb"] = allocated_gb()
            if run.env.rank == 0:
                print(f"{key}: {result[key]}", flush=True)
            write()

        plain: dict[str, float] = {}  # tokens/s per GPU
        plain_iter_s: dict[str, float] = {}  # seconds per iteration (one optimizer step)
        if not args.no_plain:
            measure_plain("plain_loop")
            if not args.no_plain_masked:
                measure_plain("plain_loop_masked", masked=True)
            plain["plain_loop"] = result["plain_loop"]["tokens_per_s_per_gpu"]
            plain_iter_s["plain_loop"] = result["plain_loop"]["seconds_per_iter"]
        result["trainer"] = {}
        for i, (name, config) in enumerate(configs.items()):
            try:
                result["trainer"][name] = run_trainer(
                    config, run, log, args, plain, plain_iter_s, save=args.save and i == 0
                )
            except Exception:  # noqa: BLE001 - one failing algorithm must not lose the rest
                if dist.get_world_size() > 1:
                    raise
                result["trainer"][name] = {"error": traceback.format_exc()[-4000:]}
            free_memory()
            result["trainer"][name]["allocated_after_return_gb"] = allocated_gb()
            write()
        if not args.no_plain:
            # The plain loop once more, after the trainers: the host and the GPU may not run
            # at the speed they ran at first (the ratio is given against both).
            measure_plain("plain_loop_after", profile=False)
            plain["plain_loop_after"] = result["plain_loop_after"]["tokens_per_s_per_gpu"]
            plain_iter_s["plain_loop_after"] = result["plain_loop_after"]["seconds_per_iter"]
            for res in result["trainer"].values():
                if "timed_steps" in res:
                    steps = res["timed_steps"] or res["warmup_steps"]
                    res["summary"] = _summarise(steps, res["flops_per_token"], plain, plain_iter_s)
            write()
        if run.env.rank == 0:
            print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
