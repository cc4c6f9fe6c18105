"""The on-disk protocol of `step_XXXXXXXX/` checkpoint directories: commit, list, recover, delete.

Names a directory may have under the checkpoint root:

    step_00000042               a checkpoint; complete once it holds `trainer_state.json`,
                                which is written last.
    step_00000042.tmp-<token>   a save in progress. It is renamed into place only once
                                complete, so a kill at any moment leaves the previous
                                checkpoint untouched; never returned, and the next
                                successful save deletes it.
    step_00000042.old-<token>   a re-saved step's previous copy, moved aside before the new one
                                is renamed into place, then deleted. `latest` falls back to
                                it, and `recover_replaced` puts it back, only if a kill came
                                between the two renames.
    step_00000042.del-<token>   a directory being deleted: first out of sight (one rename),
                                then its files, so a kill during the removal never leaves a
                                complete-looking checkpoint with files missing.

A LoRA role's frozen base copy (`lora_base.py`) follows the same protocol one level down:
`lora_base/actor` complete, `lora_base/actor.tmp-<token>` being written, `.old-` / `.del-`
as above.

Start-up (`remove_leftovers`, before a run writes anything): `.tmp-` and `.del-` directories
of an earlier run are deleted, a step's lone `.old-` copy is put back; the same for the HF
export folders (`hf/.step_XXXXXXXX.partial`, `.aside-<token>`, `.deleting`: see
`checkpoint/hf_export.py`'s `commit_output_dir`). A full disk then has its space back.

Ordering: JSON files are written durably (a temporary file, fsync, rename); before the commit
rename every directory of the `.tmp-` tree is fsynced, so the rename never exposes missing
entries; after it, the parent directory is. CheckpointManager calls these on rank 0 only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from rl_megatron.checkpoint import integrity

STATE_FILE = "trainer_state.json"  # the completion marker: written last
FINAL = re.compile(r"^step_(\d{8})(\.old-[0-9a-f]+)?$")
PARTIAL = re.compile(r"^step_\d{8}\.(tmp|old|del)-[0-9a-f]+$")
# What an interrupted HF export leaves beside `step_XXXXXXXX/` (hf_export.commit_output_dir):
# the new folder being written, the old one moved aside, one being deleted, the staged source.
HF_PARTIAL = re.compile(r"^\.step_\d{8}\.(partial|deleting)$|^\.source\.tmp$")
HF_ASIDE = re.compile(r"^\.(step_\d{8})\.aside-[0-9a-f]+$")
BASE_DIR = "lora_base"  # LoRA roles' base copies, beside the step folders (lora_base.py)
BASE_PARTIAL = re.compile(r"^(\w+)\.(tmp|old|del)-[0-9a-f]+$")


def complete(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, newest first; a step's `.old-` copy only where it has no other."""
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in root.iterdir():
        match = FINAL.match(path.name)
        if not match or not (path / STATE_FILE).is_file():
            continue
        step = int(match.group(1))
        if match.group(2) is None or step not in found:
            found[step] = path
    return sorted(found.items(), reverse=True)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (by step), or None."""
    found = complete(root)
    return found[0][1] if found else None


def recover_replaced(root: Path) -> None:
    """Put back a step's old copy if a kill came between re-save's two renames."""
    for step, path in complete(root):
        if path.name != f"step_{step:08d}":
            os.rename(path, root / f"step_{step:08d}")


def remove_leftovers(checkpoints: Path, *hf_roots: Path) -> list[str]:
    """Delete what interrupted saves and HF exports left (rank 0, before anything is written).

    `hf_roots`: the folders of step-named HF exports (`<run>/hf`, `<run>/hf_adapter`).

    A step's `.old-` copy without its step directory, or an HF folder's `.aside-` copy
    without its folder, is put back (a kill came between the two renames); everything else
    partial goes. Returns a description of each change, for the log.
    """
    done = []
    if checkpoints.is_dir():
        recover_replaced(checkpoints)
        for path in sorted(checkpoints.iterdir()):
            if PARTIAL.match(path.name) and path.is_dir():
                delete(path)
                done.append(f"removed {path}")
    base = checkpoints / BASE_DIR
    for path in sorted(base.iterdir()) if base.is_dir() else ():
        found = BASE_PARTIAL.match(path.name)
        if not found or not path.is_dir():
            continue
        if found.group(2) == "old" and not (base / found.group(1)).exists():
            os.rename(path, base / found.group(1))  # a kill between commit's two renames
            done.append(f"put back {base / found.group(1)} (from {path.name})")
        else:
            delete(path)
            done.append(f"removed {path}")
    for hf in (root for root in hf_roots if root.is_dir()):
        for path in sorted(hf.iterdir()):
            aside = HF_ASIDE.match(path.name)
            if aside and not (hf / aside.group(1)).exists():
                os.rename(path, hf / aside.group(1))
                done.append(f"put back {hf / aside.group(1)} (from {path.name})")
            elif aside or HF_PARTIAL.match(path.name):
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                done.append(f"removed {path}")
    return done


def commit(tmp: Path, final: Path) -> None:
    """Make `tmp` visible as `final`; an existing `final` is replaced, never lost."""
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('-', 1)[1]}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        delete(old)


def delete(path: Path) -> None:
    """Remove a checkpoint directory: first out of sight (one rename), then its files.

    A kill during the removal then leaves a `.del-` directory that nothing reads, never a
    complete-looking checkpoint with files missing.
    """
    doomed = path.with_name(f"{path.name.split('.')[0]}.del-{uuid.uuid4().hex[:12]}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def write_json(path: Path, content: Any) -> integrity.Entry:
    """Write JSON durably: a temporary file, fsync, rename; its manifest entry."""
    tmp = path.with_name(f".{path.name}.partial")
    entry = integrity.write_bytes(tmp, (json.dumps(content, indent=2) + "\n").encode(), fsync=True)
    os.replace(tmp, path)
    return entry


def fsync_dir(path: Path) -> None:
    """fsync one directory, so the entries created or renamed in it are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync the directories of a checkpoint so the rename never exposes missing entries."""
    for dirpath, _, _ in os.walk(root):
        fsync_dir(Path(dirpath))
