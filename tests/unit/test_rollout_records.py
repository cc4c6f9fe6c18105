"""`trainer.dump_rollouts`: a step's records, and a failed write as one line with no file left.

The run that writes them (every replica's rows, rewards against metrics.jsonl) is
tests/e2e/test_training.py::test_dump_rollouts_writes_one_record_per_trajectory.
"""

from __future__ import annotations

import errno
import json

import pytest
import torch

from rl_megatron.data.synthetic import EOS_ID, CharTokenizer
from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.trainer import rollout_records
from rl_megatron.trainer.rollout_records import RecordWriteError, RolloutRecords
from rl_megatron.utils.disk_space import DiskFullError


def _rollout(log_probs: bool = True) -> tuple[RolloutBatch, torch.Tensor]:
    prompts = [[5, 6, 7], [5, 6, 7], [8]]
    responses = [[9, EOS_ID], [10, 11, 12], [13]]
    lps = [[-0.5, -0.25], [-1.0, -2.0, -3.0], [-0.125]] if log_probs else None
    rollout = RolloutBatch.from_sequences(
        prompts, responses, lps, ["stop", "length", "length"], group_index=[0, 0, 1]
    )
    return rollout, torch.tensor([1.0, 0.0, 0.5])


def test_records_are_the_trained_tokens_with_their_mask_and_reward(tmp_path):
    rollout, scores = _rollout()
    tokenizer = CharTokenizer()
    path = RolloutRecords(tmp_path, tokenizer, 0, None, 0).write(3, rollout, scores)
    assert path == tmp_path / "rollouts" / "step_00000003.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["group"] for r in records] == [0, 0, 1]
    first = records[0]
    assert first["prompt_ids"] == [5, 6, 7] and first["response_ids"] == [9, EOS_ID]
    assert first["token_ids"] == [5, 6, 7, 9, EOS_ID]
    assert first["loss_mask"] == [0, 0, 0, 1, 1]
    assert first["rollout_log_probs"] == [-0.5, -0.25]
    assert first["turns"] == [{"text": tokenizer.decode([9, EOS_ID], skip_special_tokens=False)}]
    assert first["turns"][0]["text"].endswith("<eos>")  # special tokens kept
    assert (first["observations"], first["num_turns"], first["step"]) == ([], 1, 3)
    assert [r["finish_reason"] for r in records] == ["stop", "length", "length"]
    assert [r["reward"] for r in records] == [1.0, 0.0, 0.5]
    assert records[2]["token_ids"] == [8, 13] and records[2]["loss_mask"] == [0, 1]
    # Without the engine's log-probs: null, not zeros.
    rollout, scores = _rollout(log_probs=False)
    path = RolloutRecords(tmp_path, tokenizer, 1, None, 0).write(4, rollout, scores)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["rollout_log_probs"] for r in records} == {None}
    assert {r["dp_rank"] for r in records} == {1}


def _records_left(folder) -> list:
    return [p for p in folder.iterdir() if p.is_file()]


def test_a_failed_write_is_one_line_naming_the_file_and_leaves_none(tmp_path):
    rollout, scores = _rollout()
    records = RolloutRecords(tmp_path, CharTokenizer(), 0, None, 0)
    target = tmp_path / "rollouts" / "step_00000001.jsonl"
    target.mkdir(parents=True)  # a directory where the file should go
    with pytest.raises(RecordWriteError) as info:
        records.write(1, rollout, scores)
    assert str(info.value) == f"trainer.dump_rollouts: cannot write {target}: Is a directory"
    assert _records_left(tmp_path / "rollouts") == []  # no record, no temporary file


def test_a_full_disk_is_the_disk_full_line_and_leaves_none(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rollout_records.os, "fsync", no_space)
    rollout, scores = _rollout()
    with pytest.raises(DiskFullError, match=r"^no space left on device writing .*step_00000002"):
        RolloutRecords(tmp_path, CharTokenizer(), 0, None, 0).write(2, rollout, scores)
    assert _records_left(tmp_path / "rollouts") == []
