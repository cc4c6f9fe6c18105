"""What the Megatron engine needs of the config: one-line `ConfigError`s naming the key.

The engine generates with the actor's own modules (no copy, no sync), so it runs at the
training layout. Run by `rollout/engines.py`'s `check_engine_config`.
"""

from __future__ import annotations

from rl_megatron.config import Config, ConfigError


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def check_config(config: Config) -> None:
    r, p = config.rollout, config.parallel
    _require(p.pp == 1, "rollout.engine", "megatron generates with pp=1 only; use vllm")
    _require(
        not p.sequence_parallel,
        "rollout.engine",
        "megatron decodes one token per step, which sequence_parallel cannot split; use vllm",
    )
    _require(
        r.tp == p.tp,
        "rollout.tp",
        f"the megatron engine generates at the training tp={p.tp}; got rollout.tp={r.tp}",
    )
    _require(
        not r.engine_kwargs,
        "rollout.engine_kwargs",
        f"are vLLM's arguments; the megatron engine takes none (got {sorted(r.engine_kwargs)})",
    )
    # With parallel.ep > 1 the engine's ranks decode different prompts, and agree on every
    # forward the expert all-to-all spans (`engine.py`): nothing to refuse.
    _require(
        config.environment.function is None or p.ep == 1,
        "environment.function",
        f"multi-turn rollouts on the megatron engine need parallel.ep=1 (got {p.ep}): its "
        "expert all-to-all keeps every replica's generate calls in lockstep, and each "
        "replica's environments decide how many turns it generates; use rollout.engine=vllm",
    )
