"""The multi-turn recipes load, validate and build their environment (issue 38).

The ReTool recipe names a checkpoint that is not on this machine: its architecture comes
from Qwen2.5-7B's config.json as overrides, as test_config.py does for the other recipes.
"""

from __future__ import annotations

from pathlib import Path

from rl_megatron.config import load_config
from rl_megatron.config_checks import validate
from rl_megatron.environments.loader import load_environment
from rl_megatron.environments.tool_env import ToolEnvironment
from rl_megatron.rollout.engines import check_engine_config

CONFIGS = Path(__file__).resolve().parents[2] / "yaml_configs"

QWEN25_7B = [
    "model.hf_path=null",
    "model.num_layers=28",
    "model.hidden_size=3584",
    "model.num_attention_heads=28",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=18944",
    "model.vocab_size=152064",
]


def test_retool_recipe_validates_on_one_gpu():
    config = load_config(CONFIGS / "qwen2.5_7b_retool_h200.yaml", QWEN25_7B)
    layout = validate(config, world_size=1)
    check_engine_config(config)
    assert (layout.tp, layout.dp) == (1, 1) and config.rollout.engine == "vllm"
    assert config.reward.function == "boxed_math" and not config.reference.enable
    assert 4 <= config.rollout.multi_turn.max_turns <= 8
    # A turn's tool calls run within the environment's per-call limit.
    kwargs = config.environment.kwargs
    assert kwargs["max_calls_per_turn"] * kwargs["python_wall_s"] < config.environment.timeout_s
    env = load_environment(config.environment.function)(**kwargs)
    assert isinstance(env, ToolEnvironment) and env.limits.wall_s == 10.0
    messages = env.start({"prompt": "What is 2+2?", "answer": "4"})
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "\\boxed{}" in messages[0]["content"]


def test_tiny_agent_recipe_validates_on_four_ranks():
    config = load_config(CONFIGS / "tiny_agent_cpu.yaml")
    layout = validate(config, world_size=4)
    check_engine_config(config)
    assert (layout.tp, layout.dp) == (2, 2) and config.rollout.engine == "megatron"
    assert config.environment.function == "key_lookup" and config.trainer.dump_rollouts
    assert config.data.synthetic_task == "key_lookup"
