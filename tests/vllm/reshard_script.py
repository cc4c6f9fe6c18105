"""torchrun body of tests/vllm/test_vllm_resharding.py: reshard Megatron actors into vLLM.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm/reshard_script.py \
        --spec spec.json --out outdir

One vLLM engine (CPU build, rollout TP from the spec) loads checkpoint A itself; its greedy
tokens and log-probs are the reference. Then, for each training layout of the spec, the
engine is first pushed checkpoint B (so stale weights would show), a Megatron actor is
built from A in the same processes, and its weights are resharded into the engine
(`engine.sync_from`, through the engine's `WeightSync` into a `VllmEngineTarget` and vLLM's
layerwise reload on this build); greedy generation must reproduce the reference bit for
bit. The name-based full-gather path does the same as a
baseline. Each rank writes `outdir/rank{r}.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rl_megatron.parallel import ParallelLayout
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs


def dump(batch) -> dict[str, Any]:
    batch.validate()
    rows = []
    for i in range(len(batch)):
        _, response = batch.row_tokens(i)
        rows.append(
            {
                "response": response,
                "log_probs": batch.rollout_log_probs[i, : len(response)].tolist(),
            }
        )
    return {"rows": rows, "weight_version": batch.weight_version}


def verification(engine, actor, version: int, prompts, greedy) -> tuple[dict[str, Any], int]:
    """`rollout.verify_sync=full` on the live engine: an honest sync passes; then, for one
    parameter of each kind the engine holds in the format sent, its storage in the engine
    is changed by one unit in the last place right after the sync (as a mis-written
    layout would leave it): the sync must stop naming it, and generation refuse."""
    from rl_megatron.resharding.verify import SyncVerifier, SyncVerifyError, kind_of
    from rl_megatron.rollout.vllm.verify import engine_parameters, repacked_storage, verifier_for

    weight_sync = engine.weight_sync
    weight_sync.verifier = verifier_for(engine, "full", 1)
    stats = engine.sync_from(actor, version=version)
    out: dict[str, Any] = {"honest": dataclasses.asdict(stats.verify), "caught": {}}
    out["honest_rows"] = dump(engine.generate(prompts, greedy))["rows"]
    plan = weight_sync.plan
    specs = plan.targets[plan.local_rank(dist.get_rank())]
    leave_out = repacked_storage(engine)  # held repacked: not comparable, not checked
    out["repacked"] = sorted(leave_out)
    held = engine_parameters(engine, leave_out)
    readable = [s.name for s in specs if s.name in held and tuple(held[s.name].shape) == s.shape]
    picks = {}
    for name in readable:
        picks.setdefault(kind_of(name), name)
    bits = {2: torch.int16, 4: torch.int32}
    for kind, name in sorted(picks.items()):
        version += 1

        def corrupted(names=None, name=name):
            params = engine_parameters(engine, leave_out, names)
            if name in params:  # the live tensor, changed in place (each read nudges it)
                t = params[name]
                t.reshape(-1).view(bits[t.element_size()])[t.numel() // 2] += 1
            return params

        weight_sync.verifier = SyncVerifier("full", interval=1, read_engine=corrupted)
        try:
            engine.sync_from(actor, version=version)
            out["caught"][kind] = {"name": name, "error": None}
            continue
        except SyncVerifyError as exc:
            out["caught"][kind] = {"name": name, "error": str(exc)}
        try:
            engine.generate(prompts, greedy)
            out["caught"][kind]["refused"] = None
        except RuntimeError as exc:
            out["caught"][kind]["refused"] = str(exc)
    weight_sync.verifier = None
    return out, version


def run(spec: dict[str, Any]) -> dict[str, Any]:
    engine = VllmEngine(
        VllmEngineArgs(
            model=spec["ckpt_a"],
            tp=spec["tp"],
            dtype="float32",
            max_model_len=spec["max_model_len"],
            gpu_memory_utilization=0.05,
            seed=0,
        )
    )
    greedy = SamplingParams(temperature=0, max_new_tokens=spec["max_new_tokens"], ignore_eos=True)
    prompts = spec["prompts"]
    res: dict[str, Any] = {"tp": spec["tp"], "layouts": []}
    res["loaded"] = dump(engine.generate(prompts, greedy))
    sd_b = load_file(os.path.join(spec["ckpt_b"], "model.safetensors"))
    engine.update_weights(sd_b, version=1)
    res["other"] = dump(engine.generate(prompts, greedy))

    # Megatron joins the processes vLLM already runs in.
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron import cpu_compat
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.resharding.layouts import MEGATRON_RANK_ORDER, TrainingLayout
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm.target import VllmEngineTarget
    from tests.full_gather import full_gather_sync

    cpu_compat.enable_if_no_gpu()
    info = load_hf_config(spec["ckpt_a"])
    world = dist.get_world_size()
    version = 1
    for t, p in spec["layouts"]:
        ps.initialize_model_parallel(t, p, order=MEGATRON_RANK_ORDER)
        model_parallel_cuda_manual_seed(0)
        training = TrainingLayout(t, p, world // (t * p))
        actor = build_actor(spec["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.float32)
        case: dict[str, Any] = {"layout": [t, p, training.dp]}

        engine.update_weights(sd_b, version=version + 1)  # stale weights would now show
        # One weight sync per training layout (the trainer makes one, with the engine).
        engine.weight_sync = WeightSync(
            VllmEngineTarget(engine), info=info, training=training, bucket_mb=spec["bucket_mb"]
        )
        stats = engine.sync_from(actor, version=version + 2)
        case["reshard"] = {**stats.as_dict(), **dump(engine.generate(prompts, greedy))}

        engine.update_weights(sd_b, version=version + 3)
        stats = full_gather_sync(
            actor,
            engine,
            info=info,
            training=training,
            version=version + 4,
            bucket_mb=spec["bucket_mb"],
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
        )
        case["full_gather"] = {**stats.as_dict(), **dump(engine.generate(prompts, greedy))}
        res["layouts"].append(case)
        if spec.get("verify") and [t, p] == spec["layouts"][-1]:
            res["verify"], last = verification(engine, actor, version + 5, prompts, greedy)
            version = last - 4  # the loop's step below goes past the versions it used
        version += 4
        ps.destroy_model_parallel()

    # A transfer that never finishes: generate refuses.
    engine.weight_sync.target.begin(version + 1)
    try:
        engine.generate(prompts, greedy)
        res["partial_error"] = None
    except RuntimeError as exc:
        res["partial_error"] = str(exc)
    return res


def script_main(run: Callable[[dict], dict]) -> None:
    """The whole `main` of a vLLM test script run under torchrun (this one's, and
    reshard_moe_script's and lora_sync_script's): read `--spec`, join a gloo world, run
    `run(spec)`, write `rank<r>.json` into `--out` (a traceback as `error` on failure) and
    leave without teardown (deleting the LLM would destroy the default group; see
    vllm_engine.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    spec = json.loads(Path(cli.spec).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    try:
        res = run(spec)
    except Exception:
        res = {"error": traceback.format_exc()}
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(res))
    # No teardown: deleting the LLM would destroy the default group (see vllm_engine.py).
    os._exit(0 if "error" not in res else 1)


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
