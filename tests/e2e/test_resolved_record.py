"""What the launcher prints at start and keeps as `config.resolved.yaml` for a run from an
HF folder: the values of its config.json that the model is built with (issue 36)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.e2e.test_launcher import _run
from tests.unit.test_resolved_config import _hf_folder


def _run_config(tmp_path: Path, model_type: str = "llama") -> Path:
    """A tiny Llama folder (config.json only: a dry run loads no weights) with SmolLM2's
    kind of values that differ from the config's defaults, and a run on it."""
    hf_dir = _hf_folder(tmp_path / "hf")
    if model_type != "llama":
        text = (hf_dir / "config.json").read_text().replace('"llama"', f'"{model_type}"')
        (hf_dir / "config.json").write_text(text)
    settings = {
        "model": {"hf_path": str(hf_dir), "max_position_embeddings": 64, "dtype": "fp32"},
        "rollout": {"engine": "megatron", "n": 4, "max_prompt_length": 16},
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"synthetic_task": "digit_echo"},
        "trainer": {"output_dir": str(tmp_path / "runs"), "experiment_name": "smol"},
    }
    settings["rollout"]["max_response_length"] = 8
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_the_printed_and_saved_config_show_config_json_values(tmp_path):
    config = _run_config(tmp_path)
    result = _run(["--config", str(config), "--dry-run", "model.rope_theta=1000.0"])
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "runs" / "smol" / "config.resolved.yaml").read_text())
    assert saved["model"]["rope_theta"] == 500000.0
    assert saved["model"]["tie_word_embeddings"] is True
    # The config printed at start (YAML after its log line) says the same.
    printed = result.stdout.split("resolved config:\n", 1)[1]
    model = printed.split("\nparallel:", 1)[0]
    assert "\n  rope_theta: 500000.0\n" in model and "\n  tie_word_embeddings: true\n" in model
    # The value the user gave and config.json replaced: one warning, before the config.
    warnings = [line for line in result.stdout.splitlines() if " WARNING] model." in line]
    assert len(warnings) == 1
    assert warnings[0].endswith(
        "model.rope_theta: 1000.0 given, but the model is built with 500000.0 from "
        f"{tmp_path / 'hf' / 'config.json'}"
    )


def test_a_config_json_the_builders_refuse_is_one_line_before_anything_starts(tmp_path):
    config = _run_config(tmp_path, model_type="gpt2")
    result = _run(["--config", str(config), "--dry-run"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: config.json: model_type='gpt2' is not supported "
        "(supported: llama, qwen2, mistral, qwen3, qwen3_moe, mixtral)"
    ]
    assert result.stdout == "" and not (tmp_path / "runs").exists()
