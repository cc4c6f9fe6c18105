"""The run's record of its config (`config.resolved.yaml`, the config printed at start)
shows the model the run builds: with `model.hf_path`, the values of its config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rl_megatron.config import load_config, save_resolved
from rl_megatron.config_checks import validate
from rl_megatron.models.hf_config import (
    HFConfigError,
    config_model_fields,
    gpt_model_kwargs,
    resolve_model_config,
    transformer_config_from_hf,
)

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"


def _hf_folder(path: Path, **overrides) -> Path:
    """A tiny Llama checkpoint's config.json as transformers writes it (no weights: the
    record is resolved without them). transformers >= 5 spells rope_theta inside
    `rope_parameters`, as released checkpoints re-saved with it do."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    LlamaConfig(**{**settings, **overrides}).save_pretrained(path)
    return path


def _config_yaml(tmp_path: Path, hf_dir: Path, **model) -> Path:
    """A one-rank GRPO run on the synthetic task with the model of `hf_dir`."""
    settings = {
        "model": {"hf_path": str(hf_dir), "max_position_embeddings": 64, "dtype": "fp32"} | model,
        "rollout": {
            "engine": "megatron",
            "n": 4,
            "max_prompt_length": 16,
            "max_response_length": 8,
        },
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"synthetic_task": "digit_echo"},
        "trainer": {"output_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_the_record_shows_config_json_values_and_the_model_is_built_with_them(tmp_path):
    hf_dir = _hf_folder(tmp_path / "hf")
    loaded = load_config(_config_yaml(tmp_path, hf_dir), [])
    # What load_config alone leaves (the issue): the dataclass defaults.
    assert (loaded.model.rope_theta, loaded.model.tie_word_embeddings) == (10000.0, False)

    config, warnings = resolve_model_config(loaded)
    assert warnings == []
    validate(config, world_size=1)
    record = yaml.safe_load(save_resolved(config, config.run_dir).read_text())["model"]
    assert record["rope_theta"] == 500000.0
    assert record["tie_word_embeddings"] is True
    assert record["norm_epsilon"] == 1e-6
    assert (record["num_layers"], record["num_query_groups"], record["vocab_size"]) == (2, 2, 128)
    # The user's context budget stays the user's (config_checks checks against it).
    assert record["max_position_embeddings"] == 64

    # The record reloads to the same config, and resolving it again changes nothing.
    again = load_config(config.run_dir / "config.resolved.yaml", [])
    assert again == config
    assert resolve_model_config(again) == (config, [])

    # The builders' arguments (`build_gpt_chunks`: GPTModel and its TransformerConfig),
    # from the same parse of config.json, carry the recorded values.
    from rl_megatron.trainer.build import model_info

    info = model_info(config)
    kwargs = gpt_model_kwargs(info)
    assert kwargs["rotary_base"] == record["rope_theta"]
    assert kwargs["share_embeddings_and_output_weights"] is record["tie_word_embeddings"]
    assert transformer_config_from_hf(info).layernorm_epsilon == record["norm_epsilon"]
    assert {k: getattr(config.model, k) for k in config_model_fields(info)} == (
        config_model_fields(info)
    )


def test_a_given_value_config_json_replaces_is_named(tmp_path):
    """A rope_theta / tie_word_embeddings given beside model.hf_path was never used (the
    builders read config.json): the record shows config.json's, and a warning says so."""
    hf_dir = _hf_folder(tmp_path / "hf")
    path = _config_yaml(
        tmp_path, hf_dir, rope_theta=1000.0, tie_word_embeddings=False, norm_epsilon=1e-5
    )
    config, warnings = resolve_model_config(load_config(path, []))
    assert (config.model.rope_theta, config.model.tie_word_embeddings) == (500000.0, True)
    # tie_word_embeddings=false and norm_epsilon=1e-5 are the defaults: indistinguishable
    # from not given, so replaced without a word.
    assert warnings == [
        f"model.rope_theta: 1000.0 given, but the model is built with 500000.0 from "
        f"{hf_dir / 'config.json'}"
    ]


def test_the_older_config_spelling_and_absent_fields_resolve_as_the_builder_reads_them(
    tmp_path,
):
    """rope_theta at the top level (transformers < 5), no tie_word_embeddings and no
    rms_norm_eps: the parser's defaults (untied, 1e-6), not the config's (1e-5)."""
    import json

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 128,
                "rope_theta": 250000.0,
            }
        )
    )
    config, _ = resolve_model_config(load_config(_config_yaml(tmp_path, hf_dir), []))
    m = config.model
    assert (m.rope_theta, m.tie_word_embeddings, m.norm_epsilon) == (250000.0, False, 1e-6)
    assert m.num_query_groups == 4  # no num_key_value_heads: one KV head per head


def test_an_unsupported_config_json_is_refused_before_anything_runs(tmp_path):
    hf_dir = _hf_folder(tmp_path / "hf")
    text = (hf_dir / "config.json").read_text().replace('"llama"', '"gpt2"')
    (hf_dir / "config.json").write_text(text)
    with pytest.raises(HFConfigError) as info:
        resolve_model_config(load_config(_config_yaml(tmp_path, hf_dir), []))
    assert str(info.value).startswith("config.json: model_type='gpt2' is not supported")


def test_a_random_init_config_is_the_models_description_already():
    """Without model.hf_path the builders build from the config (`random_init_hf_config`):
    resolving returns it unchanged, and the model's fields read back equal it."""
    from rl_megatron.models.hf_config import parse_hf_config
    from rl_megatron.trainer.build import random_init_hf_config

    config = load_config(TINY, ["model.rope_theta=123.0", "model.tie_word_embeddings=true"])
    assert resolve_model_config(config) == (config, [])
    fields = config_model_fields(parse_hf_config(random_init_hf_config(config)))
    assert fields == {k: getattr(config.model, k) for k in fields}
