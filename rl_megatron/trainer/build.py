"""Everything the PPO loop needs, built from the config on every rank: data, roles, engine.

Kept apart from the loop so `ppo_trainer.py` reads as the algorithm. Each builder raises a
one-line user error (`DataError`, `ConfigError`, `HFConfigError`) for bad input, identically
on every rank, before any collective that could leave other ranks waiting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from rl_megatron.checkpoint.hf_builders import (
    build_actor,
    build_critic,
    build_reference,
    build_reward_model,
)
from rl_megatron.config import DTYPE_NAMES, Config, ConfigError, OffloadConfig
from rl_megatron.data.datasets import DataError
from rl_megatron.data.synthetic import CharTokenizer, synthetic_dataset
from rl_megatron.data.tokenize import PromptTokenizer, TokenizedPrompts, tokenize_prompts
from rl_megatron.distributed import DistributedRun
from rl_megatron.models.builders import ValueHead, build_gpt_chunks
from rl_megatron.models.hf_config import (
    HFModelInfo,
    load_hf_config,
    moe_loss_overrides,
    parse_hf_config,
    random_init_hf_config,
)
from rl_megatron.models.lora import apply_lora
from rl_megatron.parallel import ParallelGroups, ParallelLayout
from rl_megatron.rollout import engines
from rl_megatron.rollout.engine import RolloutEngine
from rl_megatron.trainer.base_reference import BaseReference
from rl_megatron.trainer.roles import MegatronRole

DTYPES = {short: getattr(torch, name) for short, name in DTYPE_NAMES.items()}


# ---------------------------------------------------------------------------- data


@dataclass
class TrainingData:
    tokenizer: Any  # PromptTokenizer or the synthetic CharTokenizer (same methods)
    train: TokenizedPrompts
    val: TokenizedPrompts | None

    def metrics(self) -> dict[str, float]:
        """What the length policy did to the training prompts at load, for every step's
        metrics (constant over the run). The engines apply the same limit to what they are
        given, so after the load policy their own per-batch count is always 0: this value
        replaces it under the same key."""
        return {"rollout/prompts_truncated": float(self.train.num_truncated)}


def build_data(config: Config, logger: logging.Logger) -> TrainingData:
    """Tokenizer, training and validation prompts after the length policy (counts logged)."""
    d, r = config.data, config.rollout
    # The length policy is applied once, here; the engines only ever see prompts that fit.
    overflow = r.prompt_overflow
    if d.synthetic_task is not None:
        tokenizer = CharTokenizer()
        seed, length = config.trainer.seed, d.synthetic_prompt_length
        train_set = synthetic_dataset(d.synthetic_task, d.synthetic_size, seed, length=length)
        val_size = d.val_size or d.val_batch_size
        val_set = synthetic_dataset(d.synthetic_task, val_size, seed, "val", length=length)
    else:
        from rl_megatron.data.datasets import dataset_from_config

        # Records first: a bad file is named before any tokenizer is loaded.
        train_set = dataset_from_config(config, "train")
        val_set = dataset_from_config(config, "val") if d.val_files else None
        tokenizer = PromptTokenizer.from_config(config)
    if len(tokenizer) > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {config.model.vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens"
        )
    limit = r.max_prompt_length
    train = tokenize_prompts(train_set, tokenizer, limit, overflow, "data.train_files", logger)
    val = None
    if val_set is not None:
        val = tokenize_prompts(val_set, tokenizer, limit, overflow, "data.val_files", logger)
    if len(train) < d.train_batch_size:
        raise DataError(
            f"data.train_files: {len(train)} usable prompts ({train.num_read} read, "
            f"{train.num_filtered} filtered as too long) are fewer than one batch of "
            f"data.train_batch_size={d.train_batch_size}"
        )
    return TrainingData(tokenizer, train, val)


# --------------------------------------------------------------------------- model


def model_info(config: Config) -> HFModelInfo:
    """The model's architecture: the HF checkpoint's, or the config's for a random init."""
    if config.model.hf_path is not None:
        return load_hf_config(config.model.hf_path)
    return parse_hf_config(random_init_hf_config(config))


@dataclass
class Roles:
    actor: MegatronRole
    critic: MegatronRole | None
    reference: MegatronRole | BaseReference | None  # BaseReference: the LoRA actor's base
    reward_model: MegatronRole | None

    def trainable(self) -> dict[str, MegatronRole]:
        """The roles whose state a checkpoint must hold (frozen ones are rebuilt)."""
        out = {"actor": self.actor}
        if self.critic is not None:
            out["critic"] = self.critic
        return out


def _random_chunks(
    config: Config, info: HFModelInfo, layout: ParallelLayout, value_head: bool, extra: dict
) -> list:
    """Randomly initialised chunks (no `model.hf_path`): the demo and the tests."""
    chunks = build_gpt_chunks(info, layout, value_head=value_head, **extra)
    for chunk in chunks:
        if isinstance(getattr(chunk, "output_layer", None), ValueHead):
            chunk.output_layer.reset_parameters(config.trainer.seed)
    return chunks


@torch.no_grad()
def _copy_trunk(src: list, dst: list) -> None:
    """Copy `src` chunks' parameters into `dst` where names and shapes match (not the head)."""
    for a, b in zip(src, dst):
        theirs = dict(a.named_parameters())
        for name, param in b.named_parameters():
            if name in theirs and theirs[name].shape == param.shape:
                param.copy_(theirs[name])


def build_roles(
    config: Config, info: HFModelInfo, total_steps: int, groups: ParallelGroups
) -> Roles:
    """Actor, and critic / reference / reward model where the config enables them.

    groups: the run's process groups (`DistributedRun.groups`); the models are built at
        their layout (`run.layout`), every degree from there.
    """
    m, layout = config.model, groups.layout
    dtype = DTYPES[m.dtype]
    extra = {"dtype": dtype, "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by}
    if m.num_experts:
        extra.update(moe_loss_overrides(m.moe_aux_loss_coeff, m.moe_z_loss_coeff))
    act, cr, ref = config.actor, config.critic, config.reference
    # Recompute only matters where activations are kept for a backward: the trained roles.
    actor_extra = {**extra, **act.recompute.transformer_config()}
    if act.lora.rank > 0:
        # Adapters wrap megatron-core's own linears: TE's fused layer-norm linear hides the
        # normalised input an adapter needs, so a LoRA actor takes the local layer spec
        # (same checkpoint keys) and one MLP per expert.
        actor_extra["use_te"] = False
        if m.num_experts:
            actor_extra["moe_grouped_gemm"] = False
    critic_extra = {**extra, **cr.recompute.transformer_config()}
    if m.hf_path is not None:
        actor_chunks = build_actor(m.hf_path, layout, **actor_extra)
    else:
        actor_chunks = _random_chunks(config, info, layout, False, actor_extra)
    if act.lora.rank > 0:
        # Adapters before DDP, so only they get grad buffers and optimizer state.
        lora = act.lora
        apply_lora(
            actor_chunks,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=lora.target_modules,
            seed=config.trainer.seed,
        )
    temperature = config.rollout.temperature or 1.0

    reference = None
    # With LoRA the frozen base is the reference: made from the actor below, not built.
    if ref.enable and act.lora.rank == 0:
        if m.hf_path is not None:
            ref_chunks = build_reference(m.hf_path, layout, **extra)
        else:
            ref_chunks = _random_chunks(config, info, layout, False, extra)
            _copy_trunk(actor_chunks, ref_chunks)
            for chunk in ref_chunks:
                chunk.eval()
                chunk.requires_grad_(False)
        reference = MegatronRole(
            ref_chunks,
            name="reference",
            groups=groups,
            pack_sequences=m.pack_sequences,
            logprob_chunk_tokens=m.logprob_chunk_tokens,
            micro_batch_size=ref.micro_batch_size,
            temperature=temperature,
            offload=OffloadConfig(params=ref.offload_params),
        )
    critic = None
    if cr.enable:
        if cr.init_from is not None:
            critic_chunks = build_critic(cr.init_from, layout, init_from="reward", **critic_extra)
        elif m.hf_path is not None:
            critic_chunks = build_critic(
                m.hf_path, layout, head_seed=config.trainer.seed, **critic_extra
            )
        else:
            critic_chunks = _random_chunks(config, info, layout, True, critic_extra)
            _copy_trunk(actor_chunks, critic_chunks)
        critic = MegatronRole(
            critic_chunks,
            name="critic",
            groups=groups,
            on_nonfinite=config.trainer.on_nonfinite,
            pack_sequences=m.pack_sequences,
            optim=cr.optim,
            micro_batch_size=cr.micro_batch_size,
            total_steps=total_steps * cr.ppo_epochs * _mini_batches(config, cr.mini_batch_size),
            offload=cr.offload,
        )
    reward_model = None
    if config.reward.type == "model":
        rm_chunks = build_reward_model(config.reward.model_path, layout, **extra)
        reward_model = MegatronRole(
            rm_chunks,
            name="reward model",
            groups=groups,
            pack_sequences=m.pack_sequences,
            micro_batch_size=config.reward.micro_batch_size,
            output_at="token",
        )
    actor = MegatronRole(
        actor_chunks,
        name="actor",
        groups=groups,
        on_nonfinite=config.trainer.on_nonfinite,
        pack_sequences=m.pack_sequences,
        logprob_chunk_tokens=m.logprob_chunk_tokens,
        optim=act.optim,
        micro_batch_size=act.micro_batch_size,
        use_dynamic_batch=act.use_dynamic_batch,
        max_tokens_per_micro_batch=act.max_tokens_per_micro_batch,
        temperature=temperature,
        total_steps=total_steps * act.ppo_epochs * _mini_batches(config, act.mini_batch_size),
        offload=act.offload,
        router_replay=act.router_replay,
    )
    if ref.enable and act.lora.rank > 0:
        reference = BaseReference(actor, ref.micro_batch_size)
    return Roles(actor, critic, reference, reward_model)


def _mini_batches(config: Config, mini_batch_size: int) -> int:
    return config.data.train_batch_size * config.rollout.n // mini_batch_size


# -------------------------------------------------------------------------- engine


def build_engine(
    config: Config, info: HFModelInfo, actor: MegatronRole, tokenizer: Any, run: DistributedRun
) -> RolloutEngine:
    """The rollout engine the config names, on every rank (collective), ready to
    `sync_from` the actor (`rollout/engines.py`; each engine builds and pairs itself)."""
    return engines.build_engine(config, info, actor.model, tokenizer, run.groups)
