"""The actor as a Hugging Face model folder while it trains (`checkpoint.save_hf`), and a
LoRA actor's adapters as a PEFT folder (`checkpoint.save_hf_adapter`).

    snapshots = HFSnapshots(config, info, tokenizer, rank, groups)   # every rank
    path = snapshots.save(actor.model, step)                  # collective
    adapters = PeftSnapshots(config, info, rank, groups)       # <run>/hf_adapter/step_X

Each save writes `<run>/hf/step_XXXXXXXX/` (config.json, tokenizer files, safetensors) with
`checkpoint.hf_export.save_hf_checkpoint`, the code `checkpoints_tools/megatron_to_hf.py`
runs: every tensor verified, written into a hidden sibling and renamed into place, so a
kill leaves the previous folders as they were. The trainer saves one next to every
training checkpoint (interval, end of run, SIGTERM); like those, only the newest
`checkpoint.keep_last` are kept. Re-exporting a step renames the old folder aside first and
deletes it only after the new one is in place. A resumed run exports its step again when a
kill interrupted that export (`redo_missing`: the restored weights are the exported ones);
a full disk is one `DiskFullError` line on every rank, the partial folder removed.
`PeftSnapshots` does the same for `<run>/hf_adapter/step_XXXXXXXX/` with
`checkpoint.peft_export.save_peft_adapter` (adapter_config.json + adapter_model.safetensors).

What the folder carries besides the weights is staged once, by rank 0, in
`<run>/hf/.source/`: the model's config.json and generation_config.json (`model.hf_path`'s,
or the config of a random init), and the tokenizer the run trains with, as its
`save_pretrained` writes it (so a `model.tokenizer_path` other than the model's goes along,
and the synthetic task's character tokenizer becomes an HF one).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
from rl_megatron.checkpoint.peft_export import ADAPTER_CONFIG, save_peft_adapter
from rl_megatron.config import Config
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.parallel import ParallelGroups
from rl_megatron.utils.disk_space import DiskFullError, is_disk_full, no_space_line, tree_bytes

SOURCE_DIR = ".source"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class HFSnapshots:
    """Writes and prunes `<run>/hf/step_XXXXXXXX/`; stages the non-weight files at start.

    Args:
        config: the run's config (run folder, `model.*`, `checkpoint.keep_last`).
        info: the actor's architecture.
        tokenizer: the run's tokenizer (anything with `save_pretrained(directory)`).
        rank: global rank; rank 0 writes (every rank must call `save`).
        groups: the run's process groups, with its layout (what the export walks).
    """

    def __init__(
        self,
        config: Config,
        info: HFModelInfo,
        tokenizer: Any,
        rank: int,
        groups: ParallelGroups,
    ) -> None:
        self._setup(config, info, rank, groups, "hf")
        self.source = self.root / SOURCE_DIR
        problem = None
        if rank == 0:
            try:
                stage_source(self.source, config, tokenizer)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                tmp = self.source.parent / f"{SOURCE_DIR}.tmp"
                written = tree_bytes(tmp)  # what it got to: the least it needs
                shutil.rmtree(tmp, ignore_errors=True)
                problem = no_space_line(self.source, written)
        if dist.is_initialized():  # every rank learns a full disk (none waits in a collective)
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem:
            raise DiskFullError(problem)

    COMPLETE = "config.json"  # a step folder holding it is complete (`redo_missing`)

    def _setup(self, config: Config, info: HFModelInfo, rank: int, groups, folder: str) -> None:
        self.groups = groups
        self.root = config.run_dir / folder
        self.info, self.rank = info, rank
        self.keep_last = config.checkpoint.keep_last

    def _export(self, model_chunks: list[torch.nn.Module], out: Path) -> None:
        # force: a resumed run may save a step again; the old folder goes only at the rename.
        save_hf_checkpoint(
            model_chunks, self.info, out, self.groups, src_dir=self.source, force=True
        )

    def save(
        self, model_chunks: list[torch.nn.Module], step: int, log: logging.Logger | None = None
    ) -> Path:
        """Export the actor after `step` optimizer steps (collective); returns the folder."""
        out = self.root / f"step_{step:08d}"
        started = time.perf_counter()
        self._export(model_chunks, out)
        if self.rank == 0:
            prune(self.root, self.keep_last)
            if log is not None:
                took = time.perf_counter() - started
                log.info("%s export step %d: %s (%.1f s)", self.root.name, step, out, took)
        return out

    def redo_missing(
        self, model_chunks: list[torch.nn.Module], step: int, log: logging.Logger
    ) -> Path | None:
        """Export `step` again if its folder is missing (collective; right after resume).

        A kill during the export that follows a checkpoint leaves that checkpoint without
        its HF folder (the start-up cleanup has removed the `.partial`); the weights just
        restored from that checkpoint are the ones the export would have written, so the
        export is redone. Returns the folder, or None when it was complete.
        """
        out = self.root / f"step_{step:08d}"
        box = [(out / self.COMPLETE).is_file() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            return None
        if self.rank == 0:
            log.warning(
                "%s export of step %d did not complete (no %s): exporting it again",
                self.root.name,
                step,
                out,
            )
        return self.save(model_chunks, step, log)


class PeftSnapshots(HFSnapshots):
    """Writes and prunes `<run>/hf_adapter/step_XXXXXXXX/`, the LoRA actor's adapters in the
    PEFT layout (`checkpoint.save_hf_adapter`); nothing to stage (PEFT reads the base from
    `base_model_name_or_path`, `model.hf_path`).

    Args: as `HFSnapshots`'s, without the tokenizer.
    """

    COMPLETE = ADAPTER_CONFIG  # written last, just before the rename

    def __init__(self, config: Config, info: HFModelInfo, rank: int, groups: ParallelGroups):
        self._setup(config, info, rank, groups, "hf_adapter")
        self.lora, self.base = config.actor.lora, config.model.hf_path

    def _export(self, model_chunks: list[torch.nn.Module], out: Path) -> None:
        save_peft_adapter(
            model_chunks,
            self.info,
            out,
            self.groups,
            lora=self.lora,
            base_model_name_or_path=self.base,
            force=True,
        )


def stage_source(directory: Path, config: Config, tokenizer: Any) -> None:
    """Write (afresh) what an export copies besides the weights: config, tokenizer."""
    from rl_megatron.trainer.build import random_init_hf_config

    tmp = directory.parent / f"{directory.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf_path = config.model.hf_path
    if hf_path is not None:
        for name in ("config.json", "generation_config.json"):
            if (Path(hf_path) / name).is_file():
                shutil.copy2(Path(hf_path) / name, tmp / name)
    else:
        hf_config = random_init_hf_config(config)
        # The run's tokenizer decides where a response ends and what pads it.
        for key in ("eos_token_id", "pad_token_id"):
            if getattr(tokenizer, key, None) is not None:
                hf_config.setdefault(key, getattr(tokenizer, key))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step folders (each out of sight first, so a
    kill during the removal leaves no complete-looking folder with files missing)."""
    for leftover in root.glob(".step_*.deleting"):
        shutil.rmtree(leftover, ignore_errors=True)
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    for _, path in steps[:-keep_last]:
        doomed = path.parent / f".{path.name}.deleting"
        os.replace(path, doomed)
        shutil.rmtree(doomed)
