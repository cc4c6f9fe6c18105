"""Checks on a training checkpoint and on the layout it is loaded at, before any rank reads.

A checkpoint that is incomplete, truncated, of another format, not as its manifests list it,
saved at a layout that megatron-core cannot load here (or that `checkpoint.allow_reshard`
does not allow) or at another `model.dtype` is refused with a one-line `CheckpointError`
naming the config key, on every rank before dist_checkpointing's collectives start, so no
rank fails alone half-way (and nobody reads megatron-core's KeyError of optimizer keys).

The layout record (`trainer_state.json`'s `layout`, `ParallelLayout.record()` of the layout
the roles were built at) holds every degree: world_size, tp, pp,
vpp, dp, cp, ep, etp and sequence_parallel. Older records lack vpp, ep, etp and
sequence_parallel (`LATER_FIELDS`): those are not compared, since their value is unknown.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl_megatron.checkpoint import hf_loader, integrity, safe_metadata
from rl_megatron.checkpoint.step_dirs import STATE_FILE
from rl_megatron.config import DTYPE_NAMES
from rl_megatron.parallel import ParallelLayout

FORMAT_VERSION = 1
SIDECAR_FILE = "rl_megatron.json"  # checkpoints_tools/_common.py META_FILE
# Layout fields recorded since the expert degrees were added; absent from older records.
LATER_FIELDS = ("vpp", "ep", "etp", "sequence_parallel")
# torch's dtype names (the sidecars') → the config's (`model.dtype`).
CONFIG_DTYPES = {torch_name: name for name, torch_name in DTYPE_NAMES.items()}


class CheckpointError(hf_loader.CheckpointError, RuntimeError):
    """A missing, incomplete or incompatible training checkpoint; the message is one line.

    A subclass of the conversion tools' `CheckpointError`, so one `except` covers both.
    """


# ---- layout ----------------------------------------------------------------------------------


def roles_layout(roles: Mapping[str, Any]) -> ParallelLayout:
    """The layout `roles` were built at (each role's `layout`: the run's, handed to the
    role with its groups); its `record()` is what a checkpoint keeps."""
    layouts = {role.layout for role in roles.values()}
    if len(layouts) != 1:
        raise ValueError(f"roles {sorted(roles)} are not built at one layout: {layouts}")
    return layouts.pop()


def layout_changes(saved_layout: dict, layout: dict) -> dict[str, tuple]:
    """Degree → (saved, now) for each degree that differs; a degree an older record lacks
    (`LATER_FIELDS`) is unknown and not compared."""
    return {
        key: (saved_layout[key], now)
        for key, now in layout.items()
        if key in saved_layout and saved_layout[key] != now
    }


def rank_coordinates(layout: ParallelLayout) -> dict:
    """This rank's place in `layout` (the rank order decides it)."""
    rank = dist.get_rank()
    return {"rank": rank, **layout.coordinates(rank)}


def check_role_layout(
    role_dir: Path, saved_layout: dict, saved: dict, role: Any, allow_reshard: bool
) -> None:
    """Refuse what megatron-core cannot load, before it fails half-way on some rank."""
    check_role_dtype(role_dir, saved, role)
    layout, vpp = role.layout.record(), len(role.model)
    changes = layout_changes(saved_layout, layout)
    if _has_experts(role) and role.optimizer is not None:
        # megatron-core 0.16.1 chains a separate optimizer for the experts (their own DP
        # group) whose state, dp_ or fully_reshardable, only loads at the expert layout it
        # was saved at (ep 2 → 1: KeyError 'optimizer'; 1 → 2: "Expected 2 entries").
        for key in ("ep", "etp"):
            if key in changes:
                was, now = changes[key]
                raise CheckpointError(
                    f"{role_dir}: saved at parallel.{key}={was}, this run has "
                    f"parallel.{key}={now}: megatron-core cannot load the experts' optimizer "
                    f"state at another expert layout, even with checkpoint.allow_reshard; "
                    f"resume at parallel.{key}={was}"
                )
    if not changes and saved["vpp"] == vpp:
        return
    then, now = _describe(saved_layout, saved["vpp"]), _describe(layout, vpp)
    if not allow_reshard:
        raise CheckpointError(
            f"{role_dir}: saved at {then}, this run is {now} (set checkpoint.allow_reshard=true "
            f"to resume at another layout; the RNG streams then restart from the seed)"
        )
    same_model_parallel = not {"tp", "pp", "cp", "vpp"} & changes.keys()
    if saved["optimizer"] == "dp_reshardable" and not (same_model_parallel and saved["vpp"] == vpp):
        raise CheckpointError(
            f"{role_dir}: optimizer state saved as dp_reshardable at {then} cannot be "
            f"loaded at {now}, even with checkpoint.allow_reshard (only DP may change: keep "
            f"tp, pp, cp and vpp; state saved fully_reshardable would load at any layout)"
        )


def check_role_dtype(role_dir: Path, saved: dict, role: Any) -> None:
    """A role resumes at the `model.dtype` it was saved at: megatron-core lays the
    distributed optimizer's state out per dtype (its buffers' keys name it), so another
    dtype fails inside the load with a KeyError of optimizer keys."""
    now = role_dtype(role)
    was = saved.get("dtype") or _sidecar_dtype(role_dir)  # older records: the sidecar's
    if now is not None and was is not None and was != now:
        raise CheckpointError(
            f"{role_dir}: saved with model.dtype={was}, this run has model.dtype={now}: the "
            f"training state resumes only at the dtype it was saved at; resume with "
            f"model.dtype={was} (or export it with checkpoints_tools/megatron_to_hf.py and "
            f"start a new run from that)"
        )


def role_dtype(role: Any) -> str | None:
    """The role's `model.dtype` name (fp32, bf16, fp16), from its models' config."""
    dtype = getattr(getattr(role, "config", None), "params_dtype", None)
    return CONFIG_DTYPES.get(str(dtype).removeprefix("torch."))


def _sidecar_dtype(role_dir: Path) -> str | None:
    """The dtype the role's sidecar names, if it has a readable one (a small JSON file)."""
    try:
        dtype = json.loads((role_dir / SIDECAR_FILE).read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return CONFIG_DTYPES.get(dtype, dtype if dtype in DTYPE_NAMES else None)


def _has_experts(role: Any) -> bool:
    return bool(getattr(getattr(role, "config", None), "num_moe_experts", None))


def _describe(layout: dict, chunks: int) -> str:
    """`world_size=2 tp=2 ... sp=False`; an older record's vpp from its role's chunks."""
    fields = {**layout, "vpp": layout.get("vpp", chunks if chunks > 1 else None)}
    return " ".join(f"{'sp' if k == 'sequence_parallel' else k}={v}" for k, v in fields.items())


# ---- checking a checkpoint -------------------------------------------------------------------


def check_checkpoint(path: Path, names: list[str], verify: bool) -> tuple[dict, dict]:
    """Check that `path` is a complete checkpoint holding `names`; no tensor file is read.

    With `verify`, also that `trainer_state.json` is intact and the directory holds exactly
    the files its manifests list, at their recorded sizes (the checksums of their contents
    are `integrity.verify_share`'s job, spread over the ranks). Returns (metadata, the
    files to checksum: path relative to `path` → manifest entry; empty without `verify`).
    """
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: not found (incomplete or not a training checkpoint)")
    try:
        meta = json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{state_file}: unreadable ({_one_line(exc)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{state_file}: not a JSON object")
    if verify:
        intact = integrity.is_sealed_intact(meta)
        if intact is None:
            raise CheckpointError(
                f"{state_file}: no checksums (saved by an older version); "
                f"{integrity.NO_VERIFY_HINT}"
            )
        if not intact:
            raise CheckpointError(f"{state_file}: checksum mismatch: the file is corrupt")
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
        for file in ("metadata.json", ".metadata", "common.pt"):
            if not (path / name / file).is_file():
                raise CheckpointError(f"{path / name}: incomplete dist checkpoint ({file} missing)")
    return meta, (_checked_files(path, meta, names) if verify else {})


def _checked_files(path: Path, meta: dict, names: list[str]) -> dict:
    """Every file of the checkpoint against its manifests (step level, then each role's)."""
    table = meta.get("files")
    if not isinstance(table, dict):
        raise CheckpointError(f"{path / STATE_FILE}: no 'files' table")
    # The step level lists the RNG files and each role's manifest; a role's files are in
    # that manifest, so the walk skips them.
    role_files = [
        rel
        for rel in integrity.list_files(path)
        if _in_role(rel, meta["roles"]) and rel.split("/", 1)[1] != integrity.MANIFEST_FILE
    ]
    integrity.check_listing(path, table, skip=(STATE_FILE, *role_files))
    files = {rel: entry for rel, entry in table.items() if not _in_role(rel, meta["roles"])}
    for name in names:
        manifest = f"{name}/{integrity.MANIFEST_FILE}"
        if manifest not in table:
            raise CheckpointError(f"{path / STATE_FILE}: lists no {manifest}")
        if integrity.hash_file(path / manifest) != table[manifest]:
            raise CheckpointError(f"{path / manifest}: checksum mismatch: the file is corrupt")
        role_table = integrity.read_manifest(path / name)
        integrity.check_listing(path / name, role_table)
        files.update((f"{name}/{rel}", entry) for rel, entry in role_table.items())
    return files


def _in_role(rel: str, roles: dict) -> bool:
    return "/" in rel and rel.split("/", 1)[0] in roles


def check_indexes(path: Path, names: list[str]) -> None:
    """Each role's dist checkpoint index (read restricted) names files that are all there
    and long enough, so no rank fails alone inside dist_checkpointing's collectives."""
    for name in names:
        safe_metadata.check_index_files(path / name)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
