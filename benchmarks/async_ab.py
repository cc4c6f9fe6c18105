"""Partial rollouts (`trainer.mode: colocated_async`) against the synchronous loop, in one run.

Issue 39's question: on one GPU, with response lengths that follow a long tail (most short,
a few at the maximum), does the asynchronous loop train more tokens per second than the
synchronous one? Target: >= 1.3x tokens/s per GPU (median over rounds, and the worst round).

One trainer is built from the config (as `trainer_bench.py` does) in `colocated_async`
mode, so it owns a `PartialRollouts` buffer; rounds then alternate, as `ab.py` orders them
(A B, then B A, ...), between

* A, asynchronous: `trainer.partial` set to the buffer, `--steps-per-round` timed steps;
* B, synchronous: `trainer.partial = None` (the trainer's `_rollout_round`), as many.

The buffer, honestly: it is kept from one asynchronous round to the next, so that the
asynchronous side is one continuous asynchronous run cut into windows, each starting
with the groups in flight the window before left (generated, and timed, there) and
leaving its own: in a long run every step inherits such a carry. The synchronous steps in
between advance the policy version; the carried tokens' versions are moved forward by as
many steps when the asynchronous side resumes, so that `rollout.max_staleness` restarts
what it would restart in the continuous run, not everything (their log-probs are the
older policy's: this measures speed, which random weights at a 1e-6 learning rate do not
change). The first `--warmup-rounds` fill the buffer (the asynchronous run's start-up).
Both sides draw records from the trainer's one data stream.

Staleness and the tail: a sample needs L / `rollout.partial.chunk_tokens` chunks and must
finish within `rollout.max_staleness` + 1 phases, while a phase runs one chunk whenever the
short groups fill the step. The default chunk (L / (max_staleness + 1)) lets the longest
sample finish in time; with smaller chunks (this benchmark's first runs had L / 4 at
staleness 1) the long samples were restarted over and over and the asynchronous side
trained a shorter mix than the sampler gives. The summary says so per side
(`trained_response_length_mean`, `trained_at_max_length_fraction`, `restarted_samples`).

What is counted, the same on both sides: the tokens of the rows a step *trains on*
(`rollout/num_samples` x (prompt + response mean length): the rows of the groups the
step took from the buffer, not the tokens the phase generated), over the step's wall time
(between two device syncs), per GPU. A round's rate is its steps' tokens over their
seconds; its ratio is A's rate over B's. The A/B record's times are seconds per million
trained tokens, so that `ab.ABResult`'s ratio, time(B) / time(A), is that ratio.

Response lengths (random weights never end a response themselves): a **length sampler**
gives every data record a target length, drawn from a fixed mixture over
L = `rollout.max_response_length`:

    70 %  short:  uniform over [1, L // 8]
    25 %  medium: uniform over [L // 8 + 1, L // 2]
     5 %  long:   exactly L (the truncated samples of a real run: finish reason "length")

(L = 1024: mean 176.5 tokens.) The draw is a function of a hash of the record's prompt
tokens (blake2b), so a record keeps its target across chunks, restarts, rounds and
ranks. The n samples of a record share it: the synchronous loop generates them in one
request per prompt, where the cap is per prompt. The trainer's `_generate` is wrapped:
every request is sent with `ignore_eos` and `prompt_max_new_tokens` = target - the tokens
the sample already has (a continuation's prompt is the record's prompt + its tokens so far;
the record is found as the longest prefix that is a dataset prompt, one hash per distinct
dataset prompt length); a row that reaches its target below L is relabelled "stop", so the
partial-rollout buffer sees it finished, as it would see an EOS.

GPU (one H200; `gpu/whole_step.sh` step `async_ab_1.5b`):

    torchrun --standalone --nproc_per_node 1 benchmarks/async_ab.py \
        --config yaml_configs/bench_h200_e2e_1.5b.yaml --out-json $OUT/async_ab_1.5b.json

CPU smoke test (the mechanics, not the target; tiny model, 4 ranks TP 2 x DP 2):

    .venv/bin/python -m rl_megatron.launcher --standalone --nproc_per_node 4 \
        benchmarks/async_ab.py --config yaml_configs/tiny_cpu.yaml --rounds 4 \
        rollout.max_response_length=32

Writes one JSON object (rank 0) to `--out-json` after every round (default
`$OUT/async_ab.json` when `$OUT` is set) and prints one line per round and a summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from array import array
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import ABResult, round_order, target_record  # noqa: E402
from bench_utils import sync  # noqa: E402
from trainer_bench import environment  # noqa: E402

ASYNC_VS_SYNC_TARGET = 1.3  # issue 39: trained tokens/s per GPU, async ÷ sync, median
ASYNC_VS_SYNC_WORST = 1.3  # and the worst round

# The length mixture: (fraction, lowest, highest target) with L = max_response_length.
MIXTURE = (
    ("short", 0.70, lambda L: 1, lambda L: max(1, L // 8)),
    ("medium", 0.25, lambda L: L // 8 + 1, lambda L: max(L // 8 + 1, L // 2)),
    ("long", 0.05, lambda L: L, lambda L: L),
)


def _digest(token_bytes: bytes) -> bytes:
    return hashlib.blake2b(token_bytes, digest_size=16).digest()


def _tokens_bytes(tokens) -> bytes:
    return array("q", tokens).tobytes()


def target_length(digest: bytes, max_len: int) -> tuple[str, int]:
    """A record's class and target response length from its prompt's digest (MIXTURE)."""
    u_class = int.from_bytes(digest[:8], "little") / 2**64
    u_len = int.from_bytes(digest[8:], "little") / 2**64
    edge = 0.0
    for name, fraction, lo, hi in MIXTURE:
        edge += fraction
        if u_class < edge or name == MIXTURE[-1][0]:
            low, high = lo(max_len), hi(max_len)
            return name, low + int(u_len * (high - low + 1))
    raise AssertionError("unreachable")


class LengthSampler:
    """Wraps `trainer._generate`: every request capped at its record's target length
    (module docstring). Install with `LengthSampler(trainer).install()`."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.max_len = trainer.config.rollout.max_response_length
        self.targets: dict[bytes, int] = {}
        counts = {name: 0 for name, *_ in MIXTURE}
        for prompt in trainer.data.train.input_ids:
            name, target = target_length(_digest(_tokens_bytes(prompt)), self.max_len)
            self.targets[_digest(_tokens_bytes(prompt))] = target
            counts[name] += 1
        self.lengths = sorted({len(p) for p in trainer.data.train.input_ids}, reverse=True)
        self.dataset = {
            "records": len(self.targets),
            "class_fraction": {k: v / max(1, len(self.targets)) for k, v in counts.items()},
            "target_mean": statistics.fmean(self.targets.values()) if self.targets else 0.0,
            "expected_target_mean": sum(
                f * (lo(self.max_len) + hi(self.max_len)) / 2 for _, f, lo, hi in MIXTURE
            ),
            "prompt_lengths": len(self.lengths),
        }
        self.inner = trainer._generate

    def install(self) -> LengthSampler:
        self.trainer._generate = self
        return self

    def _target(self, prompt: list[int]) -> tuple[int, int]:
        """(target, tokens the sample already has) of a request's prompt."""
        raw = _tokens_bytes(prompt)
        for n in self.lengths:  # longest first: a record's prompt + its tokens so far
            if n <= len(prompt):
                target = self.targets.get(_digest(raw[: 8 * n]))
                if target is not None:
                    return target, len(prompt) - n
        raise RuntimeError(
            f"async_ab length sampler: a request of {len(prompt)} tokens starts with no "
            f"training prompt; only training rollouts can be capped"
        )

    def __call__(self, prompts: list[list[int]], sampling):
        from rl_megatron.rollout.batch import FinishReason

        caps, reach = [], []
        for prompt in prompts:
            target, so_far = self._target(prompt)
            if so_far >= target:
                raise RuntimeError(
                    f"async_ab length sampler: a sample of {so_far} tokens was sent again "
                    f"although its target is {target} (it was relabelled finished)"
                )
            caps.append(target - so_far)
            reach.append(target < self.max_len)  # below L: reaching it is a "stop"
        capped = replace(sampling, ignore_eos=True, prompt_max_new_tokens=tuple(caps))
        batch = self.inner(prompts, capped)
        lengths = batch.response_lengths.tolist()
        for row, group in enumerate(batch.group_index.tolist()):
            if lengths[row] > caps[group]:
                raise RuntimeError(
                    f"async_ab length sampler: the engine returned {lengths[row]} tokens for "
                    f"a request capped at {caps[group]} (prompt_max_new_tokens ignored)"
                )
            if reach[group] and lengths[row] == caps[group]:
                batch.finish_reason[row] = int(FinishReason.STOP)
        return batch


# ------------------------------------------------------------------------------ run


def load_config(args):
    from rl_megatron.config import load_config as load
    from rl_megatron.config_checks import validate

    overrides = []
    if args.tiny:
        from trainer_bench import tiny_overrides

        overrides += tiny_overrides(load(args.config, args.overrides))
    overrides += [
        f"trainer.output_dir={args.run_dir}",
        "trainer.experiment_name=async_ab",
        "trainer.val_interval=0",
        "checkpoint.save_interval=0",
        *args.overrides,
        # Built asynchronous (it then owns the buffer); each round sets its own mode.
        "trainer.mode=colocated_async",
    ]
    config = load(args.config, overrides)
    validate(config, int(os.environ.get("WORLD_SIZE", "1")))
    return config


def timed_step(trainer) -> dict:
    """One `train_step` between two device syncs; its trained tokens and a few metrics."""
    sync()
    start = time.perf_counter()
    metrics = trainer.train_step()
    sync()
    wall = time.perf_counter() - start
    trainer.step += 1
    rows = metrics["rollout/num_samples"]  # summed over DP: the step's rows
    row = {
        "step": trainer.step,
        "wall_s": wall,
        "trained_tokens": rows
        * (metrics["rollout/prompt_length_mean"] + metrics["rollout/response_length_mean"]),
        "trained_response_tokens": rows * metrics["rollout/response_length_mean"],
    }
    row.update(
        {
            k: float(v)
            for k, v in metrics.items()
            if k.startswith(("timing_s/", "async/", "rollout/finish_"))
            or k in ("rollout/response_length_mean", "rollout/response_length_max")
        }
    )
    return row


def shift_versions(buffer, steps: int) -> None:
    """Move every carried token's policy version `steps` forward (module docstring)."""
    for group in buffer.groups:
        for sample in group.samples:
            sample.versions = [v + steps for v in sample.versions]


def run_side(trainer, buffer, asynchronous: bool, steps: int, state: dict) -> dict:
    """One side of a round: the mode set, `steps` timed steps. state["async_end"]: the
    step at which the asynchronous side last stopped (None: not yet run)."""
    trainer.partial = buffer if asynchronous else None
    shifted = 0
    if asynchronous and state.get("async_end") is not None:
        shifted = trainer.step - state["async_end"]
        shift_versions(buffer, shifted)
    carried_in = sum(not g.finished for g in buffer.groups) if asynchronous else 0
    timed = [timed_step(trainer) for _ in range(steps)]
    if asynchronous:
        state["async_end"] = trainer.step
    seconds = sum(s["wall_s"] for s in timed)
    tokens = sum(s["trained_tokens"] for s in timed)
    world = dist.get_world_size()
    return {
        "mode": "colocated_async" if asynchronous else "sync",
        "carried_in_unfinished_groups": carried_in,  # this rank's replica
        "versions_shifted_by": shifted,
        "steps": timed,
        "seconds": seconds,
        "trained_tokens": tokens,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "response_tokens_per_s_per_gpu": sum(s["trained_response_tokens"] for s in timed)
        / seconds
        / world,
    }


def summary(rounds: list[dict], side: str) -> dict:
    rates = [r[side]["tokens_per_s_per_gpu"] for r in rounds]
    steps = [s for r in rounds for s in r[side]["steps"]]
    return {
        "tokens_per_s_per_gpu": rates,
        "tokens_per_s_per_gpu_median": statistics.median(rates),
        "tokens_per_s_per_gpu_min": min(rates),
        "tokens_per_s_per_gpu_max": max(rates),
        # What the rows trained on look like: a side that trains shorter rows than the
        # sampler gives (long ones restarted, or waiting in the buffer) says so here.
        "trained_response_length_mean": statistics.fmean(
            s["rollout/response_length_mean"] for s in steps
        ),
        "trained_at_max_length_fraction": statistics.fmean(
            s.get("rollout/finish_length_frac", 0.0) for s in steps
        ),
        "restarted_samples": sum(s.get("async/restarted", 0.0) for s in steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="yaml_configs/bench_h200_e2e_1.5b.yaml")
    parser.add_argument("--steps-per-round", type=int, default=2, help="timed steps per side")
    parser.add_argument("--rounds", type=int, default=4, help="timed A/B rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--run-dir", default="runs/async_ab")
    parser.add_argument("--tiny", action="store_true", help="tiny_cpu model shape (trainer_bench)")
    parser.add_argument("--out-json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    if args.steps_per_round < 1 or args.rounds < 1 or args.warmup_rounds < 0:
        parser.error("--steps-per-round and --rounds must be >= 1, --warmup-rounds >= 0")
    if args.out_json is None and os.environ.get("OUT"):
        args.out_json = Path(os.environ["OUT"]) / "async_ab.json"

    from rl_megatron.config import to_dict
    from rl_megatron.distributed import distributed_run, launch_env
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.ppo_trainer import build_trainer
    from rl_megatron.utils.logging import get_logger

    config = load_config(args)
    layout = ParallelLayout.from_config(
        config.parallel, launch_env().world_size, moe=bool(config.model.num_experts)
    )
    command = "benchmarks/async_ab.py " + " ".join(sys.argv[1:])
    result: dict = {"benchmark": "async_ab", "args": vars(args) | {"out_json": None}}
    with distributed_run(layout, seed=config.trainer.seed) as run:
        rank0 = run.env.rank == 0
        result["environment"] = environment()
        result["config"] = to_dict(config)

        def write() -> None:  # after every round: a run cut short keeps what it measured
            if rank0 and args.out_json:
                args.out_json.parent.mkdir(parents=True, exist_ok=True)
                args.out_json.write_text(json.dumps(result, indent=2, default=str) + "\n")

        if rank0:
            shutil.rmtree(config.run_dir, ignore_errors=True)
        dist.barrier()
        start = time.perf_counter()
        trainer = build_trainer(config, run, get_logger(run.env.rank, "WARNING"))
        result["build_s"] = time.perf_counter() - start
        buffer = trainer.partial
        sampler = LengthSampler(trainer).install()
        result["length_sampler"] = {
            "mixture": [
                {
                    "class": name,
                    "fraction": f,
                    "lowest": lo(sampler.max_len),
                    "highest": hi(sampler.max_len),
                }
                for name, f, lo, hi in MIXTURE
            ],  # fmt: skip
            "keyed_by": "blake2b of the record's prompt tokens; a record's n samples share it",
            "dataset": sampler.dataset,
        }
        r = config.rollout
        result["partial"] = {
            "chunk_tokens": buffer.chunk_tokens,
            "extra_groups": buffer.extra_groups,
            "max_staleness": r.max_staleness,
            "on_stale": r.on_stale,
            "buffer_between_rounds": "kept; carried tokens' versions moved forward by the "
            "sync steps in between",
        }
        result["warmup_rounds"], result["rounds"] = [], []
        state: dict = {}
        try:
            for k in range(args.warmup_rounds + args.rounds):
                record = {}
                for side in round_order(1, a_first=k % 2 == 0):
                    name = "async" if side == "a" else "sync"
                    record[name] = run_side(
                        trainer, buffer, side == "a", args.steps_per_round, state
                    )
                record["a_first"] = k % 2 == 0
                record["ratio"] = (
                    record["async"]["tokens_per_s_per_gpu"] / record["sync"]["tokens_per_s_per_gpu"]
                )
                warm = k < args.warmup_rounds
                result["warmup_rounds" if warm else "rounds"].append(record)
                if rank0:
                    print(
                        f"round {k}{' (warm-up)' if warm else ''}: async "
                        f"{record['async']['tokens_per_s_per_gpu']:.0f} tok/s/GPU, sync "
                        f"{record['sync']['tokens_per_s_per_gpu']:.0f}, ratio "
                        f"{record['ratio']:.3f}",
                        flush=True,
                    )
                timed = result["rounds"]
                if timed:
                    # Seconds per million trained tokens: ABResult's ratio is then B ÷ A's
                    # time for the same work, the rate ratio async ÷ sync.
                    ab = ABResult(
                        a_s=[1e6 * x["async"]["seconds"] / x["async"]["trained_tokens"]
                             for x in timed],
                        b_s=[1e6 * x["sync"]["seconds"] / x["sync"]["trained_tokens"]
                             for x in timed],
                        a_first=[x["a_first"] for x in timed],
                    )  # fmt: skip
                    result["async"], result["sync"] = (
                        summary(timed, "async"),
                        summary(timed, "sync"),
                    )
                    result["ab"] = ab.as_dict()
                    result["targets"] = [
                        target_record(
                            "colocated_async ÷ sync, trained tokens/s per GPU, long-tailed "
                            f"response lengths ({config.model.num_layers}L "
                            f"h{config.model.hidden_size}, {config.data.train_batch_size} "
                            f"prompts x {r.n}, max {r.max_response_length} tokens)",
                            ab,
                            ASYNC_VS_SYNC_TARGET,
                            ASYNC_VS_SYNC_WORST,
                            command=command,
                            json_path=str(args.out_json or ""),
                        )
                    ]
                write()
        finally:
            trainer.metrics.close()
        if rank0:
            a, b, t = result["async"], result["sync"], result["targets"][0]
            print(
                f"async (colocated_async): {a['tokens_per_s_per_gpu_median']:.0f} tok/s/GPU "
                f"median [{a['tokens_per_s_per_gpu_min']:.0f}, "
                f"{a['tokens_per_s_per_gpu_max']:.0f}], trained response mean "
                f"{a['trained_response_length_mean']:.1f} ("
                f"{a['trained_at_max_length_fraction']:.3f} at the maximum), "
                f"{a['restarted_samples']:.0f} samples restarted\n"
                f"sync: {b['tokens_per_s_per_gpu_median']:.0f} tok/s/GPU median "
                f"[{b['tokens_per_s_per_gpu_min']:.0f}, {b['tokens_per_s_per_gpu_max']:.0f}], "
                f"trained response mean {b['trained_response_length_mean']:.1f} ("
                f"{b['trained_at_max_length_fraction']:.3f} at the maximum)\n"
                f"async ÷ sync: median {t['ratio_median']:.3f} [{t['ratio_min']:.3f}, "
                f"{t['ratio_max']:.3f}] over {t['repeats']} rounds; target >= "
                f"{ASYNC_VS_SYNC_TARGET} (worst round >= {ASYNC_VS_SYNC_WORST}): "
                f"{'met' if t['met'] else 'not met'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
