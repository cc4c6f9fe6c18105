"""Save and resume the whole training state: roles (weights + optimizer), RNGs, trainer state.

    manager = CheckpointManager(run_dir / "checkpoints", keep_last=2)
    manager.save(step, {"actor": actor, "critic": critic}, trainer_state, sidecar)  # collective
    path = manager.latest()                           # newest complete checkpoint, or None
    step, trainer_state = manager.load(path, roles)   # collective; verifies checksums

On disk, one directory per saved step:

    checkpoints/step_00000042/
      trainer_state.json    written last: format_version, step, layout (every degree),
                            per-role step_count, optimizer format, vpp (chunks) and dtype
                            (model.dtype), the trainer's own state, `files` (size and
                            CRC-32 of the RNG files and of each role's manifest.json) and its
                            own `checksum`. Its presence marks the checkpoint complete.
      actor/manifest.json   size and CRC-32 of every other file under actor/ (`integrity.py`).
      actor/                a dist_checkpointing (torch_dist) directory holding
                            {"model": ...} (`model0`, `model1`, ... with VPP) exactly as
                            checkpoints_tools writes it, plus {"optimizer": ...}: the
                            distributed optimizer's fp32 master weights, Adam moments, step.
      actor/rl_megatron.json, actor/hf/
                            the sidecar (when given) and the HF config / tokenizer files of
                            its `source`, so `megatron_to_hf.py --ckpt step_.../actor` exports.
      critic/ ...
      (a LoRA role: its folder holds the adapters and their optimizer state only; the
      frozen base is referenced from `trainer_state.json`: the HF folder it was built
      from, or `checkpoints/lora_base/<role>/`, written once per run: `lora_base.py`)
      rng/rank_00000.safetensors, rng/rank_00000.json
                            each rank's RNG states (torch CPU, CUDA, Megatron's tracker as
                            tensors; python `random` / numpy as JSON) and its coordinates.

Nothing of ours is pickled (tensors: safetensors or dist_checkpointing; the rest: JSON).
dist_checkpointing's torch_dist format itself pickles its `.metadata` index and its
ShardedObjects (the model's `_extra_state`; with dp_reshardable also the optimizer's param
groups and bucket sizes); `load` reads them through `safe_metadata.restricted_loading`,
which admits only the classes the format is made of: no code runs from a checkpoint.

Integrity. Every file is hashed (CRC-32) as it is written; rank 0 gathers every rank's
entries into the manifests. `load(..., verify=True)` (`checkpoint.verify`) first checks
the listing (a missing, extra or resized file is refused), then every rank re-reads an
even share of the bytes and compares checksums, before any tensor is read: a flipped byte
is refused with one line naming the file. A checkpoint saved without manifests (older
versions) is refused unless `verify=False`.

Atomicity. A save writes into a sibling `step_00000042.tmp-<token>/`; once every rank has
written, rank 0 writes `trainer_state.json` and renames the directory into place. A kill
at any moment leaves the previous checkpoint untouched and `latest()` on it; `.tmp-`
directories are never returned and the next successful save deletes them. Re-saving an
existing step moves the old copy to `step_...old-<token>` first (`latest()` falls back to
it if a kill lands between the two renames), then deletes it. The trainer removes an
earlier run's leftovers at start-up (`step_dirs.remove_leftovers`).

A full disk (ENOSPC / EDQUOT). Refused before anything is written when the disk has less
free space than the newest complete checkpoint took (or, the first time, the parameters plus
Adam's state); a write that still fails on any rank is agreed at the next collective, the
`.tmp-` directory deleted and `DiskFullError` (`utils/disk_space.py`: one line naming the
checkpoint, the bytes needed and free) raised on every rank. Known gap: megatron-core writes
a few small files on rank 0 alone (common.pt, .metadata, metadata.json); ENOSPC there leaves
the other ranks in its collective (the free-space check makes it unlikely).

Resuming. At the same layout (world size, TP, PP, VPP, DP, CP, EP, ETP, sequence
parallelism, rank order: the `layout` record, `state_checks.py`) and `model.dtype` (each
role's `dtype`) everything is restored bit for bit, this rank's RNG streams included.
Another `model.dtype` is refused in one line naming it (megatron-core's optimizer state is
laid out per dtype), and so is another EP / ETP for a role with experts and an optimizer
(megatron-core chains the experts' optimizer separately and cannot reshard it), whatever
`allow_reshard` says. Any other layout is refused unless `load(..., allow_reshard=True)`
(the trainer's `checkpoint.allow_reshard`):
  * weights: any TP / PP / VPP / DP (the stored tensors are global);
  * optimizer state saved `dp_reshardable` (the default, as in Megatron-LM: each rank
    writes its own shard, nothing is gathered): only DP may change;
  * saved `fully_reshardable` (gathered over DP into every DP rank's host memory at save,
    and read whole by every rank at load: for models whose TP x PP shard of fp32 state
    fits in host memory): any layout;
  * RNG streams: left as the caller seeded them (per-rank streams do not map across layouts).
Frozen roles (no optimizer) store and load weights only.

megatron-core 0.16.1 needs a few workarounds (`mcore_compat.py`): with torch's Adam it
cannot save or load a fresh optimizer and loses or aliases Adam's `step` on load; its
checkpoint writer forks helper processes. RNG streams: `rng_state.py`; the step-directory
protocol (tmp / old / del names, commit, fsync order): `step_dirs.py`; the checks on a
checkpoint and its layout before loading: `state_checks.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import CheckpointException

from rl_megatron.checkpoint import integrity, lora_base, step_dirs
from rl_megatron.checkpoint.hf_export import HF_AUX_FILES
from rl_megatron.checkpoint.hf_loader import CheckpointError as BaseCheckpointError
from rl_megatron.checkpoint.hf_loader import unwrap
from rl_megatron.checkpoint.integrity import MANIFEST_FILE
from rl_megatron.checkpoint.mcore_compat import (
    InProcessSaveStrategy,
    ensure_adam_state,
    finish_hybrid_load,
    hybrid_groups_as_data,
    restore_adam_steps,
    tolerate_missing_adam_step,
)
from rl_megatron.checkpoint.rng_state import read_rng, restore_rng, save_rng
from rl_megatron.checkpoint.safe_metadata import describe_failure, restricted_loading
from rl_megatron.checkpoint.state_checks import (
    FORMAT_VERSION,
    LATER_FIELDS,
    SIDECAR_FILE,
    CheckpointError,
    check_checkpoint,
    check_indexes,
    check_role_layout,
    layout_changes,
    rank_coordinates,
    role_dtype,
    roles_layout,
)
from rl_megatron.checkpoint.step_dirs import STATE_FILE
from rl_megatron.config import DTYPE_NAMES
from rl_megatron.parallel import ParallelLayout
from rl_megatron.utils.disk_space import (
    DiskFullError,
    free_bytes,
    is_disk_full,
    no_space_line,
    tree_bytes,
)

HF_SUBDIR = "hf"  # checkpoints_tools/_common.py HF_SUBDIR
RNG_DIR = "rng"
OptimizerSharding = Literal["dp_reshardable", "fully_reshardable"]
log = logging.getLogger(__name__)


class CheckpointManager:
    """Atomic, rotating training checkpoints under one directory (`run_dir/checkpoints`).

    Args:
        root: directory holding the `step_XXXXXXXX/` checkpoints (created on first save).
        keep_last: complete checkpoints kept after a save (>= 1); older ones are deleted.
        group: process group spanning every rank (dist_checkpointing works on the world
            group); default: the world.
        optimizer_sharding: how the distributed optimizer's state is stored (module
            docstring): `dp_reshardable` (no gather; same TP / PP on resume) or
            `fully_reshardable` (gathered over DP into host memory at save; any layout).
    """

    def __init__(
        self,
        root: Path,
        keep_last: int = 2,
        group: dist.ProcessGroup | None = None,
        optimizer_sharding: OptimizerSharding = "dp_reshardable",
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        if optimizer_sharding not in ("dp_reshardable", "fully_reshardable"):
            raise ValueError(f"unknown optimizer_sharding '{optimizer_sharding}'")
        self.root = Path(root)
        self.keep_last = keep_last
        self.group = group
        self.optimizer_sharding = optimizer_sharding
        # LoRA role → (its base copy under this root, the copy manifest's entry): the copy
        # this manager wrote, or resumed from; written once per run (`lora_base.py`).
        self._base_copies: dict[str, tuple[Path, integrity.Entry]] = {}

    # ---- save ---------------------------------------------------------------------------

    def save(
        self,
        step: int,
        roles: Mapping[str, Any],
        trainer_state: dict,
        sidecar: Mapping[str, dict] | None = None,
        hf_bases: Mapping[str, str | None] | None = None,
    ) -> Path:
        """Write `roles`, this rank's RNG and `trainer_state` as checkpoint `step`; collective.

        Args:
            step: the trainer's step (names the directory).
            roles: role name → `MegatronRole` (frozen roles: weights only); an offloaded
                role is reloaded for its part of the save and offloaded again.
            trainer_state: JSON-serialisable, identical on every rank (sampler position, KL
                controller, ...); returned by `load`.
            sidecar: role name → content of `<role>/rl_megatron.json` (checkpoints_tools'
                fields); its `source`, an HF directory, also supplies `<role>/hf/`.
            hf_bases: role name → the HF folder its frozen base was built from, for roles
                with LoRA adapters (`lora_base.py`): their step folders hold the adapters
                only and reference that folder; a LoRA role not named here gets a base copy
                under `lora_base/`, written at the first save of this manager.
        Returns the final checkpoint directory.
        """
        started = time.perf_counter()
        # Every rank checks the same inputs, so a bad one fails everywhere, before any I/O.
        try:
            state_text = json.dumps(trainer_state)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"trainer_state must be JSON-serialisable: {exc}") from None
        unknown = sorted(set(sidecar or {}) - set(roles))
        if unknown:
            raise ValueError(f"sidecar for unknown role(s) {unknown}; roles: {sorted(roles)}")
        final = self.root / f"step_{step:08d}"
        # A full disk on any rank (ENOSPC / EDQUOT) is agreed at the next collective: every
        # rank raises the same DiskFullError, the `.tmp-` directory is removed and the
        # previous checkpoint stays as it was (`_written`).
        layout = roles_layout(roles)
        needed = self._expected_bytes(roles, layout, hf_bases or {})
        tmp = self._make_tmp(final, needed)
        self._writing = (final, needed)  # what a full-disk line names (`_full_line`)
        try:
            bases = self._lora_bases(final, roles, hf_bases or {})
            files = {}  # the step level's manifest (rank 0): RNG files, each role's manifest
            for name in sorted(roles):
                part, extra = "all", (sidecar or {}).get(name)
                if name in bases:  # the tools learn where the base is (and refuse without it)
                    part = "adapters"
                    extra = extra and {**extra, "lora_base": bases[name]}
                with _on_device(roles[name]):
                    entry = self._save_role(tmp / name, roles[name], extra, part)
                if entry is not None:
                    files[f"{name}/{MANIFEST_FILE}"] = entry
            rng, full = _catch_full(
                lambda: save_rng(tmp / RNG_DIR, dist.get_rank(), rank_coordinates(layout))
            )
            # Also the barrier before the commit: every rank has written all it writes.
            gathered = self._gather((rng, full and no_space_line(final, needed)))
            self._written(next((line for _, line in gathered if line), None))
            for entries, _ in gathered:
                files.update((f"{RNG_DIR}/{rel}", entry) for rel, entry in entries.items())
            full = None
            if self._is_leader():
                meta = {
                    "format_version": FORMAT_VERSION,
                    "step": step,
                    "layout": layout.record(),
                    "roles": {
                        name: _role_meta(role, self.optimizer_sharding, bases.get(name))
                        for name, role in roles.items()
                    },
                    "trainer_state": json.loads(state_text),
                    "files": dict(sorted(files.items())),
                }
                _, full = _catch_full(
                    lambda: step_dirs.write_json(tmp / STATE_FILE, integrity.seal(meta))
                )
                if full is None:
                    step_dirs.commit(tmp, final)
                    self._cleanup(keep=final)
                    log.info(
                        "checkpoint step %d: %s (%.1f s)",
                        step,
                        final,
                        time.perf_counter() - started,
                    )
            self._written(full and no_space_line(final, needed))  # the barrier after the commit
        except DiskFullError:
            if self._is_leader() and tmp.exists():
                step_dirs.delete(tmp)
            raise
        return final

    def _expected_bytes(
        self, roles: Mapping[str, Any], layout: ParallelLayout, hf_bases: Mapping[str, Any]
    ) -> int:
        """About what checkpoint `step` will take on disk (collective), for the full-disk line:
        the newest complete checkpoint's size, or (the first save) each role's parameters
        at their dtype plus, with an optimizer, 12 bytes each (fp32 master weights and two
        Adam moments), counted once per model-parallel shard. A LoRA role counts its adapters
        and their state, and its base only where this save writes the base copy."""
        local = 0
        for name, role in roles.items():
            params = [p for chunk in role.model for p in chunk.parameters()]
            base_stored = name in self._base_copies or hf_bases.get(name) is not None
            if lora_base.has_adapters(role) and base_stored:
                params = [p for p in params if p.requires_grad]  # the base is not written
            local += sum(p.numel() * p.element_size() for p in params)
            if role.optimizer is not None:  # a frozen LoRA base has none
                local += 12 * sum(p.numel() for p in params if p.requires_grad)
        replicas = layout.grad_dp  # the ranks holding the same shard: dp·cp
        estimate = sum(self._gather(local)) // max(replicas, 1)
        previous = None
        if self._is_leader():
            found = step_dirs.latest(self.root)
            previous = tree_bytes(found) if found is not None else 0
        return max(estimate, previous or 0)

    def _full_line(self) -> str:
        return no_space_line(*self._writing)

    def _written(self, problem: str | None) -> None:
        """Raise the first rank's full-disk line on every rank (a collective: it synchronises)."""
        problems = self._gather(problem)
        first = next((p for p in problems if p), None)
        if first:
            raise DiskFullError(first)

    def _make_tmp(self, final: Path, needed: int) -> Path:
        """Rank 0 creates the `.tmp-` directory this save writes into; all ranks learn it.

        Refused (every rank) when the disk has less free space than the checkpoint needs:
        nothing is written then, and no rank fails inside megatron-core's writer, some of
        whose files only rank 0 writes (a failure there would leave the others waiting).
        """
        box: list = [None, None]
        if self._is_leader():
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                step_dirs.recover_replaced(self.root)
                free = free_bytes(self.root)
                if free is not None and free < needed:
                    box[1] = no_space_line(final, needed)
                else:
                    box[0] = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:12]}")
                    (box[0] / RNG_DIR).mkdir(parents=True)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                box[1] = no_space_line(final, needed)
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.group)
        if box[1]:
            if self._is_leader() and box[0] is not None:
                step_dirs.delete(box[0])
            raise DiskFullError(box[1])
        return box[0]

    def _save_role(
        self, role_dir: Path, role: Any, sidecar: dict | None, part: str = "all"
    ) -> dict | None:
        """One role as a dist_checkpointing directory (+ sidecar files and the manifest on
        rank 0); returns the manifest's own entry on rank 0, None elsewhere.

        part: "all"; "adapters" (a LoRA role's step folder: adapters and optimizer state);
            "base" (its base copy: the frozen weights, no optimizer).
        """
        _, full = _catch_full(role_dir.mkdir) if self._is_leader() else (None, None)
        self._written(full and self._full_line())
        state = _sharded_state(role, self.optimizer_sharding, is_loading=False, part=part)
        strategy = InProcessSaveStrategy()  # hashes this rank's files as it writes them
        try:
            dist_checkpointing.save(state, str(role_dir), sharded_strategy=strategy)
        except CheckpointException as exc:
            # megatron-core raises a writer's failure on every rank, its cause on rank 0
            # only: a full disk anywhere is agreed; any other failure keeps its traceback.
            full = is_disk_full(exc) and self._full_line()
            problems = self._gather(full or None)
            if not any(problems):
                raise
            self._written(next(p for p in problems if p))
        written = {rel: e for files in self._gather(strategy.files) for rel, e in files.items()}
        entry = full = None
        if self._is_leader():

            def finish() -> dict:
                written.update(_write_sidecar(role_dir, sidecar) if sidecar is not None else {})
                return integrity.write_manifest(
                    role_dir, integrity.complete_entries(role_dir, written)
                )

            entry, full = _catch_full(finish)
        self._written(full and self._full_line())
        return entry

    def _lora_bases(
        self, final: Path, roles: Mapping[str, Any], hf_bases: Mapping[str, str | None]
    ) -> dict[str, dict]:
        """Role → the base record its step folder keeps (`lora_base.py`), for every role
        with LoRA adapters; writes the base copies not yet written or resumed from by this
        manager (collective). The records are complete on rank 0, which writes them."""
        bases = {}
        for name in sorted(roles):
            if not lora_base.has_adapters(roles[name]):
                continue
            if hf_bases.get(name) is not None:
                bases[name], problem = {"kind": "hf"}, None
                if self._is_leader():  # a folder gone since the start: agreed, not a hang
                    try:
                        bases[name] = lora_base.hf_record(hf_bases[name])
                    except (BaseCheckpointError, OSError) as exc:
                        problem = f"{hf_bases[name]}: the LoRA base ({_first_line(exc)})"
                self._agree(problem)
                continue
            if name not in self._base_copies:
                with _on_device(roles[name]):
                    self._base_copies[name] = self._write_base_copy(name, roles[name])
            copy, manifest = self._base_copies[name]
            bases[name] = lora_base.copy_record(final, copy, manifest)
        return bases

    def _write_base_copy(self, name: str, role: Any) -> tuple[Path, integrity.Entry]:
        """`role`'s frozen base as `lora_base/<name>/` (collective): written under a `.tmp-`
        name and renamed into place (`step_dirs.commit`), so it is complete or absent.
        Returns its folder and its manifest's entry (on every rank)."""
        final = self.root / lora_base.BASE_DIR / name
        box: list = [None]
        if self._is_leader():
            box[0] = final.with_name(f"{name}.tmp-{uuid.uuid4().hex[:12]}")
            _, full = _catch_full(lambda: box[0].parent.mkdir(parents=True, exist_ok=True))
            if full is not None:
                box[0] = None
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.group)
        if box[0] is None:
            raise DiskFullError(self._full_line())
        tmp = box[0]
        try:  # the broadcast above ordered the leader's mkdir before every rank's write
            entry = self._save_role(tmp, role, None, part="base")
        except DiskFullError:
            if self._is_leader() and tmp.exists():
                step_dirs.delete(tmp)
            raise
        if self._is_leader():
            step_dirs.commit(tmp, final)
            log.info("LoRA base of %s: %s (written once per run)", name, final)
        box = [entry]
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.group)
        return final, box[0]

    def _cleanup(self, keep: Path) -> None:
        """Delete leftovers of interrupted saves and complete checkpoints past `keep_last`."""
        for path in self.root.iterdir():
            if step_dirs.PARTIAL.match(path.name) and path.is_dir():
                step_dirs.delete(path)
        kept = [p for _, p in step_dirs.complete(self.root)][: self.keep_last]
        for _, path in step_dirs.complete(self.root):
            if path not in kept and path != keep:
                step_dirs.delete(path)

    # ---- latest ---------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest complete checkpoint (by step), or None.

        Directories without `trainer_state.json` and `.tmp-` ones are never returned; a
        step's `.old-` copy only when a kill left no other copy of that step. Collective
        when torch.distributed is initialised: rank 0 looks and tells the others, so every
        rank resumes from the same directory even on a lagging shared filesystem.
        """
        if not dist.is_initialized():
            return step_dirs.latest(self.root)
        box = [step_dirs.latest(self.root) if self._is_leader() else None]
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.group)
        return box[0]

    # ---- load ---------------------------------------------------------------------------

    def load(
        self,
        path: Path,
        roles: Mapping[str, Any],
        *,
        allow_reshard: bool = False,
        verify: bool = True,
        hf_bases: Mapping[str, str | None] | None = None,
    ) -> tuple[int, dict]:
        """Restore `roles` (weights, optimizer, step_count) and this rank's RNG; collective.

        Args:
            path: a checkpoint directory (`latest()` or a user's choice).
            roles: role name → `MegatronRole`, built at the current layout; each must be in
                the checkpoint (it may hold more).
            allow_reshard: accept a different parallel layout (module docstring); the RNG
                is then not restored.
            verify: check every file against the manifests before reading any (a share of
                the bytes per rank); refuses a checkpoint saved without them.
            hf_bases: as for `save`: the HF folders this run built LoRA roles' bases from.
                A LoRA role saved adapters-only gets its base first (the run's copy, or
                the HF folder it was built from, fingerprint compared), then its adapters.
        Returns (step, trainer_state). Raises `CheckpointError` (the same on every rank) for
        a missing, incomplete or corrupt checkpoint, a missing role or a layout mismatch.
        """
        path, names = Path(path), sorted(roles)
        meta, files, problem = None, None, None
        if self._is_leader():
            try:
                meta, files = check_checkpoint(path, names, verify)
            except BaseCheckpointError as exc:
                problem = str(exc)
            except Exception as exc:  # never leave the other ranks waiting in the broadcast
                problem = f"{path}: unreadable checkpoint ({_first_line(exc)})"
        box = [meta, files, problem]
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.group)
        meta, files, problem = box
        if problem:
            raise CheckpointError(problem)
        try:  # the layout first: cheap, and refused before reading any file
            for name, role in roles.items():
                saved = meta["roles"][name]
                check_role_layout(path / name, meta["layout"], saved, role, allow_reshard)
        except CheckpointError as exc:
            problem = str(exc)
        self._agree(problem)
        if verify:
            rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
            self._agree(integrity.verify_share(path, files, rank, size))
        problem = None
        if self._is_leader():  # the indexes are read (restricted) once their bytes are verified
            try:
                check_indexes(path, names)
            except BaseCheckpointError as exc:
                problem = str(exc)
        rng = None
        layout = roles_layout(roles)
        unknown = [k for k in LATER_FIELDS if k not in meta["layout"]]
        if unknown and self._is_leader():
            log.info("%s: an older layout record, without %s: not compared", path, unknown)
        try:
            if not layout_changes(meta["layout"], layout.record()):
                rng = read_rng(path / RNG_DIR, dist.get_rank(), rank_coordinates(layout))
        except ValueError as exc:
            problem = problem or str(exc)
        self._agree(problem)
        copies = self._lora_copies(path, meta, roles, hf_bases or {}, verify)
        for name in names:
            saved = meta["roles"][name]
            with _on_device(roles[name]):
                if name in copies:  # the frozen base before the adapters trained on it
                    self._load_role(copies[name], roles[name], saved, part="base")
                part = "adapters" if saved.get("base") else "all"
                self._load_role(path / name, roles[name], saved, part=part)
            if name in copies and copies[name].parent == (self.root / lora_base.BASE_DIR).resolve():
                self._base_copies[name] = (copies[name], saved["base"]["manifest"])
        if rng is not None:
            restore_rng(*rng)
        elif self._is_leader():
            log.warning("%s: saved at layout %s; RNG streams not restored", path, meta["layout"])
        return meta["step"], meta["trainer_state"]

    def _lora_copies(
        self,
        path: Path,
        meta: dict,
        roles: Mapping[str, Any],
        hf_bases: Mapping[str, str | None],
        verify: bool,
    ) -> dict[str, Path]:
        """Role → the base copy to load before its adapters, for the roles `path` stores
        adapters-only; every base checked against this run's (rank 0) and, with `verify`,
        each copy's bytes against its manifest (a share per rank). Collective."""
        box: list = [{}, {}, None]
        if self._is_leader():
            try:
                for name in sorted(roles):
                    record = meta["roles"][name].get("base")
                    if record is None:
                        continue  # saved whole: no adapters, or before adapters-only saves
                    if not lora_base.has_adapters(roles[name]):
                        raise CheckpointError(
                            f"{path / name}: holds LoRA adapters only, but this run's {name} "
                            f"has none; resume with the actor.lora settings it was saved with"
                        )
                    copy = lora_base.base_source(path, record, hf_bases.get(name), name)
                    if copy is not None:
                        box[0][name] = copy
                        box[1][name] = lora_base.read_copy_files(copy) if verify else {}
                        check_indexes(copy.parent, [copy.name])
            except BaseCheckpointError as exc:
                box[2] = str(exc)
            except Exception as exc:  # never leave the other ranks waiting in the broadcast
                box[2] = f"{path}: the LoRA base cannot be checked ({_first_line(exc)})"
        dist.broadcast_object_list(box, src=self._leader_rank(), group=self.group)
        copies, files, problem = box
        self._agree(problem)
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        for name in sorted(copies) if verify else ():
            self._agree(integrity.verify_share(copies[name], files[name], rank, size))
        return copies

    def _load_role(self, role_dir: Path, role: Any, role_meta: dict, part: str = "all") -> None:
        """Weights, optimizer state and step count of one role; errors agreed by all ranks.

        part: as `_save_role`'s: "adapters" (and the optimizer state) or "base" (weights
            only) of a LoRA role saved adapters-only; the other part is left as it is.
        """
        problem = None
        sharding = role_meta["optimizer"] if part != "base" else None
        optimizer = role.optimizer if part != "base" else None
        try:
            if sharding is None and optimizer is not None:
                raise CheckpointError(f"{role_dir}: holds no optimizer state (a frozen role?)")
            # no_grad: megatron-core 0.16.1's dp_reshardable loader copies into fp32 master
            # weights that are views of the (grad-requiring) parameters, outside no_grad.
            with torch.no_grad():
                state = _sharded_state(role, sharding, is_loading=True, part=part)
                with restricted_loading():  # no code runs from the checkpoint's pickles
                    loaded = dist_checkpointing.load(state, str(role_dir))
                for key, chunk in zip(_model_keys(role), role.model):
                    # Part of a LoRA role: the keys asked for are exactly the ones loaded.
                    unwrap(chunk).load_state_dict(loaded[key], strict=part == "all")
                if optimizer is not None:
                    with tolerate_missing_adam_step(role.optimizer):
                        role.optimizer.load_state_dict(loaded["optimizer"])
                    restore_adam_steps(role.optimizer, loaded["optimizer"])
                    finish_hybrid_load(role.optimizer)  # optim.cpu_offload_fraction > 0
                    role.step_count = role_meta["step_count"]
        except BaseCheckpointError as exc:
            problem = str(exc)
        except CheckpointException as exc:  # torch DCP's, a BaseException: on every rank
            problem = _state_mismatch(role_dir, exc, role) or _dcp_failure(role_dir, exc)
            log.debug("loading %s failed: %s", role_dir, exc)  # every rank's traceback
        except Exception as exc:  # a corrupt file can fail anywhere inside torch DCP
            problem = _state_mismatch(role_dir, exc, role)
            problem = problem or f"{role_dir}: cannot be loaded ({_first_line(exc)})"
            log.debug("loading %s failed", role_dir, exc_info=True)
        self._agree(_bounded(problem))

    # ---- collectives ------------------------------------------------------------------

    def _agree(self, problem: str | None) -> None:
        """Raise the first rank's problem on every rank (no rank is left in a collective)."""
        problems: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, problem, group=self.group)
        first = next((p for p in problems if p), None)
        if first:
            raise CheckpointError(first)

    def _gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order (a collective: it also synchronises)."""
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _is_leader(self) -> bool:
        return dist.get_rank(self.group) == 0

    def _leader_rank(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)


def _catch_full(write: Any) -> tuple[Any, OSError | None]:
    """`(write(), None)`, or `(None, the error)` when the disk is full; other errors raise."""
    try:
        return write(), None
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        return None, exc


def _first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for one-line errors."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# A problem line is cut here: megatron-core's KeyErrors list every key of the state dict
# (kilobytes on one line); the whole text is one `logging.level=DEBUG` away.
MAX_PROBLEM_CHARS = 600


def _bounded(problem: str | None) -> str | None:
    if problem is None or len(problem) <= MAX_PROBLEM_CHARS:
        return problem
    return f"{problem[:MAX_PROBLEM_CHARS]}... (cut; logging.level=DEBUG shows it whole)"


def _state_mismatch(role_dir: Path, exc: BaseException, role: Any) -> str | None:
    """One line for a state dict that does not fit this run's (a KeyError inside megatron-
    core's load): a safety net behind `check_role_layout` for what the layout record cannot
    tell (an older record without ep / etp, a setting it does not hold). None otherwise."""
    failures = sorted(getattr(exc, "failures", {}).items())
    error = failures[0][1][0] if failures else exc
    if not isinstance(error, KeyError):
        return None
    key = str(error.args[0]) if error.args else ""
    key = key.split(" from model not in state dict")[0][:100]
    config = getattr(role, "config", None)
    ep = getattr(config, "expert_model_parallel_size", None)
    return (
        f"{role_dir}: its state does not fit this run's (no {key!r}): it was likely saved at "
        f"another parallel.ep / parallel.etp or model.dtype (this run: parallel.ep={ep}, "
        f"model.dtype={role_dtype(role)}); resume with the settings it was saved with "
        f"(logging.level=DEBUG shows the traceback)"
    )


def _dcp_failure(role_dir: Path, exc: CheckpointException) -> str:
    """One line for torch DCP's exception; every rank's traceback goes to the DEBUG log, so
    a bug inside a reader is one `logging.level=DEBUG` away, not hidden."""
    failures = sorted(exc.failures.items())
    ours = bool(failures) and isinstance(failures[0][1][0], BaseCheckpointError)
    line = describe_failure(role_dir, exc)
    return line if ours else f"{line} (logging.level=DEBUG shows the traceback)"


# ---- what a role stores ----------------------------------------------------------------------


def _model_keys(role: Any) -> list[str]:
    """checkpoints_tools' keys: `model` for one chunk, `model0`, `model1`, ... with VPP."""
    return ["model"] if len(role.model) == 1 else [f"model{i}" for i in range(len(role.model))]


def _sharded_state(role: Any, sharding: str | None, *, is_loading: bool, part: str = "all") -> dict:
    """The role's sharded state dict: model chunks and, if it trains, its optimizer.

    part: "all", or a LoRA role's "adapters" (with the optimizer, whose parameters they
        are) or "base" (the frozen weights, no optimizer): `lora_base.part_of`.
    """
    state = {
        key: lora_base.part_of(unwrap(chunk).sharded_state_dict(), chunk, part)
        for key, chunk in zip(_model_keys(role), role.model)
    }
    if role.optimizer is not None and part != "base":
        ensure_adam_state(role.optimizer)
        # As Megatron-LM: no optimizer-index prefix, so the keys do not depend on chaining.
        metadata = {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}
        with hybrid_groups_as_data(role.optimizer):
            state["optimizer"] = role.optimizer.sharded_state_dict(
                state, is_loading=is_loading, metadata=metadata
            )
    return state


def _role_meta(role: Any, sharding: str, base: dict | None) -> dict:
    """What `load` needs to know about a saved role beyond its tensors; `base`: a LoRA
    role's base record (its step folder holds the adapters only), else none is kept."""
    meta = {
        "step_count": role.step_count,
        "vpp": len(role.model),
        "optimizer": sharding if role.optimizer is not None else None,
        "dtype": role_dtype(role),  # model.dtype: the optimizer state loads only at it
    }
    if base is not None:
        meta["base"] = base
    return meta


@contextlib.contextmanager
def _on_device(role: Any) -> Iterator[None]:
    """An offloaded role's storages are empty: bring it back for its save / load only.

    One role at a time, so a save never holds more roles on the device than a phase does.
    """
    offloader = getattr(role, "offloader", None)
    offloaded = offloader is not None and offloader.is_offloaded
    if offloaded:
        role.reload()
    try:
        yield
    finally:
        if offloaded:
            role.offload()


def _write_sidecar(role_dir: Path, sidecar: dict) -> dict[str, integrity.Entry]:
    """`rl_megatron.json`, and `hf/` copied from its `source` (an HF or converted dir).

    megatron_to_hf.py needs both: the sidecar for dtype / head / padded vocabulary, `hf/`
    for config.json and the tokenizer files of the exported model. Returns the files'
    manifest entries (hashed as written).
    """
    meta = dict(sidecar)
    if "dtype" in meta:  # torch's name, as the tools write (megatron_to_hf: getattr(torch, ...))
        meta["dtype"] = DTYPE_NAMES.get(meta["dtype"], meta["dtype"])
    files = {SIDECAR_FILE: step_dirs.write_json(role_dir / SIDECAR_FILE, meta)}
    if not sidecar.get("source"):
        return files
    for source in (Path(sidecar["source"]), Path(sidecar["source"]) / HF_SUBDIR):
        if (source / "config.json").is_file():
            (role_dir / HF_SUBDIR).mkdir()
            for name in ("config.json", *HF_AUX_FILES):
                if (source / name).is_file():
                    rel = f"{HF_SUBDIR}/{name}"
                    files[rel] = integrity.copy_file(source / name, role_dir / rel)
            break
    return files
