"""The vLLM engine of a run, built from the config and paired with the trainer's actor.

`build` is what `rollout/engines.py` calls for `rollout.engine: vllm`: it turns the
`rollout.*` keys into `VllmEngineArgs`, writes the config.json a randomly initialised model
needs (vLLM builds it with dummy weights; the first sync puts the actor's in), starts the
engine on every rank and makes its weight sync (`VllmEngine.pair_with`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.config import DTYPE_NAMES, Config
from rl_megatron.models.hf_config import HFModelInfo, random_init_hf_config
from rl_megatron.parallel import ParallelGroups
from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs

# rollout.quantization -> vLLM's online method (a bf16 checkpoint quantized at load).
FP8_METHODS = {"fp8": "fp8_per_block"}


def build(
    config: Config, info: HFModelInfo, actor_chunks: list, tokenizer: Any, groups: ParallelGroups
) -> VllmEngine:
    """vLLM in this process (collective), ready to `sync_from` the actor.

    actor_chunks: the actor's modules (unused: vLLM holds a copy of its own).
    groups: the run's process groups; their layout is the trainer's.
    """
    del actor_chunks  # vLLM keeps its own weights; the sync copies the actor's in
    r, layout = config.rollout, groups.layout
    args = _engine_args(config, tokenizer)
    # Each training data-parallel replica passes its own prompts.
    engine = VllmEngine(args, prompt_groups=[layout.replica_ranks(k) for k in range(layout.dp)])
    engine.pair_with(
        info,
        layout,
        bucket_mb=r.weight_sync_bucket_mb,
        verify_sync=r.verify_sync,
        verify_interval=r.verify_sync_interval,
    )
    if config.actor.lora.rank > 0 and r.lora_sync == "adapter":
        from rl_megatron.rollout.vllm.lora_sync import AdapterSync

        engine.adapter_sync = AdapterSync(
            engine,
            info=info,
            groups=groups,
            lora=config.actor.lora,
            base_model=config.model.hf_path,
            run_dir=config.run_dir,
        )
    engine.sleep_level = r.sleep_level  # what it keeps while the roles train
    return engine


def build_standalone(config: Config, info: HFModelInfo, tokenizer: Any, groups: ParallelGroups):
    """Split placement's generation side: vLLM on the generation ranks (`groups`: theirs,
    TP = rollout.tp, PP 1), its weights from the training ranks through its own target
    (`trainer/split_rollouts.py`); the engine and that target."""
    from rl_megatron.rollout.vllm.target import VllmEngineTarget

    del info  # checked against the trainer's by the training side's plan
    layout = groups.layout
    args = _engine_args(config, tokenizer)
    engine = VllmEngine(args, prompt_groups=[layout.replica_ranks(k) for k in range(layout.dp)])
    return engine, VllmEngineTarget(engine)


def _engine_args(config: Config, tokenizer: Any) -> VllmEngineArgs:
    """`rollout.*` as vLLM's arguments; a random init's config.json written first."""
    r = config.rollout
    model_dir, load_format = config.model.hf_path, "auto"
    if model_dir is None:
        # A random init: vLLM builds the architecture from a config.json with random
        # weights, and the first sync (step 0) puts the actor's weights in.
        model_dir, load_format = str(config.run_dir / "rollout_model"), "dummy"
        # Every rank writes the same bytes and renames them into place: whichever
        # lands last, a reader never sees a partial file. (Not "local rank 0 writes":
        # with split placement the generating ranks may have no local rank 0.)
        Path(model_dir).mkdir(parents=True, exist_ok=True)
        text = json.dumps(random_init_hf_config(config), indent=2)
        partial = Path(model_dir) / f".config.json.{os.getpid()}"
        partial.write_text(text + "\n")
        os.replace(partial, Path(model_dir) / "config.json")
        dist.barrier()
    args = VllmEngineArgs(
        model=model_dir,
        load_format=load_format,
        tp=r.tp,
        # The trainer's dtype, not vLLM's "auto" (which runs fp32 checkpoints in bf16 on
        # CPU): the rollout policy must be the policy being trained.
        dtype=DTYPE_NAMES[config.model.dtype],
        max_model_len=r.max_prompt_length + r.max_response_length,
        gpu_memory_utilization=r.gpu_memory_utilization,
        seed=config.trainer.seed,
        enable_sleep_mode=r.enable_sleep_mode if torch.cuda.is_available() else False,
        enforce_eager=r.enforce_eager if torch.cuda.is_available() else None,
        calculate_log_probs=r.calculate_log_probs,
        return_routed_experts=config.actor.router_replay,
        pad_token_id=tokenizer.pad_token_id or 0,
        # Block scales, not vLLM's per-tensor fp8: a block's scale is its own rows' (no
        # amax reduced over the TP ranks inside every sync) and the weight keeps its
        # [out, in] layout, so the sync quantizes each rank's shard where it lands.
        quantization=FP8_METHODS[r.quantization] if r.quantization else None,
        kv_cache_dtype=r.kv_cache_dtype,
        extra={**dict(r.engine_kwargs), **_lora_kwargs(config)},
    )
    return args


# vLLM's accepted `max_lora_rank` values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_kwargs(config: Config) -> dict[str, Any]:
    """vLLM's LoRA settings for `rollout.lora_sync: adapter`: one adapter, its rank."""
    lora = config.actor.lora
    if lora.rank == 0 or config.rollout.lora_sync != "adapter":
        return {}
    max_rank = min(r for r in VLLM_LORA_RANKS if r >= lora.rank)
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
