"""What the vLLM engine needs of the config: one-line `ConfigError`s naming the key.

Run by `rollout/engines.py`'s `check_engine_config` right after `config_checks.validate`,
identically on every rank and before any collective; the keys stay under `rollout.*`, where
users' YAML files have them.
"""

from __future__ import annotations

from rl_megatron.config import Config, ConfigError

# vllm.LLM arguments the in-process engine sets from the config (`engine.py`, `build.py`);
# rollout.engine_kwargs must not override them.
TRAINER_SET_LLM_ARGS = (
    "model", "tensor_parallel_size", "distributed_executor_backend", "load_format", "dtype",
    "gpu_memory_utilization", "seed", "enforce_eager", "enable_prefix_caching",
    "skip_tokenizer_init", "logprobs_mode", "enable_sleep_mode", "max_model_len",
    "block_size", "enable_return_routed_experts", "quantization", "kv_cache_dtype",
)  # fmt: skip


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def check_config(config: Config) -> None:
    r, p, m = config.rollout, config.parallel, config.model
    _require(
        0 < r.gpu_memory_utilization <= 1,
        "rollout.gpu_memory_utilization",
        f"must be in (0, 1], got {r.gpu_memory_utilization}",
    )
    managed = sorted(set(r.engine_kwargs) & set(TRAINER_SET_LLM_ARGS))
    _require(
        not managed,
        f"rollout.engine_kwargs.{managed[0] if managed else ''}",
        "is set by the trainer (from rollout.*, model.*, trainer.seed); set it there",
    )
    _require(
        p.cp == 1,
        "rollout.engine",
        f"vllm: resharding a context-parallel actor (parallel.cp={p.cp}) into vLLM is not "
        "supported yet; use megatron, or parallel.cp=1",
    )
    if config.algorithm.rollout_correction.level is not None:
        _require(
            bool(r.calculate_log_probs),
            "rollout.calculate_log_probs",
            "is false, but algorithm.rollout_correction needs the engine's log-probs; set it "
            "true or leave it out",
        )
    _require(
        not (r.quantization and m.num_experts),
        "rollout.quantization",
        "fp8 with an MoE actor: the sync fills vLLM's fp8 linear layers, not its fp8 "
        "experts (3-D weights and scales) yet; leave it out",
    )
    if m.num_experts:
        # Resharding fills vLLM's fused experts as vLLM splits them without expert
        # parallelism: every expert on every rank, its FFN split over rollout.tp.
        _require(
            not r.engine_kwargs.get("enable_expert_parallel"),
            "rollout.engine_kwargs.enable_expert_parallel",
            "resharding an MoE actor into vLLM's expert-parallel layout is not supported "
            "yet; leave it off (each expert is then split over rollout.tp)",
        )
        _require(
            m.moe_ffn_hidden_size % r.tp == 0,
            "rollout.tp",
            f"{r.tp} does not divide model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} "
            "(vLLM splits each expert's FFN over its TP ranks)",
        )
