"""Checkpoints that cannot be silently wrong, on a real training checkpoint.

The tiny Llama actor and critic of test_training_state take one step at TP1·DP2 (2 gloo
ranks) and are saved through the trainer's `RunCheckpoints`. Copies of that checkpoint,
damaged the ways a disk, a copy or an attacker damages them, are then loaded on 2 ranks:
  * bytes flipped inside a tensor of another rank's `.distcp` file, or inside an RNG file
    (same size); `trainer_state.json` edited; a file missing; a file added;
  * a checkpoint without checksums (older versions): refused unless `verify=False`;
  * a crafted pickle as the `.metadata` index, as a ShardedObject inside a `.distcp` (read
    by torch DCP with `weights_only=False`) and as `common.pt` (with
    `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`): nothing runs (the marker file stays absent);
  * a tensor record whose zip directory is broken, unverified: torch's CheckpointException
    (a BaseException) becomes one line;
each raises a one-line `CheckpointError` naming the file, on both ranks. The same
checkpoint resumes at DP1 (1 rank) only with `checkpoint.allow_reshard`, with the saved
weights bit for bit and the next two steps within 1e-4 relative of the DP2 run's (the
gradient is summed over DP in another order). `megatron_to_hf.py` run on `step_X/actor`
refuses a corrupt, truncated or unsigned checkpoint, a malformed `rl_megatron.json` and an
`--out` that is or contains its input, and turns a broken record of an unverified one
into one line (exit code 2).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multirank.test_training_state import (
    ROLES,
    _params,
    _roles,
    _setup,
    _train,
    _write_hf_config,
)
from tests.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
STEP = "run/step_00000001"
PROGRESS = re.compile(r"^\s*$|\d+%\|")  # tqdm's lines (an export that fails half-way)


class _Evil:
    """Unpickled by a plain unpickler, it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _trainer_objects(hf: Path, roles: dict, manager):
    """The trainer's checkpoints with what it registers, at the current layout."""
    from megatron.core import parallel_state as ps

    from rl_megatron.algorithms.kl import FixedKLController
    from rl_megatron.config import Config
    from rl_megatron.data.sampler import PromptSampler
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.trainer.checkpointing import RunCheckpoints, sidecar

    config = Config()
    config.model.hf_path, config.model.dtype = str(hf), "fp32"
    dp = ps.get_data_parallel_world_size()
    sampler = PromptSampler(64, 8, dp_rank=ps.get_data_parallel_rank(), dp_size=dp)
    kl = FixedKLController(0.0)
    info = load_hf_config(hf)
    checkpoints = RunCheckpoints(manager, config.checkpoint)
    for name, head in (("actor", "lm"), ("critic", "value")):
        checkpoints.register_role(
            name, roles[name], sidecar(config, info, head, roles[name].layout)
        )
    checkpoints.register("sampler", sampler)
    checkpoints.register("kl_ctrl", kl)
    return config, checkpoints, sampler, kl


def _save_body(rank: int, world_size: int, root: Path, hf: Path) -> None:
    """Train one step at TP1·DP2, save it as the trainer does, record the next two steps."""
    from rl_megatron.checkpoint import integrity
    from rl_megatron.checkpoint.training_state import CheckpointManager

    _setup(1)
    roles = _roles(hf, seed=0)
    _train(roles)
    config, checkpoints, sampler, kl = _trainer_objects(hf, roles, CheckpointManager(root / "run"))
    sampler.next_batch()
    kl.value = 0.07
    reread = []  # files hashed from disk after the fact rather than while being written
    hash_file = integrity.hash_file
    integrity.hash_file = lambda path: reread.append(Path(path).name) or hash_file(path)
    checkpoints.save(1)
    integrity.hash_file = hash_file
    # Only what megatron-core writes with its own `open` (rank 0): the tensor files of both
    # ranks were hashed while written and gathered.
    assert set(reread) <= {".metadata", "common.pt", "metadata.json"}, reread
    saved = {name: _params(role) for name, role in roles.items()}
    steps = [_train(roles) for _ in range(2)]
    if rank == 0:
        torch.save(saved, root / "saved_params.pt")
        (root / "next_steps.json").write_text(json.dumps(steps))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    run_on_ranks(_save_body, world_size=2, root=root, hf=_write_hf_config(root / "hf"))
    return root


# ---- damaged copies -------------------------------------------------------------------------


def _flip(path: Path, offset: int, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_tensor(role_dir: Path, file: str, model_only: bool = False) -> tuple[int, int]:
    """(offset, length) of the largest tensor record in `file` of a role directory (at DP2
    the model's tensors are all in rank 0's file, rank 1's holds optimizer state)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rl_megatron.checkpoint.safe_metadata import read_metadata

    index = read_metadata(role_dir)
    records = [
        (info.length, info.offset)
        for key, info in index.storage_data.items()
        if info.relative_path == file
        and isinstance(index.state_dict_metadata[key.fqn], TensorStorageMetadata)
        and not (model_only and key.fqn.startswith("optimizer."))
    ]
    length, offset = max(records)
    return offset, length


def _plant_sharded_object(role_dir: Path, marker: Path) -> None:
    """Point one ShardedObject of the index at a crafted `torch.save` payload appended to
    a `.distcp` file (what torch DCP's `load_bytes` unpickles with weights_only=False)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from rl_megatron.checkpoint.safe_metadata import read_metadata

    index = read_metadata(role_dir)
    key = next(
        k
        for k in index.storage_data
        if isinstance(index.state_dict_metadata[k.fqn], BytesStorageMetadata)
    )
    info = index.storage_data[key]
    payload = io.BytesIO()
    torch.save([_Evil(marker)], payload)
    file = role_dir / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(payload.getvalue())
    index.storage_data[key] = dataclasses.replace(
        info, offset=offset, length=len(payload.getvalue())
    )
    (role_dir / ".metadata").write_bytes(pickle.dumps(index))


def _strip_checksums(step: Path) -> None:
    """What a checkpoint of an older version looks like: no manifests, no checksum."""
    state = json.loads((step / "trainer_state.json").read_text())
    del state["files"], state["checksum"]
    (step / "trainer_state.json").write_text(json.dumps(state))
    for role in ROLES:
        (step / role / "manifest.json").unlink()


def _damage(src: Path, work: Path, marker: Path) -> dict[str, tuple[bool, list[str]]]:
    """Damaged copies of `src`: case → (verify, what the one-line error must contain)."""
    cases: dict[str, tuple[bool, list[str]]] = {}

    def copy(name: str, verify: bool, *needles) -> Path:
        shutil.copytree(src, work / name)
        cases[name] = (verify, [str(n) for n in needles])
        return work / name

    # Rank 1's file, so the manifest must hold what the other rank wrote.
    path = copy("tensor", True)
    offset, length = _largest_tensor(path / "actor", "__1_0.distcp")
    _flip(path / "actor" / "__1_0.distcp", offset + length // 2)
    cases["tensor"][1].extend([f"{path / 'actor' / '__1_0.distcp'}: checksum mismatch"])

    path = copy("rng", True)
    rng = path / "rng" / "rank_00001.safetensors"
    _flip(rng, rng.stat().st_size // 2, 4)
    cases["rng"][1].append(f"{rng}: checksum mismatch")

    path = copy("state", True)
    state = (path / "trainer_state.json").read_text()
    (path / "trainer_state.json").write_text(state.replace('"step": 1', '"step": 2'))
    cases["state"][1].append(f"{path / 'trainer_state.json'}: checksum mismatch")

    path = copy("missing", True)
    (path / "actor" / "__1_0.distcp").unlink()
    cases["missing"][1].append(f"{path / 'actor' / '__1_0.distcp'}: missing")

    path = copy("extra", True)
    (path / "critic" / "notes.txt").write_text("hello")
    cases["extra"][1].append(f"{path / 'critic' / 'notes.txt'}: not in manifest.json")

    path = copy("old", True, "no checksums", "checkpoint.verify=false")
    _strip_checksums(path)

    # Unverified: a checksum would refuse these before anything is unpickled.
    path = copy("pickle_index", False)
    (path / "actor" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    cases["pickle_index"][1].append(
        f"{path / 'actor' / '.metadata'}: refusing to unpickle 'posix.system'"
    )
    path = copy("pickle_object", False, "Weights only load failed")
    _plant_sharded_object(path / "critic", marker)
    path = copy("pickle_common", False, "Weights only load failed")
    torch.save({"x": _Evil(marker)}, path / "actor" / "common.pt")

    path = copy("dcp_exception", False, "cannot be", "PytorchStreamReader", "logging.level=DEBUG")
    end = (path / "actor" / "__0_0.distcp").stat().st_size
    _flip(path / "actor" / "__0_0.distcp", end - 22, 4)  # the last record's zip directory
    return cases


def _refusal_body(rank: int, world_size: int, src: Path, work: Path, marker: Path) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint.training_state import CheckpointError, CheckpointManager

    _setup(1)
    roles = _roles(src.parent.parent / "hf", seed=3)
    manager = CheckpointManager(work / "unused")
    box = [_damage(src, work, marker) if rank == 0 else None]
    dist.broadcast_object_list(box)
    # common.pt is read with torch's default, which this variable turns into a full unpickle.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    for name, (verify, needles) in box[0].items():
        with pytest.raises(CheckpointError) as info:
            manager.load(work / name, roles, verify=verify)
        message = str(info.value)
        assert "\n" not in message, f"{name}: {message}"
        for needle in needles:
            assert needle in message, f"{name}: '{needle}' not in: {message}"
        assert not marker.exists(), f"{name}: code from the checkpoint ran"
    # Not verified, the checkpoint of an older version loads.
    assert manager.load(work / "old", roles, verify=False)[0] == 1
    assert manager.load(src, roles)[0] == 1


@pytest.mark.slow
def test_damaged_checkpoints_are_refused_with_one_line(saved, tmp_path):
    marker = tmp_path / "pwned"
    run_on_ranks(_refusal_body, world_size=2, src=saved / STEP, work=tmp_path, marker=marker)
    assert not marker.exists()


# ---- another layout ---------------------------------------------------------------------------


def _reshard_body(rank: int, world_size: int, root: Path) -> None:
    """Resume the TP1·DP2 checkpoint at TP1·DP1 through the trainer's config keys."""
    import logging

    from rl_megatron.checkpoint.training_state import CheckpointError, CheckpointManager

    _setup(1)
    hf = root / "hf"
    roles = _roles(hf, seed=5)
    config, checkpoints, sampler, kl = _trainer_objects(
        hf, roles, CheckpointManager(root / "unused")
    )
    config.checkpoint.resume_from = str(root / STEP)
    log = logging.getLogger("test")
    with pytest.raises(CheckpointError) as info:
        checkpoints.resume(log)
    message = str(info.value)
    assert "\n" not in message and "dp=2" in message and "dp=1" in message, message
    assert "checkpoint.allow_reshard=true" in message, message

    config.checkpoint.allow_reshard = True
    assert checkpoints.resume(log) == 1
    assert sampler.state_dict()["position"] == 8 and kl.value == 0.07
    saved = torch.load(root / "saved_params.pt")
    for name in ROLES:
        for key, value in _params(roles[name]).items():
            assert torch.equal(value, saved[name][key]), f"{name} {key} differs after resume"
    for i, reference in enumerate(json.loads((root / "next_steps.json").read_text())):
        got = _train(roles)
        for name in ROLES:
            for key in ("loss", "grad_norm"):
                a, b = got[name][key], reference[name][key]
                assert abs(a - b) <= 1e-4 * abs(b), f"step {i} at DP1: {name} {key} {a} vs {b}"


@pytest.mark.slow
def test_resume_at_another_dp_size_needs_allow_reshard(saved):
    run_on_ranks(_reshard_body, world_size=1, root=saved)


# ---- the conversion tool on a training checkpoint ----------------------------------------------


def _tool(name: str, *args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "checkpoints_tools" / name), *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _edit_sidecar(ckpt: Path, edit) -> None:
    path = ckpt / "rl_megatron.json"
    path.write_text(edit(path.read_text()))


@pytest.mark.slow
def test_megatron_to_hf_refuses_bad_checkpoints_with_one_line(saved, tmp_path):
    from rl_megatron.checkpoint import integrity

    actor = saved / STEP / "actor"
    marker = tmp_path / "pwned"

    def copy(name: str) -> Path:
        shutil.copytree(actor, tmp_path / name)
        return tmp_path / name

    runs = []  # (what stderr must say, the input that must stay intact or None, process)

    def run(expect: str, ckpt: Path, *args, out: Path | None = None, intact: bool = False):
        out = out or tmp_path / f"out_{len(runs)}"
        runs.append(
            (
                expect,
                ckpt if intact else None,
                _tool("megatron_to_hf.py", "--ckpt", ckpt, "--out", out, *args),
            )
        )

    truncated = copy("truncated")
    os.truncate(truncated / "__0_0.distcp", 1000)
    run(f"{truncated / '__0_0.distcp'}: truncated", truncated)
    run(f"{truncated / '__0_0.distcp'}: truncated", truncated, "--no-verify")
    bad_json = copy("bad_json")
    _edit_sidecar(bad_json, lambda text: text.rstrip()[:-1] + "]\n")
    run(f"{bad_json / 'rl_megatron.json'}: not valid JSON", bad_json, "--no-verify")
    no_head = copy("no_head")
    _edit_sidecar(no_head, lambda text: text.replace('"head"', '"heads"'))
    run(f"{no_head / 'rl_megatron.json'}: no 'head' field", no_head, "--no-verify")
    bad_type = copy("bad_type")
    _edit_sidecar(
        bad_type,
        lambda text: text.replace('"padded_vocab_size": 128', '"padded_vocab_size": "128"'),
    )
    run("'padded_vocab_size' is '128', expected int", bad_type, "--no-verify")
    unsigned = copy("unsigned")
    (unsigned / "manifest.json").unlink()
    run(f"{unsigned / 'manifest.json'}: not found", unsigned)
    crafted = copy("crafted")
    (crafted / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    run("refusing to unpickle 'posix.system'", crafted, "--no-verify")
    # --out is the input, or contains it: refused before anything is touched, --force or not.
    run("is or contains the input", actor, "--force", out=actor, intact=True)
    run("is or contains the input", actor, "--force", out=actor.parent, intact=True)
    hf = saved / "hf"
    runs.append(
        (
            "is or contains the input",
            hf,
            _tool("hf_to_megatron.py", "--hf-dir", hf, "--out", hf.parent, "--force"),
        )
    )
    # Bytes flipped inside a tensor (same size): found by the checksum pass, before any read.
    flipped = copy("flipped")
    offset, length = _largest_tensor(flipped, "__1_0.distcp")
    _flip(flipped / "__1_0.distcp", offset + length // 2)
    run(f"{flipped / '__1_0.distcp'}: checksum mismatch", flipped)
    # Unverified, a broken tensor record: torch's CheckpointException becomes one line.
    broken = copy("broken")
    offset, length = _largest_tensor(broken, "__0_0.distcp", model_only=True)
    _flip(broken / "__0_0.distcp", offset + length - 22, 4)  # the record's zip directory
    run(
        f"{broken}: cannot be read (rank 0: RuntimeError: PytorchStreamReader",
        broken,
        "--no-verify",
    )

    for expect, intact, proc in runs:
        _, stderr = proc.communicate(timeout=300)
        lines = [line for line in stderr.strip().splitlines() if not PROGRESS.search(line)]
        assert proc.returncode == 2, f"{expect}: exit code {proc.returncode}\n{stderr[-3000:]}"
        assert len(lines) == 1 and expect in lines[0], f"{expect}: stderr was\n{stderr}"
        if intact is not None and (intact / "manifest.json").is_file():
            files = integrity.read_manifest(intact)
            integrity.check_listing(intact, files)
            assert integrity.verify_share(intact, files) is None
        elif intact is not None:
            assert (intact / "config.json").is_file()
    assert not marker.exists()
    assert not list(tmp_path.glob("out_*")) and not list(tmp_path.glob(".out_*"))
