"""Every range and cross-field check of a `Config`, one function per config section.

`validate(config, world_size)` runs the sections in a fixed order and stops at the first
failed check, raising ConfigError with a one-line message that names the dotted key.
Kept apart from `config.py` so that the schema there reads as a list of fields.
"""

from __future__ import annotations

import importlib.util
from pathlib import PurePosixPath

from rl_megatron.config import (
    ActorConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    EnvironmentConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RecomputeConfig,
    RolloutConfig,
    TrainerConfig,
)
from rl_megatron.parallel import ParallelLayout, check_degrees

__all__ = ["validate"]


def validate(config: Config, world_size: int) -> ParallelLayout:
    """Every range and cross-field check; raises ConfigError naming the dotted key.

    Returns the run's parallel layout, built (and checked) once here.

    Args:
        config: a loaded config (`load_config`), with its `None = derived` defaults resolved.
        world_size: ranks in the run (torchrun's WORLD_SIZE).
    """
    p = config.parallel
    _check_model(config.model)
    # split_async: the training layout spans the ranks that do not generate.
    world_size = _check_placement(config, world_size)
    layout = _check_parallel(p, config.model, world_size)
    _check_rollout(config.rollout, p, config.model)
    _check_context_parallel(config)
    _check_algorithm(config)
    _check_data(config.data, config.trainer)
    _check_router_replay(config)
    _check_lora(config)
    if config.model.num_experts:
        for key in ("save_hf", "save_hf_adapter"):
            _require(
                not getattr(config.checkpoint, key) or p.ep == 1,
                f"checkpoint.{key}",
                f"an MoE actor at parallel.ep={p.ep} cannot be exported from memory yet; set "
                "it false and convert a checkpoint with checkpoints_tools/megatron_to_hf.py",
            )
    _check_actor_critic(config, layout.dp)
    _check_optimizer_cpu_offload(config)
    _check_run(config.trainer, config.checkpoint, config.logging)
    _check_environment(config)
    _check_async(config)
    return layout


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def _check_model(m: ModelConfig) -> None:
    for key in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "vocab_size",
    ):
        _require(
            getattr(m, key) is not None, f"model.{key}", "required when model.hf_path is not set"
        )
        _require(getattr(m, key) > 0, f"model.{key}", f"must be > 0, got {getattr(m, key)}")
    _require(m.num_query_groups > 0, "model.num_query_groups", "must be > 0")
    _require(
        m.num_attention_heads % m.num_query_groups == 0,
        "model.num_query_groups",
        f"{m.num_query_groups} does not divide num_attention_heads={m.num_attention_heads}",
    )
    _require(
        m.make_vocab_size_divisible_by > 0, "model.make_vocab_size_divisible_by", "must be > 0"
    )
    _require(
        m.logprob_chunk_tokens >= 0,
        "model.logprob_chunk_tokens",
        f"must be >= 0 (0 = full logits), got {m.logprob_chunk_tokens}",
    )
    _check_moe(m)


def _check_moe(m: ModelConfig) -> None:
    _require(m.num_experts >= 0, "model.num_experts", f"must be >= 0, got {m.num_experts}")
    _require(m.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", "must be >= 0 (0 = off)")
    _require(m.moe_z_loss_coeff >= 0, "model.moe_z_loss_coeff", "must be >= 0 (0 = off)")
    if not m.num_experts:
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            _require(
                getattr(m, key) == 0, f"model.{key}", "needs an MoE model (model.num_experts > 0)"
            )
        return
    _require(
        1 <= m.moe_router_topk <= m.num_experts,
        "model.moe_router_topk",
        f"must be in [1, model.num_experts={m.num_experts}], got {m.moe_router_topk}",
    )
    _require(
        m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size > 0,
        "model.moe_ffn_hidden_size",
        f"must be > 0, got {m.moe_ffn_hidden_size}",
    )


def _check_parallel(p: ParallelConfig, m: ModelConfig, world_size: int) -> ParallelLayout:
    check_degrees(p)  # the layout's own checks, before any division by a degree
    moe = m.num_experts > 0
    keys = ("num_attention_heads", "num_query_groups") + (() if moe else ("ffn_hidden_size",))
    for key in keys:
        size = getattr(m, key)
        _require(size % p.tp == 0, "parallel.tp", f"{p.tp} does not divide model.{key}={size}")
    if moe:
        _check_expert_split(p, m)
    _require(
        m.num_layers % p.pp == 0,
        "parallel.pp",
        f"{p.pp} does not divide model.num_layers={m.num_layers}",
    )
    if p.vpp is not None:
        _require(
            m.num_layers % (p.pp * p.vpp) == 0,
            "parallel.vpp",
            f"pp·vpp = {p.pp * p.vpp} does not divide model.num_layers={m.num_layers}",
        )
    _require(p.timeout_s > 0, "parallel.timeout_s", "must be > 0")
    _require(p.rendezvous_timeout_s > 0, "parallel.rendezvous_timeout_s", "must be > 0")
    return ParallelLayout.from_config(p, world_size, moe=moe)  # and against the world size


def _check_expert_split(p: ParallelConfig, m: ModelConfig) -> None:
    """An MoE model's experts over ep ranks, each expert's FFN over etp ranks."""
    _require(
        m.num_experts % p.ep == 0,
        "parallel.ep",
        f"{p.ep} does not divide model.num_experts={m.num_experts}",
    )
    _require(
        m.moe_ffn_hidden_size % p.etp == 0,
        "parallel.etp",
        f"{p.etp} does not divide model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}",
    )
    # megatron-core's MoELayer refuses to train at tp > 1 without sequence parallelism.
    _require(
        p.tp == 1 or p.sequence_parallel,
        "parallel.sequence_parallel",
        f"megatron-core trains an MoE model at parallel.tp={p.tp} only with sequence "
        "parallelism; set it true (or tp=1 and split the experts with parallel.ep)",
    )


def _check_rollout(r: RolloutConfig, p: ParallelConfig, m: ModelConfig) -> None:
    _require(r.tp >= 1, "rollout.tp", f"must be >= 1, got {r.tp}")
    _require(
        (p.tp * p.pp) % r.tp == 0,
        "rollout.tp",
        f"{r.tp} does not divide parallel.tp·parallel.pp = {p.tp * p.pp}",
    )
    _require(
        m.num_attention_heads % r.tp == 0 and m.num_query_groups % r.tp == 0,
        "rollout.tp",
        f"{r.tp} does not divide the attention heads / query groups of the model",
    )
    _require(r.n >= 1, "rollout.n", f"must be >= 1, got {r.n}")
    _require(
        r.temperature > 0 or r.n == 1,
        "rollout.n",
        f"greedy sampling (rollout.temperature=0) gives {r.n} identical responses; use n=1",
    )
    _require(r.temperature >= 0, "rollout.temperature", "must be >= 0")
    _require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _require(r.top_k == -1 or r.top_k > 0, "rollout.top_k", "must be -1 (off) or > 0")
    _require(r.max_prompt_length > 0, "rollout.max_prompt_length", "must be > 0")
    _require(r.max_response_length > 0, "rollout.max_response_length", "must be > 0")
    _require(
        r.max_prompt_length + r.max_response_length <= m.max_position_embeddings,
        "rollout.max_response_length",
        f"max_prompt_length + max_response_length = "
        f"{r.max_prompt_length + r.max_response_length} exceeds "
        f"model.max_position_embeddings={m.max_position_embeddings}",
    )
    _require(r.weight_sync_bucket_mb > 0, "rollout.weight_sync_bucket_mb", "must be > 0")
    _require(r.verify_sync_interval >= 1, "rollout.verify_sync_interval", "must be >= 1")
    _require(r.sync_probe_prompts >= 0, "rollout.sync_probe_prompts", "must be >= 0 (0 = off)")
    _require(
        r.sync_probe_prompts == 0 or 1 <= r.sync_probe_tokens <= r.max_response_length,
        "rollout.sync_probe_tokens",
        f"must be in [1, rollout.max_response_length={r.max_response_length}], "
        f"got {r.sync_probe_tokens}",
    )
    _require(
        r.sync_probe_prompts == 0 or r.calculate_log_probs is not False,
        "rollout.sync_probe_prompts",
        "the probe compares the engine's log-probs with the trainer's; "
        "rollout.calculate_log_probs is false",
    )
    _check_fp8(r)


def _check_fp8(r: RolloutConfig) -> None:
    """FP8 weights or KV cache: the vLLM engine on a GPU with FP8 units only."""
    for key, on in (
        ("rollout.quantization", r.quantization is not None),
        ("rollout.kv_cache_dtype", r.kv_cache_dtype != "auto"),
    ):
        if not on:
            continue
        _require(
            r.engine == "vllm",
            key,
            f"FP8 generation needs rollout.engine=vllm (the {r.engine} engine generates with "
            "the trainer's weights); leave it out",
        )
        _require(
            _has_fp8_gpu(),
            key,
            "fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper); this machine has "
            "none (vLLM's CPU build has no FP8 kernels here: DESIGN.md §7); leave it out",
        )


def _has_fp8_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _check_context_parallel(config: Config) -> None:
    """What runs with parallel.cp > 1: the training roles on our SDPA attention (every
    sequence padded to a multiple of 2·cp by the roles themselves, so no length setting
    can conflict) and the Megatron engine, each CP rank generating whole rows."""
    cp = config.parallel.cp
    if cp == 1:
        return
    _require(
        importlib.util.find_spec("transformer_engine") is None,
        "parallel.cp",
        f"{cp}: context parallelism runs on rl_megatron's SDPA attention only, and "
        "Transformer Engine (installed here) would replace it; use parallel.cp=1",
    )
    _require(
        not getattr(config.model, "num_experts", 0),
        "parallel.cp",
        f"{cp}: context parallelism with an MoE model is not supported yet; use parallel.cp=1",
    )


def _check_algorithm(config: Config) -> None:
    """The algorithm's own ranges, then the roles and samples its choices need."""
    a = config.algorithm
    _require(0 <= a.gamma <= 1, "algorithm.gamma", f"must be in [0, 1], got {a.gamma}")
    _require(0 <= a.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {a.lam}")
    _require(a.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0")
    _require(a.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", "must be > 0")
    _require(a.kl_ctrl.horizon > 0, "algorithm.kl_ctrl.horizon", "must be > 0")
    if a.adv_estimator == "gae":
        _require(
            bool(config.critic.enable),
            "critic.enable",
            "algorithm.adv_estimator=gae needs a critic",
        )
    if a.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        _require(
            config.rollout.n >= 2,
            "rollout.n",
            f"algorithm.adv_estimator={a.adv_estimator} needs n >= 2 samples",
        )
    if a.use_kl_in_reward or config.actor.use_kl_loss:
        _require(bool(config.reference.enable), "reference.enable", "a KL term needs the reference")
    full_kl = {
        "algorithm.kl_penalty": a.use_kl_in_reward and a.kl_penalty == "full",
        "actor.kl_loss_type": config.actor.use_kl_loss and config.actor.kl_loss_type == "full",
    }
    for key, used in full_kl.items():
        # The reference runs beside the actor on each micro-batch: one pipeline stage only.
        _require(
            not used or config.parallel.pp == 1,
            key,
            f"full needs parallel.pp=1 (the reference's logits are computed beside the "
            f"actor's on each micro-batch); got pp={config.parallel.pp}; use k3",
        )
    _check_rollout_correction(config)
    ds = a.dynamic_sampling
    _require(
        ds.max_extra_rounds >= 0, "algorithm.dynamic_sampling.max_extra_rounds", "must be >= 0"
    )
    if ds.enable:
        _require(
            config.rollout.n >= 2,
            "algorithm.dynamic_sampling.enable",
            f"needs groups of rollout.n >= 2 samples to tell informative groups; n={config.rollout.n}",
        )
    ob = config.reward.overlong_buffer
    if ob.enable:
        max_len = config.rollout.max_response_length
        _require(
            0 < ob.length <= max_len,
            "reward.overlong_buffer.length",
            f"must be in (0, rollout.max_response_length={max_len}], got {ob.length}",
        )
        _require(ob.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor", "must be >= 0")


def _check_band(band: list[float], key: str) -> None:
    _require(len(band) == 2, key, f"expected [lower, upper], got {band}")
    lower, upper = band
    _require(
        0 <= lower <= 1 <= upper and lower < upper,
        key,
        f"needs 0 <= lower <= 1 <= upper (a ratio of 1, on-policy, is kept), got {band}",
    )


def _check_rollout_correction(config: Config) -> None:
    rc = config.algorithm.rollout_correction
    key = "algorithm.rollout_correction"
    if rc.level is None:
        _require(
            rc.rejection is None,
            f"{key}.rejection",
            f"needs {key}.level (token or sequence) to say what is rejected",
        )
        return
    _require(
        rc.threshold is not None or rc.rejection is not None,
        f"{key}.level",
        f"is set but both {key}.threshold and {key}.rejection are null: nothing to correct",
    )
    if isinstance(rc.threshold, list):
        _check_band(rc.threshold, f"{key}.threshold")
    elif rc.threshold is not None:
        _require(
            rc.threshold >= 1,
            f"{key}.threshold",
            f"must be >= 1 (a ratio of 1, on-policy, keeps its weight), got {rc.threshold}",
        )
    if rc.rejection is not None:
        _check_band(rc.rejection, f"{key}.rejection")


def _check_data(d: DataConfig, t: TrainerConfig) -> None:
    if d.synthetic_task is None:
        _require(
            bool(d.train_files),
            "data.train_files",
            "no training data; give JSONL/Parquet files or set data.synthetic_task",
        )
    else:
        _require(
            not d.train_files,
            "data.synthetic_task",
            "is set together with data.train_files; choose one",
        )
        _require(d.synthetic_size > 0, "data.synthetic_size", "must be > 0")
    _require(
        t.val_interval == 0 or bool(d.val_files) or d.synthetic_task is not None,
        "trainer.val_interval",
        "evaluation needs data.val_files (or data.synthetic_task)",
    )


def _check_router_replay(config: Config) -> None:
    act = config.actor
    if not act.router_replay:
        return
    _require(
        config.model.num_experts > 0,
        "actor.router_replay",
        "needs an MoE model (model.num_experts > 0)",
    )
    # Both engines record the routing: vLLM (`enable_return_routed_experts`) and the
    # Megatron engine (hooks on the actor's own routers).
    # The replay covers a forward; an MoE layer recomputed in the backward would route
    # again by itself, and its gradient would belong to another routing.
    rc = act.recompute
    _require(
        rc.granularity == "none"
        or (rc.granularity == "selective" and not {"moe", "mlp"} & set(rc.modules)),
        "actor.recompute",
        "routing replay needs the MoE layers kept for the backward (no full recompute, no "
        "mlp / moe modules), or set actor.router_replay false",
    )


LORA_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def _check_lora(config: Config) -> None:
    """`actor.lora`: its ranges, and what the adapters cannot be combined with yet."""
    lora = config.actor.lora
    _require(lora.rank >= 0, "actor.lora.rank", f"must be >= 0 (0 = off), got {lora.rank}")
    _require(lora.alpha > 0, "actor.lora.alpha", f"must be > 0, got {lora.alpha}")
    _require(0 <= lora.dropout < 1, "actor.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    unknown = sorted(set(lora.target_modules) - set(LORA_MODULES))
    _require(
        not unknown,
        "actor.lora.target_modules",
        f"unknown module(s) {unknown}; choose from {list(LORA_MODULES)} (megatron-core names)",
    )
    _require(bool(lora.target_modules), "actor.lora.target_modules", "must name a module")
    _require(
        lora.rank > 0 or not config.checkpoint.save_hf_adapter,
        "checkpoint.save_hf_adapter",
        "writes LoRA adapters, but actor.lora.rank is 0 (no adapters); use checkpoint.save_hf",
    )
    if lora.rank == 0:
        _require(
            config.rollout.lora_sync == "merged",
            "rollout.lora_sync",
            "adapter needs a LoRA actor (actor.lora.rank > 0)",
        )
        return
    if "output_layer" in lora.target_modules:
        _require(
            len(lora.target_modules) > 1,
            "actor.lora.target_modules",
            "output_layer needs a layer module beside it (the other pipeline stages would "
            "have nothing to train)",
        )
        _require(
            not config.model.tie_word_embeddings,
            "actor.lora.target_modules",
            "output_layer is tied to the input embedding (model.tie_word_embeddings); "
            "merging an adapter into it would change the embedding too",
        )
    a = config.algorithm
    # The reference is the actor with its adapters off: one model, so never both at once.
    for key, full in (
        ("algorithm.kl_penalty", a.use_kl_in_reward and a.kl_penalty == "full"),
        ("actor.kl_loss_type", config.actor.use_kl_loss and config.actor.kl_loss_type == "full"),
    ):
        _require(
            not full,
            key,
            "full needs the reference's logits beside the actor's, but with actor.lora.rank > 0 "
            "the reference is the actor with its adapters disabled; use k3",
        )
    _require(
        not config.parallel.sequence_parallel,
        "parallel.sequence_parallel",
        "a LoRA actor takes megatron-core's local layer spec (models/lora.py), whose norms "
        "do not take sequence parallelism; set it false with actor.lora.rank > 0",
    )
    # rollout.engine=vllm is sent the merged weights W + (alpha/r)·B·A by the weight sync
    # (resharding/lora_merge.py), FP8 engines included: their target quantizes what lands.
    if config.rollout.lora_sync == "adapter":
        _check_adapter_sync(config)
    _require(
        config.parallel.etp == 1
        or "linear_fc1" not in lora.target_modules
        and "linear_fc2" not in lora.target_modules
        or not config.model.num_experts,
        "actor.lora.target_modules",
        f"LoRA on experts split over parallel.etp={config.parallel.etp} ranks is not built; "
        "use etp=1 or leave linear_fc1/linear_fc2 out",
    )


def _check_adapter_sync(config: Config) -> None:
    """`rollout.lora_sync: adapter` (rollout/vllm/lora_sync.py): what vLLM's LoRA path and
    the adapter-only sync cover."""
    r, lora = config.rollout, config.actor.lora
    key = "rollout.lora_sync"
    _require(r.engine == "vllm", key, f"adapter needs rollout.engine=vllm, got {r.engine}")
    _require(
        "output_layer" not in lora.target_modules,
        key,
        "adapter does not send an LM-head adapter (actor.lora.target_modules has "
        "output_layer); use merged",
    )
    _require(
        not config.model.num_experts,
        key,
        "adapter is built for dense models; an MoE actor's experts need merged",
    )
    _require(r.quantization is None, key, "adapter with rollout.quantization=fp8: use merged")
    _require(
        config.model.hf_path is not None,
        key,
        "adapter needs model.hf_path: vLLM loads the frozen base from it (a random init's "
        "base would have to be synced into vLLM's LoRA-wrapped layers); use merged",
    )
    _require(
        r.verify_sync == "off",
        "rollout.verify_sync",
        "reads back the weights a sync sent; with rollout.lora_sync=adapter none are sent",
    )
    _require(
        r.sleep_level <= 1,
        key,
        "adapter with rollout.sleep_level=2 would send the discarded base every step "
        "(what merged costs); use sleep_level 1 or lora_sync merged",
    )
    _require(lora.rank <= 512, "actor.lora.rank", f"vLLM's LoRA takes rank <= 512, got {lora.rank}")


def _check_actor_critic(config: Config, dp: int) -> None:
    """How a step's batch splits into mini- and micro-batches, then the loss settings."""
    act, cr = config.actor, config.critic
    sequences = config.data.train_batch_size * config.rollout.n
    _require(config.data.train_batch_size > 0, "data.train_batch_size", "must be > 0")
    _require(
        config.data.train_batch_size % dp == 0,
        "data.train_batch_size",
        f"{config.data.train_batch_size} prompts do not split over {dp} data-parallel ranks",
    )
    for section, role in (("actor", act), ("critic", cr)):
        if section == "critic" and not cr.enable:
            continue
        _check_role(role, section, sequences, dp)
        _check_recompute(role.recompute, f"{section}.recompute")
    _require(0 <= act.clip_ratio_low < 1, "actor.clip_ratio_low", "must be in [0, 1)")
    _require(
        0 <= act.clip_ratio_high < 1,
        "actor.clip_ratio_high",
        f"must be in [0, 1), got {act.clip_ratio_high}",
    )
    _require(act.clip_ratio_c > 1, "actor.clip_ratio_c", f"must be > 1, got {act.clip_ratio_c}")
    _require(act.max_tokens_per_micro_batch > 0, "actor.max_tokens_per_micro_batch", "must be > 0")
    _require(cr.cliprange_value > 0, "critic.cliprange_value", "must be > 0")
    if config.reward.type == "model":
        _require(config.reward.model_path is not None, "reward.model_path", "needed by type=model")
    _check_reward_timeout(config)


def _check_reward_timeout(config: Config) -> None:
    """A hung reward call must end before the ranks waiting for its scores give up."""
    limit, parallel_limit = config.reward.timeout_s, config.parallel.timeout_s
    _require(limit > 0, "reward.timeout_s", f"must be > 0, got {limit:g}")
    _require(
        limit < parallel_limit / 2,
        "reward.timeout_s",
        f"{limit:g} must be below half of parallel.timeout_s={parallel_limit} (the ranks that "
        "wait for the scores give up after parallel.timeout_s; a batch's calls get half of it)",
    )


def _check_role(role: ActorConfig | CriticConfig, section: str, sequences: int, dp: int) -> None:
    """One trained role (`actor` or `critic`): its optimizer and batch split."""
    _check_optim(role.optim, f"{section}.optim")
    _require(role.ppo_epochs >= 1, f"{section}.ppo_epochs", "must be >= 1")
    _require(role.micro_batch_size >= 1, f"{section}.micro_batch_size", "must be >= 1")
    _require(
        sequences % role.mini_batch_size == 0,
        f"{section}.mini_batch_size",
        f"{role.mini_batch_size} does not divide the {sequences} sequences of a step "
        "(data.train_batch_size · rollout.n)",
    )
    _require(
        role.mini_batch_size % (role.micro_batch_size * dp) == 0,
        f"{section}.mini_batch_size",
        f"{role.mini_batch_size} is not divisible by micro_batch_size·dp = "
        f"{role.micro_batch_size}·{dp}",
    )


# megatron-core's selective-recompute modules that run without Transformer Engine's grouped
# GEMM (its `moe_act` needs it; `mla_up_proj` needs MLA, which no supported family has).
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "shared_experts")


def _check_recompute(rc: RecomputeConfig, key: str) -> None:
    if rc.granularity == "selective":
        _require(bool(rc.modules), f"{key}.modules", "selective recompute needs modules")
        unknown = sorted(set(rc.modules) - set(RECOMPUTE_MODULES))
        _require(
            not unknown,
            f"{key}.modules",
            f"unknown {unknown}; choose from {list(RECOMPUTE_MODULES)}",
        )
        # megatron-core drops the norms' outputs through Transformer Engine's FP8 state.
        _require(
            "layernorm" not in rc.modules or importlib.util.find_spec("transformer_engine"),
            f"{key}.modules",
            "layernorm recompute needs Transformer Engine, which is not installed",
        )
    if rc.granularity == "full":
        _require(rc.num_layers >= 1, f"{key}.num_layers", f"must be >= 1, got {rc.num_layers}")


def _check_optim(optim: OptimConfig, key: str) -> None:
    _require(optim.lr >= 0, f"{key}.lr", f"must be >= 0, got {optim.lr}")
    _require(0 <= optim.min_lr <= optim.lr, f"{key}.min_lr", "must be in [0, lr]")
    _require(optim.lr_warmup_steps >= 0, f"{key}.lr_warmup_steps", "must be >= 0")
    _require(0 <= optim.adam_beta1 < 1, f"{key}.adam_beta1", "must be in [0, 1)")
    _require(0 <= optim.adam_beta2 < 1, f"{key}.adam_beta2", "must be in [0, 1)")
    _require(optim.adam_eps > 0, f"{key}.adam_eps", "must be > 0")
    _require(optim.clip_grad >= 0, f"{key}.clip_grad", "must be >= 0 (0 = off)")
    _require(optim.weight_decay >= 0, f"{key}.weight_decay", "must be >= 0")
    _require(
        0 <= optim.cpu_offload_fraction <= 1,
        f"{key}.cpu_offload_fraction",
        f"must be in [0, 1] (0 = off), got {optim.cpu_offload_fraction}",
    )


def _check_optimizer_cpu_offload(config: Config) -> None:
    """megatron-core's optimizer CPU offload keeps fp32 copies of 16-bit weights: with fp32
    weights it fails, and with fp16 (loss scaling) it does not reproduce the default
    optimizer's steps. `offload.optimizer` combines with it: it moves the device share."""
    for section, role in (("actor", config.actor), ("critic", config.critic)):
        if section == "critic" and not config.critic.enable:
            continue
        _require(
            role.optim.cpu_offload_fraction == 0 or config.model.dtype == "bf16",
            f"{section}.optim.cpu_offload_fraction",
            f"needs model.dtype=bf16 (megatron-core's optimizer CPU offload keeps fp32 copies "
            f"of bf16 weights), got {config.model.dtype}; set it 0 or use bf16",
        )


def _check_run(t: TrainerConfig, c: CheckpointConfig, log: LoggingConfig) -> None:
    """Trainer, checkpoint and logging: the run's length and cadence."""
    _require(t.total_epochs >= 1, "trainer.total_epochs", "must be >= 1")
    _require(t.total_steps is None or t.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    _require(t.val_interval >= 0, "trainer.val_interval", "must be >= 0")
    _require(t.manual_gc_interval >= 0, "trainer.manual_gc_interval", "must be >= 0")
    _check_experiment_name(t.experiment_name)
    _require(c.save_interval >= 0, "checkpoint.save_interval", "must be >= 0")
    _require(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _require(log.log_interval >= 1, "logging.log_interval", "must be >= 1")
    _require(
        not log.wandb or importlib.util.find_spec("wandb") is not None,
        "logging.wandb",
        "needs the wandb package (pip install wandb); or set logging.wandb=false",
    )


def _check_experiment_name(name: str) -> None:
    """The run folder (output_dir/experiment_name) must be a folder inside output_dir:
    a name that leaves it would write into, resume from and prune checkpoints of another
    directory. Sub-folders (`team/exp1`) are fine; symlinks are the user's business."""
    key = "trainer.experiment_name"
    _require(bool(name.strip()), key, "must not be empty")
    path = PurePosixPath(name)
    _require(
        not path.is_absolute() and ".." not in path.parts,
        key,
        f"{name!r} leaves trainer.output_dir; use a relative name without '..' "
        "(the run folder is trainer.output_dir/trainer.experiment_name)",
    )
    _require(
        bool(path.parts),  # "." and "./" have none
        key,
        f"{name!r} names trainer.output_dir itself; give the run a folder of its own",
    )


def _check_environment(config: Config) -> None:
    """environment.* and rollout.multi_turn: limits that keep a trajectory bounded."""
    env: EnvironmentConfig = config.environment
    if env.function is None:
        _require(
            config.reward.type != "rule" or config.reward.function is not None,
            "reward.function",
            "null needs environment.function (an environment whose observations carry "
            "the reward); name a rule reward",
        )
        return
    parallel_limit = config.parallel.timeout_s
    _require(env.timeout_s > 0, "environment.timeout_s", f"must be > 0, got {env.timeout_s:g}")
    _require(
        env.timeout_s < parallel_limit / 2,
        "environment.timeout_s",
        f"{env.timeout_s:g} must be below half of parallel.timeout_s={parallel_limit} (the "
        "other ranks wait for this rank's rollout at most parallel.timeout_s)",
    )
    _require(
        env.max_concurrent >= 0,
        "environment.max_concurrent",
        "must be >= 0 (0: one worker per trajectory)",
    )
    _require(env.max_observation_chars >= 1, "environment.max_observation_chars", "must be >= 1")
    mt, r = config.rollout.multi_turn, config.rollout
    _require(mt.max_turns >= 1, "rollout.multi_turn.max_turns", f"must be >= 1, got {mt.max_turns}")
    if mt.max_turn_tokens is not None:
        _require(
            1 <= mt.max_turn_tokens <= r.max_response_length,
            "rollout.multi_turn.max_turn_tokens",
            f"{mt.max_turn_tokens} must be in [1, rollout.max_response_length="
            f"{r.max_response_length}]",
        )
    _require(
        config.reward.type == "rule",
        "reward.type",
        "'model' with environment.function: a reward model does not score multi-turn "
        "trajectories yet; use reward.type=rule (reward.function, or null for the "
        "environment's reward alone)",
    )


def _check_placement(config: Config, world_size: int) -> int:
    """placement.rollout_ranks against trainer.mode; returns the training ranks' count."""
    ranks, split = config.placement.rollout_ranks, config.trainer.mode == "split_async"
    _require(
        split or ranks == 0,
        "placement.rollout_ranks",
        f"{ranks} generation ranks need trainer.mode=split_async (got {config.trainer.mode})",
    )
    if not split:
        return world_size
    _require(
        world_size >= 2,
        "trainer.mode",
        f"split_async needs a launch of 2 ranks or more (one generates), got {world_size}",
    )
    _require(
        0 < ranks < world_size,
        "placement.rollout_ranks",
        f"trainer.mode=split_async needs 1 to {world_size - 1} generation ranks of the "
        f"{world_size} launched, got {ranks}",
    )
    _require(
        ranks % config.rollout.tp == 0,
        "placement.rollout_ranks",
        f"{ranks} is not a multiple of rollout.tp={config.rollout.tp}",
    )
    p, train = config.parallel, world_size - ranks
    _require(
        train % (p.tp * p.pp * p.cp) == 0,
        "placement.rollout_ranks",
        f"{ranks} leaves {train} training ranks of the {world_size} launched, not a multiple "
        f"of parallel.tp·pp·cp = {p.tp}·{p.pp}·{p.cp}",
    )
    replicas, served = ranks // config.rollout.tp, train // (p.tp * p.pp * p.cp)
    _require(
        replicas <= served,
        "placement.rollout_ranks",
        f"{ranks} ranks make {replicas} generation replicas at rollout.tp="
        f"{config.rollout.tp}, more than the {served} training replicas they generate for "
        "(each generates whole batches of its training replicas): fewer ranks, or a larger "
        "rollout.tp",
    )
    r = config.rollout
    for ok, key, why in (
        (config.trainer.val_interval == 0, "trainer.val_interval", "evaluation"),
        (r.sync_probe_prompts == 0, "rollout.sync_probe_prompts", "the sync probe"),
        (r.verify_sync == "off", "rollout.verify_sync", "verified syncs"),
        (r.quantization is None, "rollout.quantization", "an fp8 engine"),
        (config.actor.lora.rank == 0, "actor.lora.rank", "a LoRA actor"),
        (config.model.num_experts == 0, "model.num_experts", "an MoE model"),
        (p.cp == 1, "parallel.cp", "context parallelism"),
    ):
        _require(ok, key, f"trainer.mode=split_async does not combine with {why} yet")
    return train


def _check_async(config: Config) -> None:
    """trainer.mode and what the asynchronous loop does not combine with yet."""
    r, mode = config.rollout, config.trainer.mode
    _require(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
    _require(
        r.partial.in_flight_batches >= 1,
        "rollout.partial.in_flight_batches",
        f"must be >= 1, got {r.partial.in_flight_batches}",
    )
    chunk = r.partial.chunk_tokens
    _require(
        chunk is None or 1 <= chunk <= r.max_response_length,
        "rollout.partial.chunk_tokens",
        f"{chunk} must be in [1, rollout.max_response_length={r.max_response_length}]",
    )
    if mode == "sync":
        return
    for ok, key, why in (
        (
            not config.algorithm.dynamic_sampling.enable,
            "algorithm.dynamic_sampling.enable",
            "its extra rounds",
        ),
        (config.environment.function is None, "environment.function", "multi-turn rollouts"),
        (
            config.parallel.ep == 1,
            "parallel.ep",
            "expert parallelism (its replicas generate in lockstep; partial phases differ)",
        ),
    ):
        _require(ok, key, f"trainer.mode={mode} does not combine with {why} yet")
