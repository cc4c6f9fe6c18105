"""The Megatron engine of a run: generation with the actor's own modules, at its layout.

`build` is what `rollout/engines.py` calls for `rollout.engine: megatron`. Nothing is
copied and nothing synced: the engine decodes with the trainer's `GPTModel` chunk, so a
sync only stamps the weight version.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.config import DTYPE_NAMES, Config
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.parallel import ParallelGroups
from rl_megatron.rollout.megatron.engine import MegatronEngine


def build(
    config: Config, info: HFModelInfo, actor_chunks: list, tokenizer: Any, groups: ParallelGroups
) -> MegatronEngine:
    """The engine on every rank (collective), decoding with `actor_chunks`."""
    r, layout = config.rollout, groups.layout
    dp_rank = layout.coordinates(dist.get_rank())["dp"]
    engine = _engine(
        config,
        info,
        actor_chunks,
        tokenizer,
        groups,
        # Every TP rank of a replica samples with the same seed; replicas differ.
        seed=config.trainer.seed + 7919 * dp_rank,
        record_routing=config.actor.router_replay,
    )
    engine.sleep_level = r.sleep_level  # frees nothing here; the version bookkeeping is the same
    return engine


def build_standalone(config: Config, info: HFModelInfo, tokenizer: Any, groups: ParallelGroups):
    """Split placement's generation side: an engine on a model of its own at the
    generation layout (`groups`: the generation ranks' own, TP = rollout.tp, PP 1), whose
    weights come from the training ranks (`trainer/split_rollouts.py`); and its target."""
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.rollout.megatron.target import MegatronEngineTarget

    m = config.model
    # Left uninitialised: the first thing the engine gets is the training side's weights.
    chunks = build_gpt_chunks(
        info,
        groups.layout,
        dtype=getattr(torch, DTYPE_NAMES[m.dtype]),
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        perform_initialization=False,
    )
    engine = _engine(config, info, chunks, tokenizer, groups, seed=config.trainer.seed)
    return engine, MegatronEngineTarget(engine)


def _engine(
    config: Config,
    info: HFModelInfo,
    chunks: list,
    tokenizer: Any,
    groups: ParallelGroups,
    *,
    seed: int,
    record_routing: bool = False,
) -> MegatronEngine:
    """The engine on `chunks` with the `rollout.*` settings; its batch holds every row of
    a step's prompts of one data-parallel replica of `groups`."""
    r = config.rollout
    eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return MegatronEngine(
        chunks,
        info,
        eos_token_ids=eos,
        max_model_len=r.max_prompt_length + r.max_response_length,
        tp_group=groups.tp,
        seed=seed,
        max_batch_size=max(1, config.data.train_batch_size // groups.layout.dp * r.n),
        pad_token_id=tokenizer.pad_token_id or 0,
        use_cuda_graphs=not r.enforce_eager,
        expert_group=groups.expert_model,
        record_routing=record_routing,
    )
