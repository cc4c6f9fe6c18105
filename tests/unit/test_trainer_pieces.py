"""The trainer's pure pieces: experience helpers, the synthetic task, its reward."""

from __future__ import annotations

import logging

import pytest
import torch

from rl_megatron.data.datasets import DataError
from rl_megatron.data.synthetic import ALPHABET, CharTokenizer, synthetic_dataset
from rl_megatron.rewards.rules import digit_echo
from rl_megatron.trainer import experience as ex


def test_token_level_scores_sit_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    scores = torch.tensor([0.5, -1.0, 9.0, 2.0])
    out = ex.token_level_scores(scores, mask)
    want = torch.zeros(4, 4)
    want[0, 2], want[1, 0], want[3, 3] = 0.5, -1.0, 2.0  # row 2 has no token: no reward
    assert torch.equal(out, want)


def test_sequence_scores_read_at_the_last_token():
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert ex.sequence_scores_at_last_token(values, mask).tolist() == [1.0, 7.0, 0.0]


def test_mini_batch_rows_partition_and_determinism():
    rows = ex.mini_batch_rows(12, 4, torch.Generator().manual_seed(3))
    again = ex.mini_batch_rows(12, 4, torch.Generator().manual_seed(3))
    assert rows == again and len(rows) == 3
    assert sorted(i for mb in rows for i in mb) == list(range(12))
    assert rows != ex.mini_batch_rows(12, 4, torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="do not split"):
        ex.mini_batch_rows(10, 4, torch.Generator())


def test_logprob_mismatch_counts_valid_tokens_only():
    engine = torch.tensor([[-1.0, -2.0, -50.0]])
    trainer = torch.tensor([[-1.5, -2.0, 0.0]])
    from rl_megatron.rollout.logprob_parity import log_prob_mismatch

    out = log_prob_mismatch(engine, trainer, torch.tensor([[1, 1, 0]]))
    assert out == {"rollout/logprob_diff_mean": 0.25, "rollout/logprob_diff_max": 0.5}


def test_training_batch_carries_engine_log_probs_only_when_computed():
    """Without engine log-probs (`rollout.calculate_log_probs: false`) the batch has no
    `rollout_log_prob`, which is what makes the step leave the mismatch metrics out."""
    from rl_megatron.rollout.batch import RolloutBatch

    prompts, responses = [[5, 6], [4]], [[7, 8, 9], [3]]
    log_probs = [[-0.5, -1.0, -1.5], [-2.0]]
    with_lp = RolloutBatch.from_sequences(prompts, responses, log_probs, ["length", "stop"])
    batch = ex.training_batch(with_lp)
    assert batch["rollout_log_prob"].tolist() == [[-0.5, -1.0, -1.5], [-2.0, 0.0, 0.0]]
    assert batch["rollout_log_prob"].dtype == torch.float32

    without = ex.training_batch(
        RolloutBatch.from_sequences(prompts, responses, None, ["length", "stop"])
    )
    assert set(batch) - set(without) == {"rollout_log_prob"}
    for key, value in without.items():
        assert torch.equal(value, batch[key]), key
    assert without["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    ids = tok.encode("3 8 1 =")
    assert len(ids) == 7 and min(ids) >= 2 and len(tok) == len(ALPHABET) + 2 <= 100
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == "3 8 1 ="
    assert tok.decode([len(tok) + 5]) == "\ufffd"  # ids past the alphabet are not digits
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("é")


def test_synthetic_dataset_is_a_pure_function_of_seed_and_split():
    a = synthetic_dataset("digit_echo", 50, seed=1)
    long = synthetic_dataset("digit_echo", 5, seed=1, length=511)
    assert [len(s["prompt"]) for s in long.samples] == [511] * 5
    assert all(s["answer"] == s["prompt"][-1] for s in long.samples)
    assert len(synthetic_dataset("digit_echo", 1, seed=1, length=8).samples[0]["prompt"]) == 7
    with pytest.raises(DataError, match="data.synthetic_prompt_length"):
        synthetic_dataset("digit_echo", 5, seed=1, length=0)
    assert a.samples == synthetic_dataset("digit_echo", 50, seed=1).samples
    assert a.samples != synthetic_dataset("digit_echo", 50, seed=2).samples
    assert a.samples != synthetic_dataset("digit_echo", 50, seed=1, split="val").samples
    for sample, source in zip(a.samples, a.sources):
        assert sample["prompt"][-1] == sample["answer"] and sample["prompt"][-2] == " "
        assert source.startswith("synthetic:train:")
    with pytest.raises(DataError, match="data.synthetic_task"):
        synthetic_dataset("nope", 5, seed=0)


def test_digit_echo_reward():
    sample = {"answer": "7"}
    assert digit_echo("7777", sample) == 1.0
    assert digit_echo("7a", sample) == 0.5
    assert digit_echo("12", sample) == pytest.approx(0.2)
    assert digit_echo("", sample) == 0.0
    with pytest.raises(ValueError, match="one digit"):
        digit_echo("7", {"answer": "77"})


def test_pack_micro_batch_layout():
    from rl_megatron.trainer.packing import pack_micro_batch

    # Row 0: prompt [5, 6], response [7, 8, 9]; row 1: prompt [4], response [3].
    batch = {
        "prompts": torch.tensor([[5, 6], [0, 4]]),
        "responses": torch.tensor([[7, 8, 9], [3, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "advantages": torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]]),
        "scores": torch.tensor([1.0, 2.0]),
    }
    out = pack_micro_batch(batch)
    assert out["packed_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3]]
    assert out["packed_position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert out["cu_seqlens"].tolist() == [0, 5, 7] and out["cu_seqlens"].dtype == torch.int32
    assert int(out["max_seqlen"]) == 5
    # Response token k of row 0 is predicted at packed 1 + k; row 1's only one at 5; the
    # columns past a response are clamped into the row.
    assert out["gather_index"].tolist() == [[1, 2, 3], [5, 5, 5]]
    assert out["advantages"].shape == (2, 3) and out["scores"].tolist() == [1.0, 2.0]
    assert "attention_mask" not in out and "position_ids" not in out

    padded = pack_micro_batch(batch, multiple_of=4, min_length=9)
    assert padded["packed_ids"].shape == (1, 12)
    assert padded["cu_seqlens"].tolist() == [0, 5, 7, 12]  # padding is its own sequence
    assert padded["packed_position_ids"][0, 7:].tolist() == [0, 1, 2, 3, 4]

    short = dict(
        batch, responses=batch["responses"][:, :2], response_mask=batch["response_mask"][:, :2]
    )
    short["attention_mask"] = batch["attention_mask"][:, :4]
    short["advantages"] = batch["advantages"][:, :2]
    assert pack_micro_batch(short)["gather_index"].shape == (2, 2)


def test_random_init_config_json_describes_the_model():
    """vLLM builds a random-init actor from this config.json (then the first sync fills it)."""
    from pathlib import Path

    from rl_megatron.config import load_config
    from rl_megatron.models.hf_config import parse_hf_config
    from rl_megatron.trainer.build import model_info, random_init_hf_config

    tiny = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"
    config = load_config(tiny, ["model.dtype=bf16"])
    cfg = random_init_hf_config(config)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    info = parse_hf_config(cfg)
    assert info == model_info(config)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (4, 64, 100)


def test_console_line_shows_what_the_step_has():
    from rl_megatron.trainer.reporting import console_line

    m = {
        "reward/mean": 0.25,
        "reward/std": 0.1,
        "rollout/response_length_mean": 7.5,
        "actor/entropy_rollout": 3.21,
        "actor/pg_clipfrac": 0.05,
        "actor/grad_norm": 0.5,
        "timing_s/step": 1.04,
        "timing_s/generate": 0.4,
        "timing_s/update_actor": 0.3,
        "perf/tokens_per_s_per_device": 273.4,
    }
    line = console_line(12, 30, m)
    assert line == (
        "step 12/30 | reward 0.250±0.100 | len 7.5 | entropy 3.21 | clip 0.050 | gnorm 0.50"
        " | 1.0s (gen 0.4, upd 0.3) | 273 tok/s/dev"
    )
    m.update({"critic/loss": 0.08, "critic/explained_variance": -0.4, "actor/kl_to_ref": 0.01})
    assert " | vloss 0.0800 ev -0.40 | kl 0.0100 | " in console_line(12, 30, m)


def test_manual_gc_collects_before_the_first_step_and_every_interval():
    import gc
    from types import SimpleNamespace

    from rl_megatron.config import TrainerConfig
    from rl_megatron.trainer.ppo_trainer import PPOTrainer
    from rl_megatron.utils.timers import PhaseTimer

    fake = SimpleNamespace(
        config=SimpleNamespace(trainer=TrainerConfig(manual_gc=True, manual_gc_interval=3)),
        phases=PhaseTimer(),
        step=1,
    )
    collected = []
    try:
        for step in range(1, 8):
            fake.step = step
            PPOTrainer._collect_garbage(fake)
            collected.append("timing_s/gc" in fake.phases.pop())
            assert not gc.isenabled(), "automatic collection stays off while training"
    finally:
        gc.enable()
    # The first call (automatic collection still on) and steps 3 and 6.
    assert collected == [True, False, True, False, False, True, False]


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class _Directory:
    """Stands in for `CheckpointManager`: keeps what `save` is given, in memory."""

    def __init__(self) -> None:
        self.saved: dict = {}

    def save(self, step, roles, states, sidecar=None, hf_bases=None):
        self.saved = {"step": step, "roles": dict(roles), "states": states, "sidecar": sidecar}
        self.saved["hf_bases"] = hf_bases

    def latest(self):
        return "step_dir" if self.saved else None

    def load(self, path, roles, allow_reshard=False, verify=True, hf_bases=None):
        assert (allow_reshard, verify) == (False, True) and set(roles) == set(self.saved["roles"])
        assert hf_bases == self.saved["hf_bases"]  # a LoRA role's base, checked at resume
        return self.saved["step"], self.saved["states"]


def test_run_checkpoints_save_and_restore_what_owners_registered():
    from rl_megatron.checkpoint.hf_loader import CheckpointError
    from rl_megatron.config import CheckpointConfig
    from rl_megatron.trainer.checkpointing import RunCheckpoints

    directory, role = _Directory(), object()
    counter = _Counter()
    checkpoints = RunCheckpoints(directory, CheckpointConfig())
    checkpoints.register_role("actor", role, sidecar={"head": "lm"}, hf_base="/models/base")
    checkpoints.register_role("critic", object())
    checkpoints.register("counter", counter)
    with pytest.raises(ValueError, match="'counter' is registered twice"):
        checkpoints.register("counter", _Counter())
    counter.value = 7
    checkpoints.save(3)
    assert directory.saved["states"] == {"counter": {"value": 7}}
    assert directory.saved["sidecar"] == {"actor": {"head": "lm"}}
    assert directory.saved["hf_bases"] == {"actor": "/models/base"}
    counter.value = 0
    assert checkpoints.resume(logging.getLogger("test")) == 3 and counter.value == 7
    # State registered now but absent from the checkpoint: refused, not left at its start.
    checkpoints.register("late", _Counter())
    with pytest.raises(CheckpointError, match="holds no state for late"):
        checkpoints.resume(logging.getLogger("test"))


def test_rollout_correction_builds_the_actors_batch_only():
    """Rejection first (the actor's response_mask), weights of what is left; the batch the
    critic and the statistics use is not touched; off: the batch itself, no metrics."""
    import math

    from rl_megatron.config import RolloutCorrectionConfig

    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]])
    mu = old - torch.tensor([[math.log(3.0), 0.0, math.log(1.5)], [0.0, math.log(0.5), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = {"old_log_prob": old, "rollout_log_prob": mu, "response_mask": mask}
    same, metrics = ex.rollout_correction(batch, RolloutCorrectionConfig())
    assert same is batch and metrics == {}
    config = RolloutCorrectionConfig(level="token", threshold=1.2, rejection=[0.6, 2.0])
    actor, metrics = ex.rollout_correction(batch, config)
    assert actor["response_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["response_mask"] is mask and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    want = torch.tensor([[0.0, 1.0, 1.2], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(actor["rollout_is_weights"], want, atol=1e-6, rtol=0)
    assert metrics["rollout_corr/rejected_token_frac"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/is_clipped_frac"] == pytest.approx(1 / 3)  # of 3 kept
    assert "rollout_is_weights" not in batch
    # Sequence level: row 0's ratio is 3 * 1 * 1.5 = 4.5, row 1's 1 * 0.5.
    rejection_only = RolloutCorrectionConfig(level="sequence", threshold=None, rejection=[0.4, 2])
    actor, _ = ex.rollout_correction(batch, rejection_only)
    assert "rollout_is_weights" not in actor
    assert actor["response_mask"].tolist() == [[0, 0, 0], [1, 1, 0]]


def test_throughput_splits_generation_from_training(monkeypatch):
    """Per device: the step's tokens over the step, the generated tokens over generation,
    the trained tokens over the training phases only (not reward, sync or checkpoint)."""
    from rl_megatron.trainer import reporting

    monkeypatch.setattr(reporting.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(reporting, "device_peak_tflops", lambda: None)
    m = {
        "rollout/num_samples": 8.0,  # global
        "rollout/prompt_length_mean": 6.0,
        "rollout/response_length_mean": 4.0,
        "timing_s/reshard": 1.0,
        "timing_s/generate": 2.0,
        "timing_s/reward": 3.0,
        "timing_s/old_log_probs": 0.5,
        "timing_s/reference": 0.5,
        "timing_s/update_actor": 3.0,
    }
    out = reporting.throughput(m, info=None, ppo_epochs=1)
    assert out["perf/tokens_per_s_per_device"] == pytest.approx(8 * 10 / 10.0 / 2)
    assert out["perf/generate_tokens_per_s_per_device"] == pytest.approx(8 * 4 / 2.0 / 2)
    assert out["perf/train_tokens_per_s_per_device"] == pytest.approx(8 * 10 / 4.0 / 2)
    # An asynchronous step generated what its own counter says (carried samples too).
    out = reporting.throughput({**m, "async/generated_tokens": 100.0}, None, 1)
    assert out["perf/generate_tokens_per_s_per_device"] == pytest.approx(100 / 2.0 / 2)
    # No training phase timed (a step that skipped its update): no figure, not a division by 0.
    untrained = {k: v for k, v in m.items() if k not in (
        "timing_s/old_log_probs", "timing_s/reference", "timing_s/update_actor")}  # fmt: skip
    assert "perf/train_tokens_per_s_per_device" not in reporting.throughput(untrained, None, 1)
