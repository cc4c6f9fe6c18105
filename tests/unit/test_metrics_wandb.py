"""Optional Weights & Biases logging (`logging.wandb`): off by default, never required.

`wandb` is not installed in the test environment; a stand-in module records what the
tracker asks of it (init arguments, logged steps, finish), as the real one would receive.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from rl_megatron.config import ConfigError, load_config
from rl_megatron.config_checks import validate
from rl_megatron.utils.metrics import WANDB_ID_FILE, MetricsTracker, read_metrics, wandb_settings

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"


class _StandInWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0
        self.util = types.SimpleNamespace(generate_id=lambda: f"id{len(self.inits)}")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        module = self

        class _Run:
            def log(self, values, step):
                module.logged.append((step, dict(values)))

            def finish(self):
                module.finished += 1

        return _Run()


@pytest.fixture
def fake_wandb(monkeypatch):
    module = _StandInWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def _config(tmp_path, *overrides):
    return load_config(TINY, [f"trainer.output_dir={tmp_path}", *overrides])


def test_off_by_default_and_never_imported(tmp_path, monkeypatch):
    config = _config(tmp_path)
    assert config.logging.wandb is False and wandb_settings(config) is None
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    tracker = MetricsTracker(tmp_path, rank=0, wandb=wandb_settings(config))
    tracker.log(1, {"reward/mean": 0.5})
    tracker.close()
    assert "wandb" not in sys.modules
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5}]


def test_logs_every_step_on_rank_0_and_resumes_the_same_run(tmp_path, fake_wandb):
    config = _config(tmp_path, "logging.wandb=true", "logging.wandb_project=proj")
    settings = wandb_settings(config)
    assert MetricsTracker(config.run_dir, rank=1, wandb=settings).log(1, {"a": 1.0}) == {"a": 1.0}
    assert fake_wandb.inits == [] and fake_wandb.logged == []  # other ranks: nothing
    tracker = MetricsTracker(config.run_dir, rank=0, wandb=settings)
    tracker.log(1, {"reward/mean": 0.25, "timing_s/step": 1.5})
    tracker.log(2, {"reward/mean": float("nan")})
    tracker.close()
    (init,) = fake_wandb.inits
    assert init["project"] == "proj" and init["name"] == "tiny_cpu" and init["entity"] is None
    assert init["id"] == "id0" and init["resume"] == "allow"
    assert init["config"]["logging"]["wandb"] is True and init["dir"] == str(config.run_dir)
    assert fake_wandb.logged[0] == (1, {"reward/mean": 0.25, "timing_s/step": 1.5})
    assert fake_wandb.logged[1][0] == 2 and fake_wandb.finished == 1
    # A resumed launch continues the same W&B run (the id is kept in the run folder).
    assert (config.run_dir / WANDB_ID_FILE).read_text().strip() == "id0"
    MetricsTracker(config.run_dir, rank=0, wandb=settings).close()
    assert fake_wandb.inits[1]["id"] == "id0"


def test_asking_without_the_package_is_a_one_line_config_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"^logging\.wandb: needs the wandb package"):
        validate(_config(tmp_path, "logging.wandb=true"), world_size=4)
    validate(_config(tmp_path), world_size=4)  # off: nothing asked, nothing needed
