"""Multi-turn generation on the in-trainer vLLM engine against single-turn `generate` of
the same number of sampled tokens, as an interleaved A/B (`ab.py`).

A = `VllmEngine.generate_trajectories`: `--records` records × `--samples` trajectories,
each `--turns` turns of exactly `--max-new` tokens, with a synthetic environment that
answers at once with a fixed tool message of `--obs-len` tokens (the turns join the
running batch as they come: rollout/vllm/turns.py). B = `VllmEngine.generate` of the same
records × samples with `--turns × --max-new` new tokens each (`ignore_eos`). Both sample
at temperature 1 with per-request seeds (a new base seed per call, so no call decodes what
an earlier one cached). Ratio of a round = B's time / A's = multi-turn tokens/s ÷
single-turn tokens/s. Target (issue 38): ≥ 0.9× at the median on an H200.

What A pays that B does not: the observations' prefill (`--obs-len` per turn), each
turn's re-admission (its earlier tokens are prefix-cache hits, vLLM's own), and the
driver's host work between engine steps (the environment polls, `multi_turn.py`).

How every turn runs to exactly `--max-new` tokens on a random checkpoint: the engine is
given no stop token (the session's `stop_token_ids` is empty), and the driver counts
every token as an end of turn (`_FixedIncrements.stop_token_ids` is the whole
vocabulary), so no trajectory ends early and A and B sample the same number of tokens.

    torchrun --standalone --nproc_per_node 1 benchmarks/multi_turn_generation.py \
        --records 64 --samples 4 --turns 3 --max-new 128 --repeats 8   # GPU
    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone \
        --nproc_per_node 1 benchmarks/multi_turn_generation.py --records 4 --max-new 8 \
        --repeats 2   # CPU smoke: checks the mechanics, not the ratio

Shape flags are `rollout_bench.py`'s; `--batches` is unused (`--records` is the batch).
`--profile-dir DIR`: after the rounds, two more calls of each side under cProfile
(`update_traces.python_profile`: `multi_turn_python.txt`, `single_turn_python.txt`), to
say where the multi-turn side's extra host time per engine step goes (run 21: ~1.2 ms).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import rollout_bench as rb  # benchmarks/, this script's directory
import torch
import torch.distributed as dist
from ab import interleave
from bench_utils import sync
from rollout_engines_vllm import build_vllm_engine
from update_traces import python_profile

from rl_megatron.environments.base import Environment, Observation
from rl_megatron.rollout.multi_turn import MultiTurnSession, TurnBudget
from rl_megatron.rollout.sampling import SamplingParams

TARGET = 0.9


class InstantTool(Environment):
    """Answers every turn at once with the same tool message."""

    def start(self, sample):
        return [{"role": "user", "content": str(sample["index"])}]

    def step(self, response):
        return Observation(messages=[{"role": "tool", "content": "ok"}])


class _FixedIncrements:
    """`ChatIncrements` without a tokenizer: record i's prompt is `prompts[i]`, every
    observation the same `obs` ids, no tail; every token ends a turn (module docstring)."""

    def __init__(self, prompts: list[list[int]], obs: list[int], vocab: int) -> None:
        self.prompts, self.obs, self.tail = prompts, obs, []
        self.stop_token_ids = frozenset(range(vocab))

    def prompt(self, messages):
        return list(self.prompts[int(messages[0]["content"])])

    def increment(self, messages):
        return list(self.obs)

    def turn_text(self, token_ids):
        return ""


class _NoStopSession(MultiTurnSession):
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()  # the engine stops each turn at its budget only


def main() -> None:
    args = rb.parse_args(
        extra=(
            ("--records", dict(type=int, default=8, help="data records per call")),
            ("--samples", dict(type=int, default=1, help="trajectories per record (n)")),
            ("--turns", dict(type=int, default=3)),
            ("--obs-len", dict(type=int, default=8, help="tokens of each tool message")),
            ("--env-workers", dict(type=int, default=0, help="0: one per trajectory")),
            ("--warmup", dict(type=int, default=1)),
            ("--profile-dir", dict(type=Path, default=None, help="cProfile 2 calls of each")),
        )
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != 1:
        print("multi_turn_generation.py: run it as one process", file=sys.stderr)
        sys.exit(2)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (args.records, args.prompt_len), generator=gen).tolist()
    obs = torch.randint(3, args.vocab, (args.obs_len,), generator=gen).tolist()
    per_turn = args.max_new
    args.max_new = args.turns * (per_turn + args.obs_len)  # max_model_len covers a trajectory
    args.vllm_load_format = "auto"  # the checkpoint's weights: the engine can generate at once
    result: dict[str, Any] = {
        "benchmark": "multi_turn_generation",
        "config": {k: str(v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        rb.make_checkpoint(ckpt, args)
        engine, result["startup_s"] = build_vllm_engine(ckpt, args)
        engine.calculate_log_probs = True  # as the multi-turn trainer keeps them per turn
        session = _NoStopSession(
            InstantTool,
            "InstantTool",
            _FixedIncrements(prompts, obs, args.vocab),
            TurnBudget(args.turns, per_turn, engine.max_model_len),
            timeout_s=60.0,
            max_concurrent=args.env_workers,
        )
        records = [{"index": i} for i in range(args.records)]
        seeds = itertools.count(1000, 1000)
        tokens = args.records * args.samples * args.turns * per_turn

        loop = engine._core_loop
        split: dict[str, list[dict[str, float]]] = {"multi_turn": [], "single_turn": []}

        def engine_split(name: str, call):
            """`call` with its wall time split into engine-core steps and the rest."""
            seconds, steps, started = loop.step_seconds, loop.steps, time.perf_counter()
            loop.step_log, collections = [], [g["collections"] for g in gc.get_stats()]
            out = call()
            wall = time.perf_counter() - started
            in_steps = loop.step_seconds - seconds
            each = sorted(loop.step_log)
            loop.step_log = None
            split[name].append(
                {
                    "wall_s": wall,
                    "engine_steps_s": in_steps,
                    "outside_steps_s": wall - in_steps,
                    "engine_steps": loop.steps - steps,
                    # Whether the steps are slower alike or a few (a turn's prefill) are.
                    "step_ms_median": 1e3 * statistics.median(each),
                    "step_ms_p90": 1e3 * each[int(0.9 * (len(each) - 1))],
                    "slowest_4_steps_s": sum(each[-4:]),
                    # Python's collections during the call, by generation (a pause lands
                    # in whatever runs, engine steps included).
                    "gc_collections": [
                        g["collections"] - c for g, c in zip(gc.get_stats(), collections)
                    ],
                }
            )
            return out

        def multi_turn() -> dict[str, float]:
            sampling = SamplingParams(max_new_tokens=per_turn, n=args.samples, seed=next(seeds))
            trajectories, metrics = engine_split(
                "multi_turn", lambda: engine.generate_trajectories(records, sampling, session)
            )
            sampled = sum(sum(e - s for s, e in t.turns) for t in trajectories)
            assert sampled == tokens, (sampled, tokens)
            return metrics

        def single_turn() -> None:
            sampling = SamplingParams(
                max_new_tokens=args.turns * per_turn,
                n=args.samples,
                seed=next(seeds),
                ignore_eos=True,
            )
            batch = engine_split("single_turn", lambda: engine.generate(prompts, sampling))
            assert int(batch.response_lengths.sum()) == tokens

        r = interleave(multi_turn, single_turn, args.repeats, warmup=args.warmup, sync=sync)
        timed = {name: list(calls) for name, calls in split.items()}  # not the profiled ones
        if args.profile_dir is not None:
            for name, call in (("multi_turn", multi_turn), ("single_turn", single_turn)):
                result[f"profile_{name}"] = str(python_profile(call, 2, args.profile_dir, name))
        session.shutdown()
    result |= {
        "sampled_tokens_per_call": tokens,
        "multi_turn_s": r.a_s,
        "single_turn_s": r.b_s,
        "multi_turn_tokens_per_s": [tokens / s for s in r.a_s],
        "single_turn_tokens_per_s": [tokens / s for s in r.b_s],
        "ratio_per_round": r.ratios,
        "ratio_median": r.ratio_median,
        "ratio_min": r.ratio_min,
        "ratio_max": r.ratio_max,
        "target": TARGET,
        "met_median": r.ratio_median >= TARGET,
        "last_multi_turn_metrics": r.last_a,
        # Per call (the warm-up's included, first): the engine-core steps' share of the wall
        # time, and what the driver spent outside them (its host work between steps).
        "engine_split": timed,
        "engine_split_medians": {
            name: {
                k: statistics.median(c[k] for c in calls) for k in calls[0] if k != "gc_collections"
            }
            for name, calls in timed.items()
        },
    }
    print(json.dumps(result, indent=1))
    print(
        f"multi-turn ÷ single-turn tokens/s: median {r.ratio_median:.3f} "
        f"(min {r.ratio_min:.3f}, max {r.ratio_max:.3f}) over {args.repeats} rounds; "
        f"{tokens} sampled tokens per call; target >= {TARGET} at the median: "
        f"{'met' if r.ratio_median >= TARGET else 'NOT met'}"
    )
    for name, med in result["engine_split_medians"].items():
        print(
            f"{name}: median call {med['wall_s']:.3f} s = engine steps {med['engine_steps_s']:.3f} s "
            f"({med['engine_steps']:.0f} steps, {1e3 * med['engine_steps_s'] / med['engine_steps']:.2f} "
            f"ms each; median step {med['step_ms_median']:.2f} ms, p90 "
            f"{med['step_ms_p90']:.2f} ms, slowest four {med['slowest_4_steps_s']:.3f} s) "
            f"+ outside them {med['outside_steps_s']:.3f} s"
        )
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=1))
    os._exit(0)  # vLLM's engine core goes with the process (rollout_ab.py does the same)


if __name__ == "__main__":
    main()
