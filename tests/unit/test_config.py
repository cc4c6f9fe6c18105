"""Config loading and validation: every bad input is one line naming the key or file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rl_megatron.config import ConfigError, load_config, save_resolved
from rl_megatron.config_checks import validate
from rl_megatron.rollout.engines import check_engine_config

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return path


# tiny_cpu.yaml runs at TP=2; the checks below start from one rank unless they say so.
ONE_RANK = ["parallel.tp=1", "rollout.tp=1"]


def _error(path, overrides=(), world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        config = load_config(path, ONE_RANK + list(overrides))
        validate(config, world_size)
        check_engine_config(config)  # the chosen engine's own checks (launch/ppo.py)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_tiny_config_loads_and_validates():
    config = load_config(TINY, [])
    validate(config, world_size=4)
    assert config.model.num_layers == 4
    assert config.critic.enable is False  # grpo needs no critic
    assert config.reference.enable is False  # no KL term configured


def test_overrides_are_typed_and_nested():
    config = load_config(TINY, ["actor.optim.lr=3e-6", "parallel.tp=2", "rollout.n=8"])
    assert config.actor.optim.lr == pytest.approx(3e-6)
    assert config.parallel.tp == 2 and config.rollout.n == 8


def test_misspelled_key_suggests_the_right_one():
    message = _error(TINY, ["actor.optim.lrr=1e-6"])
    assert message == "actor.optim.lrr: unknown key; did you mean actor.optim.lr?"


def test_misspelled_section(tmp_path):
    message = _error(_write(tmp_path, "actr:\n  micro_batch_size: 2\n"))
    assert message.startswith("actr: unknown key; did you mean actor?")


def test_string_where_a_number_belongs():
    message = _error(TINY, ["actor.optim.lr=fast"])
    assert message == "actor.optim.lr: expected a number, got str 'fast'"
    assert _error(TINY, ["actor.micro_batch_size=1.5"]).startswith(
        "actor.micro_batch_size: expected an integer"
    )


def test_tp_must_divide_heads():
    message = _error(TINY, ["parallel.tp=3"], world_size=3)
    assert message == "parallel.tp: 3 does not divide model.num_attention_heads=4"


def test_world_size_must_divide():
    message = _error(TINY, ["parallel.tp=2", "parallel.pp=2"], world_size=6)
    assert "world size 6 is not divisible by tp·pp·cp" in message


def test_layers_divisible_by_pp_and_vpp():
    assert _error(TINY, ["parallel.pp=3"], world_size=3).startswith("parallel.pp: 3 does not")
    message = _error(TINY, ["parallel.pp=2", "parallel.vpp=4"], world_size=2)
    assert message.startswith("parallel.vpp: pp·vpp = 8 does not divide model.num_layers=4")


def test_mini_batch_divisible_by_micro_batch_times_dp():
    message = _error(TINY, ["actor.mini_batch_size=8", "actor.micro_batch_size=3"], world_size=2)
    assert message == "actor.mini_batch_size: 8 is not divisible by micro_batch_size·dp = 3·2"


def test_rollout_tp_must_divide_tp_times_pp():
    message = _error(TINY, ["parallel.tp=2", "rollout.tp=4"], world_size=2)
    assert message.startswith("rollout.tp: 4 does not divide parallel.tp·parallel.pp = 2")


def test_literal_choices_are_named():
    message = _error(TINY, ["algorithm.adv_estimator=grp"])
    assert message.startswith("algorithm.adv_estimator: 'grp' is not one of gae, grpo")
    assert message.endswith("did you mean grpo?")


def test_out_of_range_value():
    assert _error(TINY, ["rollout.top_p=1.5"]) == "rollout.top_p: must be in (0, 1], got 1.5"


def test_verify_sync_keys():
    assert _error(TINY, ["rollout.verify_sync_interval=0"]) == (
        "rollout.verify_sync_interval: must be >= 1"
    )
    assert _error(TINY, ["rollout.verify_sync=some"]).startswith(
        "rollout.verify_sync: 'some' is not one of off, sample, full"
    )
    assert load_config(TINY).rollout.verify_sync == "off"


def test_grpo_needs_several_samples():
    assert _error(TINY, ["rollout.n=1"]).startswith("rollout.n: algorithm.adv_estimator=grpo")


def test_missing_file(tmp_path):
    assert _error(tmp_path / "nope.yaml") == f"config file not found: {tmp_path / 'nope.yaml'}"


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "model:\n  num_layers: [1, 2\nparallel:\n  tp: 1\n")
    message = _error(path)
    assert message.startswith(f"{path}:") and "malformed YAML" in message


def test_top_level_must_be_a_mapping(tmp_path):
    assert "top level must be a mapping" in _error(_write(tmp_path, "- 1\n- 2\n"))


def test_bad_override_syntax():
    assert _error(TINY, ["actor.optim.lr"]).startswith("override 'actor.optim.lr': expected")


def test_hf_path_fills_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,'
        ' "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 50}'
    )
    path = _write(tmp_path, f"model:\n  hf_path: {tmp_path}\n")
    config = load_config(path, [])
    assert (config.model.num_layers, config.model.num_query_groups) == (2, 2)
    message = _error(path, ["model.num_layers=4"])
    assert message.startswith("model.num_layers: 4 given, but")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(TINY, ["actor.optim.lr=2e-5"])
    path = save_resolved(config, tmp_path)
    again = load_config(path, [])
    assert again == config


# Every shipped config validates at the world size its header comment names, with a
# stand-in config.json of the model family it expects (its hf_path is a cluster path).
SHIPPED = {
    "llama7b.yaml": (8, dict(num_attention_heads=32, num_key_value_heads=32, vocab=32000)),
    "qwen2.5_7b_grpo.yaml": (8, dict(num_attention_heads=28, num_key_value_heads=4, vocab=152064)),
    "llama3_8b_grpo.yaml": (8, dict(num_attention_heads=32, num_key_value_heads=8, vocab=128256)),
    "qwen3_8b_grpo.yaml": (
        8,
        dict(num_attention_heads=32, num_key_value_heads=8, vocab=151936, model_type="qwen3"),
    ),
    "qwen2.5_1.5b_1gpu.yaml": (
        1,
        dict(num_attention_heads=12, num_key_value_heads=2, vocab=151936),
    ),
    "qwen2.5_7b_grpo_lora_1gpu.yaml": (
        1,
        dict(num_attention_heads=28, num_key_value_heads=4, vocab=152064),
    ),
    "qwen2.5_1.5b_16k_1gpu.yaml": (
        1,
        dict(num_attention_heads=12, num_key_value_heads=2, vocab=151936),
    ),
    "qwen3_30b_a3b_grpo.yaml": (
        16,
        dict(
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab=151936,
            model_type="qwen3_moe",
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_validate(tmp_path, name):
    import json

    world, arch = SHIPPED[name]
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": arch.get("model_type", "llama"),
                "hidden_size": 128 * arch["num_attention_heads"],
                "num_hidden_layers": 32,
                "num_attention_heads": arch["num_attention_heads"],
                "num_key_value_heads": arch["num_key_value_heads"],
                "intermediate_size": 11008,
                "vocab_size": arch["vocab"],
                **{k: v for k, v in arch.items() if k.startswith(("num_experts", "moe_"))},
            }
        )
    )
    config = load_config(TINY.parent / name, [f"model.hf_path={tmp_path}"])
    validate(config, world_size=world)
    assert config.rollout.engine == "vllm"
    validate(load_config(TINY, []), world_size=4)  # the demo: TP=2 x DP=2


def test_lora_recipe_trains_adapters_against_the_base(tmp_path):
    """The GSM8K GRPO-LoRA recipe (issue 41): adapters on every projection, the base as the
    reference (no second model), the adapters exported in the PEFT layout; its header's
    adapter count is the config's rank over Qwen2.5-7B's projections (A: r x in, B: out x r)."""
    config = load_config(TINY.parent / "qwen2.5_7b_grpo_lora_1gpu.yaml", [
        "model.hf_path=null", "model.num_layers=28", "model.hidden_size=3584",
        "model.num_attention_heads=28", "model.num_query_groups=4",
        "model.ffn_hidden_size=18944", "model.vocab_size=152064",
    ])  # fmt: skip
    layout = validate(config, world_size=1)
    lora = config.actor.lora
    assert (layout.tp, layout.dp) == (1, 1) and lora.rank == 32
    assert set(lora.target_modules) == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert config.actor.use_kl_loss and config.checkpoint.save_hf_adapter
    header = (TINY.parent / "qwen2.5_7b_grpo_lora_1gpu.yaml").read_text()
    h, ffn, kv = 3584, 18944, 4 * 128
    per_layer = lora.rank * ((h + h + 2 * kv) + (h + h) + (h + 2 * ffn) + (ffn + h))
    assert f"= {per_layer / 1e6:.2f}M, x 28 = {28 * per_layer / 1e6:.1f}M" in header


def test_megatron_engine_needs_the_training_layout():
    message = _error(TINY, ["parallel.tp=2", "rollout.tp=1"], world_size=2)
    assert (
        message
        == "rollout.tp: the megatron engine generates at the training tp=2; got rollout.tp=1"
    )
    message = _error(TINY, ["parallel.pp=2"], world_size=2)
    assert message == "rollout.engine: megatron generates with pp=1 only; use vllm"


def test_training_data_is_required():
    message = _error(TINY, ["data.synthetic_task=null"])
    assert message.startswith("data.train_files: no training data")


def test_greedy_rollouts_need_one_sample():
    message = _error(TINY, ["rollout.temperature=0"])
    assert message.startswith("rollout.n: greedy sampling (rollout.temperature=0) gives 4")


# The GPU benchmark configs (random init, no hf_path) and the GPUs each is written for.
BENCH = {"bench_h200_1b.yaml": 1, "bench_h200x2_7b.yaml": 2, "bench_h200x2_7b_pp2.yaml": 2}


@pytest.mark.parametrize("name", sorted(BENCH))
def test_bench_configs_validate(name):
    config = load_config(TINY.parent / name, [])
    validate(config, world_size=BENCH[name])
    assert config.parallel.tp * config.parallel.pp == BENCH[name]


def test_engine_kwargs_pass_through_but_cannot_override_the_trainer():
    vllm = ["rollout.engine=vllm"]
    config = load_config(TINY, [*vllm, "rollout.engine_kwargs={disable_custom_all_reduce: true}"])
    assert config.rollout.engine_kwargs == {"disable_custom_all_reduce": True}
    validate(config, world_size=4)
    check_engine_config(config)
    message = _error(TINY, [*vllm, "rollout.engine_kwargs={seed: 3}"])
    assert message.startswith("rollout.engine_kwargs.seed: is set by the trainer")
    # The Megatron engine takes no vLLM arguments: refused, not ignored.
    message = _error(TINY, ["rollout.engine_kwargs={disable_custom_all_reduce: true}"])
    assert message == (
        "rollout.engine_kwargs: are vLLM's arguments; the megatron engine takes none (got "
        "['disable_custom_all_reduce'])"
    )
    message = _error(TINY, ["rollout.engine_kwargs=[1]"], world_size=4)
    assert message == "rollout.engine_kwargs: expected a mapping with string keys, got list [1]"


def test_calculate_log_probs_defaults_off_and_takes_only_booleans():
    assert load_config(TINY, []).rollout.calculate_log_probs is False  # verl's default
    # ...unless the rollout correction needs them: then on by default.
    rc = ["algorithm.rollout_correction.level=token"]
    assert load_config(TINY, rc).rollout.calculate_log_probs is True
    rc_off = [*rc, "rollout.engine=vllm", "rollout.calculate_log_probs=false"]
    message = _error(TINY, rc_off)
    assert message.startswith("rollout.calculate_log_probs: is false, but algorithm.rollout_")
    config = load_config(TINY, ["rollout.calculate_log_probs=true"])
    assert config.rollout.calculate_log_probs is True
    validate(config, world_size=4)
    message = _error(TINY, ["rollout.calculate_log_probs=maybe"])
    assert message == "rollout.calculate_log_probs: expected true or false, got str 'maybe'"
    message = _error(TINY, ["rollout.calculate_log_probs=1"])
    assert message == "rollout.calculate_log_probs: expected true or false, got int 1"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.dtype=bf16", "actor.optim.cpu_offload_fraction=1.5"],
            "actor.optim.cpu_offload_fraction: must be in [0, 1] (0 = off), got 1.5",
        ),
        (
            ["model.dtype=bf16", "actor.optim.cpu_offload_fraction=-0.1"],
            "actor.optim.cpu_offload_fraction: must be in [0, 1] (0 = off), got -0.1",
        ),
        (
            ["actor.optim.cpu_offload_fraction=1.0"],  # tiny_cpu.yaml trains in fp32
            "actor.optim.cpu_offload_fraction: needs model.dtype=bf16 (megatron-core's "
            "optimizer CPU offload keeps fp32 copies of bf16 weights), got fp32; set it 0 "
            "or use bf16",
        ),
        (
            ["algorithm.adv_estimator=gae", "model.dtype=fp16",
             "critic.optim.cpu_offload_fraction=0.5"],
            "critic.optim.cpu_offload_fraction: needs model.dtype=bf16 (megatron-core's "
            "optimizer CPU offload keeps fp32 copies of bf16 weights), got fp16; set it 0 "
            "or use bf16",
        ),
        (
            ["model.dtype=bf16", "actor.optim.cpu_offload_fraction=half"],
            "actor.optim.cpu_offload_fraction: expected a number, got str 'half'",
        ),
    ],
)  # fmt: skip
def test_optimizer_cpu_offload_settings_are_checked(overrides, expected):
    assert _error(TINY, overrides) == expected


def test_optimizer_cpu_offload_combines_with_offload_between_phases():
    overrides = [
        "model.dtype=bf16",
        "algorithm.adv_estimator=gae",
        "actor.optim.cpu_offload_fraction=1.0",
        "actor.offload.optimizer=true",  # moves what stays on the device: nothing here
        "critic.optim.cpu_offload_fraction=0.5",
        "critic.optim.cpu_offload_overlap=false",
        "critic.offload.optimizer=true",  # moves the device half
    ]
    config = load_config(TINY, overrides)
    validate(config, world_size=4)
    assert config.actor.optim.cpu_offload_fraction == 1.0
    assert load_config(TINY, []).actor.optim.cpu_offload_fraction == 0.0  # off by default


def test_manual_gc_interval_cannot_be_negative():
    assert load_config(TINY, ["trainer.manual_gc=true"]).trainer.manual_gc is True
    message = _error(TINY, ["trainer.manual_gc_interval=-1"])
    assert message == "trainer.manual_gc_interval: must be >= 0"


@pytest.mark.parametrize("value", ["-0.1", "1.0", "28", "inf"])
def test_clip_ratio_high_is_bounded_like_clip_ratio_low(value):
    message = _error(TINY, [f"actor.clip_ratio_high={value}"])
    assert message == f"actor.clip_ratio_high: must be in [0, 1), got {float(value)}"


def test_context_parallelism_validates_with_the_megatron_engine():
    config = load_config(TINY, ONE_RANK + ["parallel.cp=2"])
    layout = validate(config, world_size=2)
    assert (layout.cp, layout.dp, layout.grad_dp, layout.sequence_divisor) == (2, 1, 2, 4)


def test_context_parallelism_refuses_what_it_does_not_support(monkeypatch):
    message = _error(TINY, ["parallel.cp=2", "rollout.engine=vllm"], world_size=2)
    assert message.startswith("rollout.engine: vllm: resharding a context-parallel actor")
    message = _error(TINY, ["parallel.cp=3"], world_size=2)
    assert message.startswith("parallel: world size 2 is not divisible by tp·pp·cp")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "transformer_engine" else real(name, *a),
    )
    message = _error(TINY, ["parallel.cp=2"], world_size=2)
    assert message.startswith("parallel.cp: 2: context parallelism runs on rl_megatron's SDPA")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("../x", "'../x' leaves trainer.output_dir"),
        ("a/../../b", "'a/../../b' leaves trainer.output_dir"),
        ("/tmp/elsewhere", "'/tmp/elsewhere' leaves trainer.output_dir"),
        ("''", "must not be empty"),  # YAML's empty string
        ("' '", "must not be empty"),
        (".", "'.' names trainer.output_dir itself"),
    ],
)
def test_experiment_name_cannot_leave_output_dir(name, expected):
    message = _error(TINY, [f"trainer.experiment_name={name}"])
    assert message.startswith(f"trainer.experiment_name: {expected}"), message


def test_experiment_name_may_be_a_sub_folder():
    config = load_config(TINY, [*ONE_RANK, "trainer.experiment_name=team/exp1"])
    validate(config, world_size=1)
    assert config.run_dir == Path("runs/team/exp1")


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{RC}.rejection=[0.5, 2.0]"], f"{RC}.rejection: needs {RC}.level"),
        ([f"{RC}.level=token", f"{RC}.threshold=0.5"], f"{RC}.threshold: must be >= 1"),
        ([f"{RC}.level=token", f"{RC}.threshold=[2.0, 3.0]"], f"{RC}.threshold: needs 0 <="),
        ([f"{RC}.level=token", f"{RC}.threshold=[0.5]"], f"{RC}.threshold: expected [lower, "),
        ([f"{RC}.level=sequence", f"{RC}.rejection=[0.5, 0.9]"], f"{RC}.rejection: needs 0 <="),
        (
            [f"{RC}.level=token", f"{RC}.threshold=null"],
            f"{RC}.level: is set but both {RC}.threshold and {RC}.rejection are null",
        ),
        ([f"{RC}.level=tokens"], f"{RC}.level: 'tokens' is not one of token, sequence"),
        (["actor.policy_loss=gpso"], "actor.policy_loss: 'gpso' is not one of vanilla"),
        (["critic.loss_agg_mode=sum"], "critic.loss_agg_mode: 'sum' is not one of token-mean"),
        (["algorithm.dynamic_sampling.enable=true", "rollout.n=1"], "rollout.n: algorithm"),
        (
            [
                "algorithm.adv_estimator=gae",
                "algorithm.dynamic_sampling.enable=true",
                "rollout.n=1",
            ],
            "algorithm.dynamic_sampling.enable: needs groups of rollout.n >= 2",
        ),
        (
            ["algorithm.dynamic_sampling.max_extra_rounds=-1"],
            "algorithm.dynamic_sampling.max_extra_rounds: must be >= 0",
        ),
        (
            ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.length=9"],
            "reward.overlong_buffer.length: must be in (0, rollout.max_response_length=8]",
        ),
        (
            [
                "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.length=4",
                "reward.overlong_buffer.penalty_factor=-1",
            ],
            "reward.overlong_buffer.penalty_factor: must be >= 0",
        ),
    ],
)
def test_correction_loss_and_dapo_settings_are_checked(overrides, expected):
    message = _error(TINY, overrides)
    assert message.startswith(expected), message


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full"],
        ["actor.use_kl_loss=true", "actor.kl_loss_type=full"],
    ],
)
def test_full_kl_needs_one_pipeline_stage(overrides):
    config = load_config(TINY, [*ONE_RANK, *overrides])
    validate(config, world_size=1)
    key = overrides[1].split("=")[0]
    message = _error(TINY, [*overrides, "parallel.pp=2"], world_size=2)
    assert message.startswith(f"{key}: full needs parallel.pp=1"), message


def test_correction_loss_and_dapo_settings_load():
    config = load_config(
        TINY,
        [
            *ONE_RANK,
            f"{RC}.level=sequence",
            f"{RC}.threshold=[0.5, 2.0]",
            f"{RC}.rejection=[0.25, 4]",
            f"{RC}.batch_normalize=true",
            "actor.policy_loss=cispo",
            "critic.loss_agg_mode=seq-mean-token-sum",
            "algorithm.dynamic_sampling.enable=true",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.length=4",
        ],
    )
    validate(config, world_size=1)
    rc = config.algorithm.rollout_correction
    assert rc.threshold == [0.5, 2.0] and rc.rejection == [0.25, 4.0] and rc.batch_normalize
    assert config.rollout.calculate_log_probs is True
    assert load_config(TINY, [f"{RC}.threshold=1.5"]).algorithm.rollout_correction.threshold == 1.5


# Qwen2.5-7B's config.json, for recipes whose checkpoint is not on this machine.
QWEN25_7B = [
    "model.hf_path=null",
    "model.num_layers=28",
    "model.hidden_size=3584",
    "model.num_attention_heads=28",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=18944",
    "model.vocab_size=152064",
]


def test_dapo_recipe_validates():
    config = load_config(TINY.parent / "dapo_qwen2.5_7b.yaml", QWEN25_7B)
    validate(config, world_size=8)
    assert config.rollout.calculate_log_probs is True  # for the correction's weights
    assert config.algorithm.dynamic_sampling.enable and config.reward.overlong_buffer.enable
    assert config.actor.loss_agg_mode == "token-mean" and config.actor.clip_ratio_high == 0.28


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["actor.recompute.granularity=selective", "actor.recompute.modules=[attn]"],
            "actor.recompute.modules: unknown ['attn']; choose from ['core_attn', 'mlp', "
            "'layernorm', 'moe', 'shared_experts']",
        ),
        (
            ["actor.recompute.granularity=selective", "actor.recompute.modules=[]"],
            "actor.recompute.modules: selective recompute needs modules",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.recompute.granularity=full",
             "critic.recompute.num_layers=0"],
            "critic.recompute.num_layers: must be >= 1, got 0",
        ),
        (
            ["actor.recompute.granularity=partial"],
            None,  # a Literal: the loader names the key and the choices
        ),
        (["model.recompute_activations=true"], "model.recompute_activations: unknown key"),
    ],
)  # fmt: skip
def test_recompute_settings_are_checked(overrides, expected):
    message = _error(TINY, overrides)
    if expected is None:
        assert message.startswith("actor.recompute.granularity:"), message
    else:
        assert message.startswith(expected), message


def test_layernorm_recompute_needs_transformer_engine():
    import importlib.util

    overrides = ["actor.recompute.granularity=selective", "actor.recompute.modules=[layernorm]"]
    if importlib.util.find_spec("transformer_engine") is None:
        assert _error(TINY, overrides) == (
            "actor.recompute.modules: layernorm recompute needs Transformer Engine, "
            "which is not installed"
        )
    else:
        validate(load_config(TINY, overrides), world_size=4)


TINY_MOE = TINY.parent / "tiny_moe_cpu.yaml"


def test_tiny_moe_config_loads_and_validates():
    config = load_config(TINY_MOE, [])
    layout = validate(config, world_size=2)
    assert config.model.num_experts == 4 and (layout.ep, layout.expert_tp) == (1, 1)
    # EP over the DP ranks, the Megatron engine generating with the actor's experts.
    config = load_config(TINY_MOE, ["parallel.ep=2"])
    assert validate(config, world_size=2).ep == 2


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.ep=3"], 3, "parallel.ep: 3 does not divide model.num_experts=4"),
        (["parallel.etp=3"], 3, "parallel.etp: 3 does not divide model.moe_ffn_hidden_size=64"),
        (["parallel.ep=2", "parallel.pp=2"], 4, "parallel.ep: with parallel.pp=2 > 1"),
        (["parallel.tp=2", "rollout.tp=2"], 2, "parallel.sequence_parallel: megatron-core trains an MoE"),
        (["model.moe_router_topk=5"], 1, "model.moe_router_topk: must be in [1, model.num_experts=4]"),
        (["model.moe_aux_loss_coeff=-1"], 1, "model.moe_aux_loss_coeff: must be >= 0"),
        (["rollout.engine=vllm", "parallel.tp=2", "parallel.sequence_parallel=true", "rollout.tp=2",
          "model.moe_ffn_hidden_size=33"], 2, "rollout.tp: 2 does not divide model.moe_ffn_hidden_size"),
    ],
)  # fmt: skip
def test_moe_config_errors_name_the_key(overrides, world, message):
    assert _error(TINY_MOE, overrides, world).startswith(message)


def test_vllm_takes_an_moe_actor_at_any_ep_but_not_its_expert_parallel_mode():
    config = load_config(TINY_MOE, ["rollout.engine=vllm", "parallel.ep=2"])
    assert validate(config, world_size=2).ep == 2  # resharding gathers the experts
    check_engine_config(config)
    config.rollout.engine_kwargs = {"enable_expert_parallel": True}
    validate(config, world_size=2)  # the engine's own business:
    with pytest.raises(ConfigError, match="^rollout.engine_kwargs.enable_expert_parallel: "):
        check_engine_config(config)


def test_expert_degrees_need_an_moe_model():
    assert _error(TINY, ["parallel.ep=2"], 2).startswith("parallel.ep: splits the experts")
    assert _error(TINY, ["model.moe_z_loss_coeff=0.1"]).startswith(
        "model.moe_z_loss_coeff: needs an MoE model"
    )


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        (TINY, ["actor.router_replay=true"], "actor.router_replay: needs an MoE model"),
        (TINY_MOE, ["actor.router_replay=true", "rollout.engine=vllm",
                    "actor.recompute.granularity=full"], "actor.recompute: routing replay needs"),
    ],
)  # fmt: skip
def test_router_replay_config_errors_name_the_key(config, overrides, message):
    assert _error(config, overrides).startswith(message)


@pytest.mark.parametrize("engine", ["vllm", "megatron"])
def test_router_replay_validates_with_either_engine(engine):
    # Both engines record the routing (vLLM's routed experts, the Megatron engine's hooks).
    config = load_config(TINY_MOE, ["actor.router_replay=true", f"rollout.engine={engine}"])
    validate(config, world_size=1)


def test_fp8_rollout_is_refused_without_an_fp8_gpu(monkeypatch):
    import rl_megatron.config_checks as checks

    monkeypatch.setattr(checks, "_has_fp8_gpu", lambda: False)
    for key in ("rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8"):
        message = _error(TINY, [key, "rollout.engine=vllm"])
        assert message.startswith(key.split("=")[0] + ":") and "8.9" in message
    message = _error(TINY, ["rollout.quantization=fp8", "rollout.engine=megatron"])
    assert message.startswith("rollout.quantization:") and "rollout.engine=vllm" in message


def test_fp8_rollout_turns_token_level_tis_on_unless_set(monkeypatch):
    import rl_megatron.config_checks as checks

    monkeypatch.setattr(checks, "_has_fp8_gpu", lambda: True)
    config = load_config(TINY, [*ONE_RANK, "rollout.engine=vllm", "rollout.quantization=fp8"])
    validate(config, world_size=1)
    rc = config.algorithm.rollout_correction
    assert (rc.level, rc.threshold) == ("token", 2.0)
    assert config.rollout.calculate_log_probs is True  # the correction's weights need them
    set_by_user = load_config(TINY, [*ONE_RANK, "rollout.quantization=fp8", f"{RC}.level=sequence"])
    assert set_by_user.algorithm.rollout_correction.level == "sequence"
    assert load_config(TINY, ONE_RANK).algorithm.rollout_correction.level is None


def test_fp8_rollout_refuses_an_moe_actor(monkeypatch):
    import rl_megatron.config_checks as checks

    monkeypatch.setattr(checks, "_has_fp8_gpu", lambda: True)
    config = load_config(TINY_MOE, ["rollout.engine=vllm", "rollout.quantization=fp8"])
    validate(config, world_size=2)
    with pytest.raises(ConfigError, match=r"^rollout\.quantization: fp8 with an MoE actor"):
        check_engine_config(config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.sync_probe_prompts=-1"], "rollout.sync_probe_prompts: must be >= 0"),
        (["rollout.sync_probe_prompts=2", "rollout.sync_probe_tokens=9"],
         "rollout.sync_probe_tokens: must be in [1, rollout.max_response_length=8], got 9"),
        (["rollout.sync_probe_prompts=2", "rollout.calculate_log_probs=false"],
         "rollout.sync_probe_prompts: the probe compares the engine's log-probs"),
    ],
)  # fmt: skip
def test_sync_probe_config_errors_name_the_key(overrides, message):
    assert _error(TINY, overrides).startswith(message)


def test_sync_probe_asks_the_engine_for_log_probs():
    config = load_config(TINY, ONE_RANK + ["rollout.sync_probe_prompts=2"])
    validate(config, world_size=1)
    assert config.rollout.calculate_log_probs is True
    assert load_config(TINY, ONE_RANK).rollout.calculate_log_probs is False  # off: not needed


LORA = ["actor.lora.rank=8"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.lora.rank=-1"], "actor.lora.rank: must be >= 0"),
        (LORA + ["actor.lora.alpha=0"], "actor.lora.alpha: must be > 0"),
        (LORA + ["actor.lora.dropout=1.0"], "actor.lora.dropout: must be in [0, 1)"),
        (LORA + ["actor.lora.target_modules=[q_proj]"], "actor.lora.target_modules: unknown"),
        (LORA + ["actor.lora.target_modules=[]"], "actor.lora.target_modules: must name"),
        (LORA + ["actor.use_kl_loss=true", "actor.kl_loss_type=full"],
         "actor.kl_loss_type: full needs the reference's logits"),
        (LORA + ["actor.lora.target_modules=[output_layer]"],
         "actor.lora.target_modules: output_layer needs a layer module beside it"),
        (LORA + ["actor.lora.target_modules=[linear_qkv,output_layer]",
                 "model.tie_word_embeddings=true"],
         "actor.lora.target_modules: output_layer is tied to the input embedding"),
        (["checkpoint.save_hf_adapter=true"], "checkpoint.save_hf_adapter: writes LoRA adapters"),
    ],
)  # fmt: skip
def test_lora_config_errors_name_the_key(overrides, message):
    assert _error(TINY, overrides).startswith(message)


ADAPTER = LORA + [
    "rollout.engine=vllm",
    "rollout.lora_sync=adapter",
    "rollout.sleep_level=1",
    "model.hf_path=/models/llama",
    "actor.lora.target_modules=[linear_qkv,linear_fc2]",
]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.lora_sync=adapter"], "rollout.lora_sync: adapter needs a LoRA actor"),
        (ADAPTER + ["rollout.engine=megatron"], "rollout.lora_sync: adapter needs rollout.engine=vllm"),
        (ADAPTER + ["actor.lora.target_modules=[linear_qkv,output_layer]"],
         "rollout.lora_sync: adapter does not send an LM-head adapter"),
        (ADAPTER + ["model.num_experts=4"], "rollout.lora_sync: adapter is built for dense models"),
        (ADAPTER + ["model.hf_path=null"], "rollout.lora_sync: adapter needs model.hf_path"),
        (ADAPTER + ["rollout.sleep_level=2"], "rollout.lora_sync: adapter with rollout.sleep_level=2"),
        (ADAPTER + ["rollout.verify_sync=sample"], "rollout.verify_sync: reads back the weights"),
    ],
)  # fmt: skip
def test_lora_adapter_sync_config_errors_name_the_key(overrides, message, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(  # tiny_cpu.yaml's shape
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path)
    overrides = [o.replace("/models/llama", str(tmp_path)) for o in overrides]
    config = load_config(TINY, ONE_RANK + overrides)
    with pytest.raises(ConfigError) as info:
        validate(config, world_size=1)
    assert str(info.value).startswith(message), str(info.value)


def test_lora_refuses_sequence_parallelism():
    overrides = LORA + ["parallel.tp=2", "rollout.tp=2", "parallel.sequence_parallel=true"]
    message = _error(TINY, overrides, world_size=2)
    assert message.startswith("parallel.sequence_parallel: a LoRA actor takes"), message


def test_lora_config_validates():
    config = load_config(TINY, ONE_RANK + LORA + ["actor.use_kl_loss=true"])
    validate(config, world_size=1)
    assert config.actor.lora.rank == 8 and config.reference.enable
    assert load_config(TINY, ONE_RANK).actor.lora.rank == 0  # off by default


@pytest.mark.parametrize("quantization", ["null", "fp8"])
def test_lora_config_validates_with_vllm(monkeypatch, quantization):
    """The vLLM weight sync sends the merged weights (resharding/lora_merge.py); an FP8
    engine quantizes what lands, merged or not."""
    import rl_megatron.config_checks as checks

    monkeypatch.setattr(checks, "_has_fp8_gpu", lambda: True)
    overrides = [*ONE_RANK, *LORA, "rollout.engine=vllm", f"rollout.quantization={quantization}"]
    config = load_config(TINY, overrides)
    validate(config, world_size=1)
    check_engine_config(config)
    assert config.actor.lora.rank == 8 and config.rollout.engine == "vllm"


@pytest.mark.parametrize("key", ["save_hf", "save_hf_adapter"])
def test_moe_export_from_memory_refuses_ep(key):
    overrides = ["parallel.ep=2", *LORA, f"checkpoint.{key}=true"]
    with pytest.raises(ConfigError, match=rf"^checkpoint\.{key}: an MoE actor at parallel\.ep=2"):
        validate(load_config(TINY_MOE, overrides), world_size=2)
