"""Rollout records (`trainer.dump_rollouts`): each step's trajectories as JSONL, for the user.

    records = RolloutRecords(run_dir, tokenizer, dp_rank, dp_group, rank)
    records.write(step, rollout, scores, per_row)   # collective: every rank calls it

`<run_dir>/rollouts/step_<8-digit step>.jsonl` holds one record per trajectory of the step's
batch, every data-parallel replica's rows in replica order (the ranks of a replica hold the
same rows, so one replica's rows come from the rank of it in global rank 0's DP group):

    step, dp_rank, group          the step as metrics.jsonl numbers it, the replica, the GRPO group
    prompt_ids, response_ids      the prompt's real tokens, the sampled tokens (stop token included)
    token_ids, loss_mask          prompt + response, exactly the tokens trained on, and the mask
                                  the loss uses over them (0 on the prompt)
    rollout_log_probs             the engine's log-prob of each response token; null when it
                                  computed none
    turns, observations, num_turns  each sampled turn's text `[{"text": ...}]`, each observation's
                                  (the template's tokens around the environment's messages,
                                  decoded) and the number of turns; a single-turn row is one
                                  turn and no observation
    finish_reason, reward         "stop" / "length" / … (multi-turn: "done", "max_turns",
                                  "turn_length", "context_length", "environment_error"), the
                                  score the step trains with (multi-turn: the environment's
                                  reward plus the rule's, in `env_reward` the former alone)

A multi-turn row's turns and observations are read off its loss mask (runs of 1 and of 0
after the prompt), so the texts are those of the exact tokens trained on.

Global rank 0 writes a temporary file beside the record and renames it over, so a killed run
never leaves a half file under a record's name; a failed write (a full disk, permissions)
stops every rank with one line naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.rollout.batch import FinishReason, RolloutBatch
from rl_megatron.utils.disk_space import DiskFullError, is_disk_full, no_space_line

__all__ = ["RecordWriteError", "RolloutRecords", "records_of", "write_atomically"]


class RecordWriteError(Exception):
    """A rollout record could not be written (not for lack of space): one line, exit code 2."""


def records_of(
    rollout: RolloutBatch,
    scores: torch.Tensor,
    tokenizer: Any,
    step: int,
    dp_rank: int,
    per_row: dict[str, torch.Tensor] | None = None,
) -> list[dict]:
    """One record per row of `rollout` (this rank's rows), in row order. `per_row`: the
    round's per-row facts; multi-turn ones (`trainer/multi_turn.py`) make multi-turn records."""
    multi_turn = per_row is not None and "mt/turns" in per_row
    # Python lists first: one host copy per tensor, not one per row and field.
    prompts, responses = rollout.prompts.tolist(), rollout.responses.tolist()
    masks = rollout.response_mask.long().tolist()
    lps = rollout.rollout_log_probs
    log_probs = None if lps is None else lps.float().tolist()
    groups, reasons = rollout.group_index.tolist(), rollout.finish_reason.tolist()
    rewards = scores.float().tolist()
    out = []
    for i, (plen, rlen) in enumerate(
        zip(rollout.prompt_lengths.tolist(), rollout.response_lengths.tolist())
    ):
        prompt = prompts[i][len(prompts[i]) - plen :]  # left-padded
        response = responses[i][:rlen]  # right-padded
        record = {
            "step": step,
            "dp_rank": dp_rank,
            "group": groups[i],
            "prompt_ids": prompt,
            "response_ids": response,
            "token_ids": prompt + response,
            "loss_mask": [0] * plen + masks[i][:rlen],
            "rollout_log_probs": None if log_probs is None else log_probs[i][:rlen],
            "turns": [{"text": tokenizer.decode(response, skip_special_tokens=False)}],
            "observations": [],
            "num_turns": 1,
            "finish_reason": FinishReason(reasons[i]).name.lower(),
            "reward": rewards[i],
        }
        if multi_turn:
            turns, observations = _spans(response, masks[i][:rlen])
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
            record["turns"] = [{"text": decode(ids)} for ids in turns]
            record["observations"] = [{"text": decode(ids)} for ids in observations]
            record["num_turns"] = int(per_row["mt/turns"][i])
            record["finish_reason"] = next(
                name[len("mt/finish_") :]
                for name, value in per_row.items()
                if name.startswith("mt/finish_") and value[i] > 0
            )
            record["env_reward"] = float(per_row["mt/env_reward"][i])
        if per_row is not None and "async/token_versions" in per_row:
            # colocated_async: the policy version that sampled each response token, and
            # the data record (dataset index) the row answers.
            record["token_versions"] = per_row["async/token_versions"][i][:rlen].tolist()
            record["data_record"] = int(per_row["async/record"][i])
        out.append(record)
    return out


def _spans(tokens: list[int], mask: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """The runs of `tokens` where `mask` is 1 (sampled turns) and where it is 0
    (observations), each in order."""
    turns: list[list[int]] = []
    observations: list[list[int]] = []
    previous = None
    for token, m in zip(tokens, mask):
        runs = turns if m else observations
        if m != previous:
            runs.append([])
            previous = m
        runs[-1].append(token)
    return turns, observations


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in the same folder (rename is atomic on
    one filesystem). Raises DiskFullError / RecordWriteError, one line naming `path`, and
    leaves neither file behind."""
    tmp = path.with_name(path.name + ".tmp")  # not `step_*.jsonl`: never read as a record
    data = text.encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFullError(no_space_line(path, len(data))) from None
        raise RecordWriteError(
            f"trainer.dump_rollouts: cannot write {path}: {exc.strerror or exc}"
        ) from None


class RolloutRecords:
    """Writes each step's records to `<run_dir>/rollouts/` (global rank 0)."""

    def __init__(
        self, run_dir: Path, tokenizer: Any, dp_rank: int, dp_group: dist.ProcessGroup, rank: int
    ) -> None:
        self.folder = Path(run_dir) / "rollouts"
        self.tokenizer, self.dp_rank, self.dp_group, self.rank = tokenizer, dp_rank, dp_group, rank

    def write(
        self,
        step: int,
        rollout: RolloutBatch,
        scores: torch.Tensor,
        per_row: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """The step's records from every replica into one file; collective over the world
        (every rank learns whether rank 0's write failed, so none waits in a later one)."""
        path = self.folder / f"step_{step:08d}.jsonl"
        rows = records_of(rollout, scores, self.tokenizer, step, self.dp_rank, per_row)
        replicas = [rows]
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Only global rank 0's DP group gathers: its ranks hold one copy of every replica's rows.
        if distributed and 0 in dist.get_process_group_ranks(self.dp_group):
            replicas = [None] * dist.get_world_size(self.dp_group) if self.rank == 0 else None
            dist.gather_object(rows, replicas, dst=0, group=self.dp_group)
        problem = None
        if self.rank == 0:
            text = "".join(json.dumps(r) + "\n" for rs in replicas for r in rs)
            try:
                write_atomically(path, text)
            except (DiskFullError, RecordWriteError) as exc:
                problem = (type(exc).__name__, str(exc))
        if distributed:
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem is not None:
            kind, line = problem
            raise (DiskFullError if kind == "DiskFullError" else RecordWriteError)(line)
        return path
