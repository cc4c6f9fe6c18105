"""torchrun body of tests/vllm/test_vllm_moe_resharding.py: an EP=2 Qwen3-MoE actor into vLLM.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm/reshard_moe_script.py \
        --spec spec.json --out outdir

One vLLM engine (CPU build, TP 2: every expert on both ranks, each split in half) loads
checkpoint A itself; its greedy tokens, log-probs and parameters (as repacked by the CPU
build) are the reference. It is pushed checkpoint B by name (vLLM's own loader), then a
Megatron actor built from A at TP1·EP2 (each rank holds 2 of the 4 experts) is resharded into
it (`WeightSync` → `VllmEngineTarget` → vLLM's layerwise reload); the name-based full gather
(EP broadcast of each expert) does the same as the baseline. Each rank writes
`outdir/rank{r}.json`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rl_megatron.parallel import ParallelLayout
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs
from tests.vllm.reshard_script import dump, script_main


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
    from rl_megatron.rollout.vllm.target import VllmEngineTarget, _rpc_model

    model = engine.llm.collective_rpc(_rpc_model)[0]

    def params_equal_to(ref: dict[str, torch.Tensor]) -> list[str]:
        now = dict(model.named_parameters())
        return sorted(n for n, t in ref.items() if not torch.equal(now[n].detach(), t))

    greedy = SamplingParams(temperature=0, max_new_tokens=spec["max_new_tokens"], ignore_eos=True)
    prompts = spec["prompts"]
    res: dict[str, Any] = {"tp": spec["tp"]}
    res["loaded"] = dump(engine.generate(prompts, greedy))
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    res["expert_params"] = sorted(n for n in loaded if "experts" in n)
    sd_a = load_file(os.path.join(spec["ckpt_a"], "model.safetensors"))
    sd_b = load_file(os.path.join(spec["ckpt_b"], "model.safetensors"))
    engine.update_weights(sd_b, version=1)
    res["other"] = dump(engine.generate(prompts, greedy))
    res["other_params_differ"] = params_equal_to(loaded)
    # vLLM's own name-based reload of A (the CPU build repacks the experts again).
    engine.update_weights(sd_a, version=2)
    res["reloaded"] = dump(engine.generate(prompts, greedy))
    res["reloaded_params_differ"] = params_equal_to(loaded)

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron import cpu_compat
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.resharding.layouts import MEGATRON_RANK_ORDER, TrainingLayout
    from rl_megatron.resharding.weight_sync import WeightSync
    from tests.full_gather import full_gather_sync

    cpu_compat.enable_if_no_gpu()
    info = load_hf_config(spec["ckpt_a"])
    world, ep = dist.get_world_size(), spec["ep"]
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    training = TrainingLayout(1, 1, world, ep=ep, etp=1)
    actor = build_actor(spec["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.float32)
    res["actor_experts"] = sorted(
        n for n, _ in actor[0].named_parameters() if "local_experts" in n and "layers.0." in n
    )

    engine.update_weights(sd_b, version=3)  # stale weights would now show
    engine.weight_sync = WeightSync(
        VllmEngineTarget(engine), info=info, training=training, bucket_mb=spec["bucket_mb"]
    )
    stats = engine.sync_from(actor, version=4)
    res["reshard"] = {**stats.as_dict(), **dump(engine.generate(prompts, greedy))}
    res["reshard"]["params_differ"] = params_equal_to(loaded)

    engine.update_weights(sd_b, version=5)
    stats = full_gather_sync(
        actor,
        engine,
        info=info,
        training=training,
        version=6,
        bucket_mb=spec["bucket_mb"],
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
    )
    res["full_gather"] = {**stats.as_dict(), **dump(engine.generate(prompts, greedy))}
    res["full_gather"]["params_differ"] = params_equal_to(loaded)
    # rollout.verify_sync on the live MoE engine (reshard_script.py's check): the MoE's
    # stacked experts and router among the kinds corrupted one at a time.
    from tests.vllm.reshard_script import verification

    engine.update_weights(sd_b, version=7)
    engine.weight_sync = WeightSync(
        VllmEngineTarget(engine), info=info, training=training, bucket_mb=spec["bucket_mb"]
    )
    res["verify"], version = verification(engine, actor, 8, prompts, greedy)
    # Without leaving out what the CPU build repacks (its experts), the comparison would
    # see the repacked experts differ from what was sent: the check refuses, never passes.
    from rl_megatron.resharding.verify import SyncVerifier, SyncVerifyError
    from rl_megatron.rollout.vllm.verify import engine_parameters

    read = functools.partial(engine_parameters, engine, frozenset())
    engine.weight_sync.verifier = SyncVerifier("full", interval=1, read_engine=read)
    try:
        engine.sync_from(actor, version=version + 1)
        res["verify"]["unfiltered"] = None
    except SyncVerifyError as exc:
        res["verify"]["unfiltered"] = str(exc)
    return res


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
