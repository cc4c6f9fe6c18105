"""A LoRA role's frozen base in training checkpoints: referenced by each step, stored in none.

With `actor.lora.rank > 0` the base weights never change, so a step folder holds only what
does: the adapters (`lora_a`, `lora_b`, sharded as `LoraAdapter.sharded_state_dict` shards
them) and their optimizer state. `trainer_state.json`'s `roles.<role>.base` says which base
they go with:

    {"kind": "hf", "path": "/models/qwen", "files": {"config.json": {size, crc32}, ...}}
        the HF folder the role was built from (`model.hf_path`). `files` is a cheap
        fingerprint, read in milliseconds whatever the model's size: config.json and
        model.safetensors.index.json whole, and each *.safetensors file's size and header
        (every tensor's name, dtype, shape and byte offsets). A weight rewritten in place
        with the same size is not seen (reading every byte would cost a full read per resume).
    {"kind": "copy", "path": "../lora_base/actor", "manifest": {size, crc32}}
        a randomly initialised base (no `model.hf_path`): a dist checkpoint written once per
        run beside the step folders (`checkpoints/lora_base/<role>/`, its own manifest.json
        of CRC-32s), complete or absent (written under `lora_base.tmp-<token>/`, fsynced,
        renamed: `step_dirs.commit`). `path` is relative to the step folder, so a run
        directory copied elsewhere still resumes; `manifest` is that manifest's own entry,
        so a rewritten copy is told apart, and with `checkpoint.verify` every byte of the
        copy is checked against it before it is read.

Resume (`CheckpointManager.load`) loads the base first (the copy; an HF base was loaded when
the role was built from it), then the adapters and optimizer state; a base that is missing,
changed, or of another kind than this run's is refused in one line naming the file.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rl_megatron.checkpoint import integrity
from rl_megatron.checkpoint.hf_loader import unwrap
from rl_megatron.checkpoint.state_checks import CheckpointError
from rl_megatron.checkpoint.step_dirs import BASE_DIR  # noqa: F401  (the manager's name)
from rl_megatron.models.lora import adapter_param_ids, adapters_of

HF_INDEX = "model.safetensors.index.json"


def has_adapters(role: Any) -> bool:
    """The role carries LoRA adapters: its checkpoints hold them, not its frozen base."""
    return bool(adapters_of(role.model))


def adapter_keys(chunk: torch.nn.Module) -> frozenset[str]:
    """State-dict keys of the adapter parameters of one model chunk (wrappers allowed)."""
    module = unwrap(chunk)
    ids = adapter_param_ids(module)
    return frozenset(name for name, p in module.named_parameters() if id(p) in ids)


def part_of(state: Mapping[str, Any], chunk: torch.nn.Module, part: str) -> dict[str, Any]:
    """The entries of one chunk's (sharded) state dict that `part` stores.

    part: "all"; "adapters" (what a step folder of a LoRA role holds); "base" (the rest,
        `_extra_state` included: what the base copy holds).
    """
    if part == "all":
        return dict(state)
    keys = adapter_keys(chunk)
    return {k: v for k, v in state.items() if (k in keys) == (part == "adapters")}


# ---- the record a step folder keeps ------------------------------------------------------------


def hf_record(folder: str | Path) -> dict:
    """The reference to an HF base folder: its absolute path and fingerprint."""
    folder = Path(folder).resolve()
    return {"kind": "hf", "path": str(folder), "files": hf_fingerprint(folder)}


def copy_record(step_dir: Path, copy_dir: Path, manifest: integrity.Entry) -> dict:
    """The reference to a base copy (`copy_dir`, a role's folder under `lora_base/`)."""
    rel = Path("..") / copy_dir.relative_to(step_dir.parent)
    return {"kind": "copy", "path": rel.as_posix(), "manifest": manifest}


def hf_fingerprint(folder: Path) -> dict[str, integrity.Entry]:
    """File → entry: config.json and the index whole, each *.safetensors file's header
    (its entry's `size` is the whole file's). Raises a one-line CheckpointError."""
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{config}: not found (the LoRA base's HF folder)")
    files = {"config.json": integrity.hash_file(config)}
    if (folder / HF_INDEX).is_file():
        files[HF_INDEX] = integrity.hash_file(folder / HF_INDEX)
    for path in sorted(folder.glob("*.safetensors")):
        files[path.name] = _header_entry(path)
    return files


def _header_entry(path: Path) -> integrity.Entry:
    """A safetensors file's size and the CRC-32 of its header (length prefix + JSON)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        header = f.read(min(length, 100 << 20))
    return {"size": path.stat().st_size, integrity.ALGORITHM: f"{zlib.crc32(prefix + header):08x}"}


def base_source(step_dir: Path, record: dict, hf_folder: str | None, role: str) -> Path | None:
    """Check the base a step folder's role was trained on against this run's.

    Args:
        step_dir: the checkpoint directory; record: its `roles.<role>.base`.
        hf_folder: the HF folder this run built the role from (`model.hf_path`), or None.
    Returns the base copy to load (kind "copy"), None for an HF base (already loaded).
    Raises a one-line CheckpointError naming the file that is missing or changed.
    """
    where = f"{step_dir / 'trainer_state.json'} ({role})"
    if record["kind"] == "hf":
        if hf_folder is None:
            raise CheckpointError(
                f"{where}: trained on the HF base {record['path']}, but this run has no "
                f"model.hf_path; set model.hf_path={record['path']}"
            )
        now = hf_fingerprint(Path(hf_folder))
        for name in sorted(set(record["files"]) | set(now)):
            if record["files"].get(name) != now.get(name):
                state = "missing" if name not in now else "changed"
                raise CheckpointError(
                    f"{Path(hf_folder) / name}: {state} since {step_dir.name} was saved on this "
                    f"HF base; its LoRA adapters only fit the base they were trained on"
                )
        return None
    if hf_folder is not None:
        raise CheckpointError(
            f"{where}: trained on a randomly initialised base ({record['path']}), but this "
            f"run builds it from model.hf_path={hf_folder}; resume without model.hf_path"
        )
    copy = (step_dir / record["path"]).resolve()
    manifest = copy / integrity.MANIFEST_FILE
    if not manifest.is_file():
        raise CheckpointError(
            f"{manifest}: not found: the base copy {step_dir.name}'s LoRA adapters were "
            f"trained on is missing"
        )
    if integrity.hash_file(manifest) != record["manifest"]:
        raise CheckpointError(
            f"{manifest}: changed since {step_dir.name} was saved (another run's base copy?); "
            f"its LoRA adapters only fit the base they were trained on"
        )
    return copy


def read_copy_files(copy: Path) -> dict[str, integrity.Entry]:
    """The base copy's files against its manifest (listing and sizes; no file is read)."""
    files = integrity.read_manifest(copy)
    integrity.check_listing(copy, files)
    return files
