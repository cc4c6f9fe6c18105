"""The rollout engines by name (`rollout.engine`): the one place that names them.

    check_engine_config(config)                              # after config_checks.validate
    engine = build_engine(config, info, actor_chunks, tokenizer, groups)

Each engine is a package of its own (`rollout/vllm/`, `rollout/megatron/`) holding the
engine, its checks of the config (`checks.check_config`), its weight-sync target where it
has one, and `build.build`, which makes the engine from the config and pairs it with the
trainer. A package is imported only when its engine is chosen (vLLM is large, and absent
from a training-only install). Adding an engine: a package with those modules and a row
here (DESIGN.md, "Adding a rollout engine").
"""

from __future__ import annotations

import importlib
from typing import Any

from rl_megatron.config import Config, ConfigError
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.parallel import ParallelGroups
from rl_megatron.rollout.engine import RolloutEngine

# rollout.engine → its package.
ENGINES = {"vllm": "rl_megatron.rollout.vllm", "megatron": "rl_megatron.rollout.megatron"}


def _module(name: str, part: str) -> Any:
    package = ENGINES.get(name)
    if package is None:
        raise ConfigError(f"rollout.engine: unknown engine {name!r}; one of {', '.join(ENGINES)}")
    return importlib.import_module(f"{package}.{part}")


def check_engine_config(config: Config) -> None:
    """The chosen engine's checks of the config (`ConfigError`, one line naming the key)."""
    _module(config.rollout.engine, "checks").check_config(config)


def build_engine(
    config: Config, info: HFModelInfo, actor_chunks: list, tokenizer: Any, groups: ParallelGroups
) -> RolloutEngine:
    """The engine of `rollout.engine` on every rank (collective), ready to `sync_from` the
    actor whose modules are `actor_chunks`."""
    return _module(config.rollout.engine, "build").build(
        config, info, actor_chunks, tokenizer, groups
    )


def build_standalone_engine(
    config: Config, info: HFModelInfo, tokenizer: Any, groups: ParallelGroups
) -> tuple[RolloutEngine, Any]:
    """Split placement's generation side: the engine of `rollout.engine` with weights of
    its own (`groups`: the generation ranks'), and the `ReshardTarget` they arrive through."""
    return _module(config.rollout.engine, "build").build_standalone(config, info, tokenizer, groups)
