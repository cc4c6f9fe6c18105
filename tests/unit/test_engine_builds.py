"""Each engine's build (`rollout/<engine>/build.py`) hands the config and the run's groups
to its engine as they are meant to go: checked with the engine class replaced by a recorder
(no vLLM started, no model built), so that a swapped group, seed or sleep level shows."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_megatron.config import load_config
from rl_megatron.parallel import ParallelLayout
from rl_megatron.rollout import engines

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"


class Recorder:
    """Stands in for an engine class: keeps its arguments and what the build does to it."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs, self.paired = args, kwargs, None

    def pair_with(self, info, training, bucket_mb, **verify):
        self.paired, self.verify = (info, training, bucket_mb), verify


def _groups(layout: ParallelLayout) -> SimpleNamespace:
    return SimpleNamespace(layout=layout, tp="tp-group", expert_model="expert-group")


TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=5)


def test_the_megatron_build_wires_groups_seed_and_sleep_level(monkeypatch):
    from rl_megatron.rollout.megatron import build

    config = load_config(TINY, ["rollout.sleep_level=0", "trainer.seed=11"])
    monkeypatch.setattr(build, "MegatronEngine", Recorder)
    monkeypatch.setattr(build.dist, "get_rank", lambda: 3)  # dp rank 1 of tp=2 x dp=2
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    engine = engines.build_engine(config, "info", ["chunk"], TOKENIZER, _groups(layout))
    assert engine.args == (["chunk"], "info")
    kw = engine.kwargs
    assert (kw["tp_group"], kw["expert_group"]) == ("tp-group", "expert-group")
    assert kw["seed"] == 11 + 7919 * 1  # replicas differ, TP ranks of one replica agree
    assert (kw["eos_token_ids"], kw["pad_token_id"]) == ((2,), 5)
    r = config.rollout
    assert kw["max_model_len"] == r.max_prompt_length + r.max_response_length
    assert kw["max_batch_size"] == config.data.train_batch_size // 2 * r.n
    assert engine.sleep_level == 0


@pytest.mark.parametrize("level", [0, 2])
def test_the_vllm_build_pairs_its_sync_and_takes_the_sleep_level(monkeypatch, tmp_path, level):
    from rl_megatron.rollout.vllm import build

    config = load_config(
        TINY,
        [
            "rollout.engine=vllm",
            f"rollout.sleep_level={level}",
            "rollout.weight_sync_bucket_mb=64",
            "rollout.verify_sync=sample",
            "rollout.verify_sync_interval=3",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    monkeypatch.setattr(build, "VllmEngine", Recorder)
    monkeypatch.setattr(build.dist, "barrier", lambda: None)
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    engine = build.build(config, "info", ["chunk"], TOKENIZER, _groups(layout))
    (args,) = engine.args
    assert engine.kwargs == {"prompt_groups": [[0, 1], [2, 3]]}  # one per training replica
    assert engine.paired == ("info", layout, 64)
    assert engine.verify == {"verify_sync": "sample", "verify_interval": 3}
    assert engine.sleep_level == level
    # A random init: vLLM builds from the config.json written for it, dummy weights.
    assert args.load_format == "dummy" and (Path(args.model) / "config.json").is_file()
    assert (args.tp, args.pad_token_id, args.seed) == (config.rollout.tp, 5, config.trainer.seed)


@pytest.mark.parametrize("quantization, method", [(None, None), ("fp8", "fp8_per_block")])
def test_the_vllm_build_asks_for_block_fp8(monkeypatch, tmp_path, quantization, method):
    from rl_megatron.rollout.vllm import build

    overrides = ["rollout.engine=vllm", f"trainer.output_dir={tmp_path}"]
    if quantization:
        overrides += [f"rollout.quantization={quantization}", "rollout.kv_cache_dtype=fp8"]
    config = load_config(TINY, overrides)
    monkeypatch.setattr(build, "VllmEngine", Recorder)
    monkeypatch.setattr(build.dist, "barrier", lambda: None)
    engine = build.build(config, "info", [], TOKENIZER, _groups(ParallelLayout(tp=2, pp=1, dp=2)))
    (args,) = engine.args
    assert args.quantization == method
    assert args.kv_cache_dtype == ("fp8" if quantization else "auto")
