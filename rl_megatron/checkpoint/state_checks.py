"""Checks on a training checkpoint and on the layout it is loaded at, before any rank reads.

A checkpoint that is incomplete, truncated, of another format or saved at a layout that
megatron-core cannot load here is refused with a one-line `CheckpointError` on every rank
before dist_checkpointing's collectives start, so no rank fails alone half-way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps

from rl_megatron.checkpoint import hf_loader
from rl_megatron.checkpoint.step_dirs import STATE_FILE

FORMAT_VERSION = 1


class CheckpointError(hf_loader.CheckpointError, RuntimeError):
    """A missing, incomplete or incompatible training checkpoint; the message is one line.

    A subclass of the conversion tools' `CheckpointError`, so one `except` covers both.
    """


# ---- layout ----------------------------------------------------------------------------------


def current_layout() -> dict:
    """This run's parallel layout, identical on every rank."""
    return {
        "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def rank_coordinates() -> dict:
    """This rank's place in the layout (the rank order decides it)."""
    return {
        "rank": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }


def check_role_layout(
    role_dir: Path, saved_layout: dict, saved: dict, role: Any, allow_reshard: bool
) -> None:
    """Refuse what megatron-core cannot load, before it fails half-way on some rank."""
    layout, vpp = current_layout(), len(role.model)
    if saved_layout == layout and saved["vpp"] == vpp:
        return
    then = f"{_describe(saved_layout)} vpp={saved['vpp']}"
    now = f"{_describe(layout)} vpp={vpp}"
    if not allow_reshard:
        raise CheckpointError(
            f"{role_dir}: saved at {then}, this run is {now} (load with allow_reshard=True)"
        )
    same_model_parallel = all(saved_layout[k] == layout[k] for k in ("tp", "pp", "cp"))
    if saved["optimizer"] == "dp_reshardable" and not (same_model_parallel and saved["vpp"] == vpp):
        raise CheckpointError(
            f"{role_dir}: optimizer state saved as dp_reshardable at {then} cannot be "
            f"loaded at {now} (only DP may change; save with fully_reshardable)"
        )


def _describe(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


# ---- checking a checkpoint -------------------------------------------------------------------


def check_checkpoint(path: Path, names: list[str]) -> dict:
    """Check that `path` is a complete checkpoint holding `names`; return its metadata."""
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: not found (incomplete or not a training checkpoint)")
    try:
        meta = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{state_file}: unreadable ({exc})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{state_file}: format_version={meta.get('format_version')} is not {FORMAT_VERSION}"
        )
    lacking = [k for k in ("step", "layout", "roles", "trainer_state") if k not in meta]
    if lacking:
        raise CheckpointError(f"{state_file}: no '{lacking[0]}' field")
    missing = [n for n in names if n not in meta.get("roles", {})]
    if missing:
        raise CheckpointError(
            f"{path}: no role '{missing[0]}' in this checkpoint (has {sorted(meta['roles'])})"
        )
    for name in names:
        _check_dist_checkpoint(path / name)
    return meta


def _check_dist_checkpoint(role_dir: Path) -> None:
    """Every file the dist checkpoint's index names exists and is long enough.

    Catches deleted or truncated files on rank 0 before any rank starts reading, so no
    rank fails alone inside dist_checkpointing's collectives.
    """
    from torch.distributed.checkpoint import FileSystemReader

    for name in ("metadata.json", ".metadata", "common.pt"):
        if not (role_dir / name).is_file():
            raise CheckpointError(f"{role_dir}: incomplete dist checkpoint ({name} missing)")
    try:
        index = FileSystemReader(str(role_dir)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{role_dir / '.metadata'}: unreadable ({exc})") from None
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, size in sorted(needed.items()):
        file = role_dir / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"{file}: truncated ({file.stat().st_size} of {size} bytes)")
