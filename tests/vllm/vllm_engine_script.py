"""torchrun body of tests/vllm/test_vllm_engine.py: one vLLM engine, every case, JSON out.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm/vllm_engine_script.py \
        --spec spec.json --out outdir

The spec (written by the test) names two tiny HF checkpoints (A: loaded at start-up, B:
pushed with update_weights), the prompts, the EOS id to stop on and the engine sizes.
Each rank writes `outdir/rank{r}.json` with the results of every case; the test compares
them with `transformers`. Cases run in order on one engine, because start-up dominates.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.vllm.engine import (
    VllmEngine,
    VllmEngineArgs,
    _rpc_begin_reload,
    _rpc_finish_reload,
    _rpc_load,
    import_vllm,
)


def dump(batch: RolloutBatch) -> dict[str, Any]:
    """A batch as JSON-able rows (checked for internal consistency first)."""
    batch.validate()
    lp = batch.rollout_log_probs
    rows = []
    for i in range(len(batch)):
        prompt, response = batch.row_tokens(i)
        rows.append(
            {
                "prompt": prompt,
                "response": response,
                "log_probs": None if lp is None else lp[i, : len(response)].tolist(),
                "finish": batch.finish_reasons[i],
                "group": int(batch.group_index[i]),
                "truncated": bool(batch.prompt_truncated[i]),
            }
        )
    return {
        "rows": rows,
        "weight_version": batch.weight_version,
        "metrics": batch.metrics(),
        "shape": [len(batch), batch.prompt_width, batch.responses.shape[1]],
    }


def error_of(fn) -> str | None:
    """The one-line message `fn` raises, or None when it does not raise."""
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def shm_names(engine: VllmEngine) -> dict[str, Any]:
    """The run's shared-memory ident, the name vLLM gave its TP group's segments (None
    when the group does without) and what /dev/shm holds under the ident right now."""
    from vllm.distributed.parallel_state import get_tp_group

    from rl_megatron.rollout.vllm.cpu_shm import run_segments

    communicator = get_tp_group().device_communicator
    group_name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
    ident = engine.shm_ident
    return {
        "ident": ident,
        # Whether this machine's kernels have the SHM communicator at all: vLLM's AVX2
        # build (a CPU without AVX-512) has no `init_shm_manager` and falls back to gloo.
        "shm_kernels": hasattr(torch.ops._C, "init_shm_manager"),
        "group_name": group_name,
        "left_after_start": [p.name for p in run_segments(ident)] if ident else [],
    }


def llm_generate_share(
    engine: VllmEngine, prompts: list[list[int]], sampling: SamplingParams
) -> dict[str, Any]:
    """This replica's share of `prompts` through vLLM's own `LLM.generate`, with the
    per-prompt seeded params the engine builds: what its `CoreLoop` must reproduce."""
    from rl_megatron.rollout.vllm.io import to_vllm_sampling_params

    share = list(engine.layout.share(len(prompts)))
    stop_ids = sampling.resolved_stop_token_ids(engine.eos_token_ids)
    params = [
        to_vllm_sampling_params(sampling, stop_ids, sampling.seed + i * sampling.n) for i in share
    ]
    outputs = engine.llm.generate(
        [{"prompt_token_ids": prompts[i]} for i in share], params, use_tqdm=False
    )
    rows = []
    for i, output in zip(share, outputs):
        for c in sorted(output.outputs, key=lambda c: c.index):
            tokens = list(c.token_ids)
            log_probs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]
            rows.append({"group": i, "response": tokens, "log_probs": log_probs})
    return {"rows": rows}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    engine = VllmEngine(
        VllmEngineArgs(
            model=spec["ckpt_a"],
            tp=spec["tp"],
            dtype="float32",
            max_model_len=spec["max_model_len"],
            block_size=spec["block_size"],
            gpu_memory_utilization=0.05,
            seed=0,
            enforce_eager=True,  # correctness test: no CUDA-graph capture on GPUs
        )
    )
    res["startup_s"] = time.perf_counter() - t0
    res["cpu_shm"] = shm_names(engine)
    res["layout"] = {
        "num_replicas": engine.layout.num_replicas,
        "replica_index": engine.layout.replica_index,
        "eos_token_ids": list(engine.eos_token_ids),
        "version_at_start": engine.weight_version,
    }
    prompts = spec["prompts"]
    max_new = spec["max_new_tokens"]
    greedy = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    sd_a = load_file(os.path.join(spec["ckpt_a"], "model.safetensors"))
    sd_b = load_file(os.path.join(spec["ckpt_b"], "model.safetensors"))

    # Greedy parity, prompts of different lengths, both output layouts.
    res["greedy"] = dump(engine.generate(prompts, greedy))
    res["greedy_replica"] = dump(engine.generate(prompts, greedy, output_layout="replica"))
    # EOS reached by some prompts in the middle of the batch, not by others.
    res["eos"] = dump(
        engine.generate(
            prompts,
            SamplingParams(temperature=0, max_new_tokens=max_new, stop_token_ids=[spec["eos"]]),
        )
    )
    # n > 1 with temperature; the per-request seed makes a second call identical.
    sampled = SamplingParams(temperature=0.7, n=3, max_new_tokens=8, seed=1234)
    sampled_batch = engine.generate(prompts[:3], sampled)
    res["sampled"] = dump(sampled_batch)
    res["sampled_again"] = dump(engine.generate(prompts[:3], sampled))
    res["sampled_llm_generate"] = llm_generate_share(engine, prompts[:3], sampled)
    # Per-prompt caps on new tokens (prompt_max_new_tokens, one vLLM max_tokens each): the
    # seeded samples without EOS, then the same capped at 3 / 20 (above max_new_tokens) / 5.
    free = replace(sampled, ignore_eos=True)
    res["uncapped"] = dump(engine.generate(prompts[:3], free))
    res["capped"] = dump(
        engine.generate(prompts[:3], replace(free, prompt_max_new_tokens=spec["caps"]))
    )
    # More prompt tokens per replica than one engine step takes (max_num_batched_tokens),
    # seeded: prefill spans steps. The CPU build crashed here while chunked prefill was on
    # (rolling back a discarded sample's CPU generator); the samples must equal those of
    # the same prompts and seeds in two calls of half the size.
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    res["step_budget"] = scheduler.max_num_batched_tokens
    res["chunked_prefill"] = scheduler.enable_chunked_prefill
    width = spec["max_model_len"] - 8  # room for the 4 new tokens, and 4 to spare
    per_replica = res["step_budget"] // width + 2
    shape = (per_replica * engine.layout.num_replicas, width)
    g = torch.Generator().manual_seed(11)
    many = torch.randint(3, 100, shape, generator=g).tolist()  # ids below the vocabulary (128)
    seeds = tuple(range(500, 500 + len(many)))
    over = SamplingParams(temperature=0.7, max_new_tokens=4, ignore_eos=True, prompt_seeds=seeds)
    res["over_budget"] = dump(engine.generate(many, over))
    half = len(many) // 2
    res["over_budget_halves"] = [
        dump(engine.generate(many[:half], replace(over, prompt_seeds=seeds[:half]))),
        dump(engine.generate(many[half:], replace(over, prompt_seeds=seeds[half:]))),
    ]
    res["over_budget_prompts"] = len(many)
    res["over_budget_prompt_tokens"] = len(many) * width
    # A prompt longer than the context: rejected, or truncated on the left.
    with_long = [prompts[0], spec["long_prompt"], prompts[1]]
    for policy in ("reject", "truncate_left"):
        sp = SamplingParams(
            temperature=0, max_new_tokens=max_new, ignore_eos=True, prompt_overflow=policy
        )
        res[f"overflow_{policy}"] = dump(engine.generate(with_long, sp))
    # Log-probs off (rollout.calculate_log_probs=false): the same seeded samples and the
    # same rejected row, without log-probs.
    engine.calculate_log_probs = False
    res["sampled_no_log_probs"] = dump(engine.generate(prompts[:3], sampled))
    reject = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    res["overflow_reject_no_log_probs"] = dump(engine.generate(with_long, reject))
    engine.calculate_log_probs = True
    res["bad_token_error"] = error_of(lambda: engine.generate([[5, 100000]], greedy))
    res["empty_prompt_error"] = error_of(lambda: engine.generate([[5], []], greedy))

    # Full update to checkpoint B: greedy must follow B (prefix cache reset included:
    # the long prompts' first blocks were cached above with A's weights).
    t = time.perf_counter()
    engine.update_weights(sd_b, version=1)
    res["update_s"] = time.perf_counter() - t
    res["updated"] = dump(engine.generate(prompts, greedy))

    # Bucketed update back to A; generate refuses while it is partial.
    names = sorted(sd_a)
    half = len(names) // 2
    engine.begin_weight_update(2)
    engine.load_weights({k: sd_a[k] for k in names[:half]})
    res["partial_error"] = error_of(lambda: engine.generate(prompts, greedy))
    engine.load_weights((k, sd_a[k]) for k in names[half:])
    engine.finish_weight_update()
    res["bucketed"] = dump(engine.generate(prompts, greedy))

    # An update that misses weights is refused at finish, and so is generate after it.
    engine.begin_weight_update(3)
    engine.load_weights({k: sd_b[k] for k in names[:half]})
    res["incomplete_error"] = error_of(engine.finish_weight_update)
    res["after_incomplete_error"] = error_of(lambda: engine.generate(prompts, greedy))
    engine.update_weights(sd_b, version=3)
    res["older_version_error"] = error_of(lambda: engine.begin_weight_update(2))
    res["recovered"] = dump(engine.generate(prompts, greedy))

    # sleep(level=2) discards weights: generate refuses until a full update.
    engine.sleep(level=2)
    res["asleep_error"] = error_of(lambda: engine.generate(prompts, greedy))
    engine.wake(["weights"])
    engine.update_weights(sd_a, version=4)
    res["kv_asleep_error"] = error_of(lambda: engine.generate(prompts, greedy))
    engine.wake(["kv_cache"])
    res["after_sleep"] = dump(engine.generate(prompts, greedy))

    # Control: the same reload *without* reset_prefix_cache, through the raw vLLM
    # object, to show the reset is what makes the update land for cached prompts.
    llm = engine.llm
    if engine._layerwise:
        llm.collective_rpc(_rpc_begin_reload)
    llm.collective_rpc(_rpc_load, args=(list(sd_b.items()),))
    if engine._layerwise:
        llm.collective_rpc(_rpc_finish_reload)
    stale = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        import_vllm().SamplingParams(
            temperature=0, max_tokens=max_new, ignore_eos=True, detokenize=False
        ),
        use_tqdm=False,
    )
    res["no_reset_responses"] = [list(o.outputs[0].token_ids) for o in stale]

    res["megatron"] = megatron_side(spec, prompts, greedy, sampled_batch, sampled.temperature)
    return res


def megatron_side(
    spec: dict[str, Any],
    prompts: list[list[int]],
    greedy: SamplingParams,
    sampled_batch: RolloutBatch,
    temperature: float,
) -> dict[str, Any]:
    """Checkpoint A as a Megatron actor in these same processes (TP = the rollout's):
    its greedy tokens (MegatronEngine) and its log-probs of vLLM's samples."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron import cpu_compat
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.logprob_parity import log_prob_mismatch, recompute_log_probs
    from rl_megatron.rollout.megatron.engine import MegatronEngine

    cpu_compat.enable_if_no_gpu()  # vLLM is done with these processes by now
    parallel_state.initialize_model_parallel(spec["tp"], 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    info = load_hf_config(spec["ckpt_a"])
    chunks = build_actor(spec["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.float32)
    engine = MegatronEngine(chunks, info, max_model_len=spec["max_model_len"])
    recomputed = recompute_log_probs(
        chunks,
        sampled_batch,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        temperature=temperature,
        vocab_size=info.vocab_size,
    )
    return {
        "greedy": dump(engine.generate(prompts, greedy)),
        "sampled_mismatch": log_prob_mismatch(
            sampled_batch.rollout_log_probs, recomputed, sampled_batch.response_mask
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    spec = json.loads(Path(cli.spec).read_text())
    # The trainer owns torch.distributed; vLLM joins the existing world.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    try:
        res = run(spec)
    except Exception:
        res = {"error": traceback.format_exc()}
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(res))
    # No teardown: deleting the LLM would destroy the default group under us (see
    # vllm_engine's module docstring); process exit releases everything.
    os._exit(0 if "error" not in res else 1)


if __name__ == "__main__":
    main()
