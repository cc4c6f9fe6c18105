"""What the launcher prints at start and keeps as `config.resolved.yaml` for a run from an
HF folder: the values of its config.json that the model is built with (issue 36)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "launch/ppo.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _run_config(tmp_path: Path, model_type: str = "llama") -> Path:
    """A tiny Llama folder (config.json only: a dry run loads no weights) with SmolLM2's
    kind of values that differ from the config's defaults, and a run on it."""
    from transformers import LlamaConfig

    hf_dir = tmp_path / "hf"
    LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ).save_pretrained(hf_dir)
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
    result = _launch(["--config", str(config), "--dry-run", "model.rope_theta=1000.0"])
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
    result = _launch(["--config", str(config), "--dry-run"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: config.json: model_type='gpt2' is not supported "
        "(supported: llama, qwen2, mistral, qwen3, qwen3_moe, mixtral)"
    ]
    assert result.stdout == "" and not (tmp_path / "runs").exists()
