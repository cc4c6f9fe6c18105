"""A LoRA actor's training checkpoints hold the adapters only (`checkpoint/lora_base.py`).

On 2 gloo ranks at TP2, a randomly initialised 2-layer Llama with adapters on every linear
(test_training_state's model) takes a step, is saved, takes another, is saved again:
  (a) each step folder holds adapter tensors and their optimizer state, no base tensor
      (exactly the adapters' elements), fewer tensor bytes than the base copy; the base copy (`lora_base/actor/`) is
      written once, at the first save (same inode and manifest at the second), and both
      step folders reference it;
  (b) a fresh actor built from another seed (another base, other adapters) resumes from the
      second save bit for bit: every weight (base included: it comes from the copy), fp32
      master weight, Adam moment and step; one more step on both gives the same bits;
  (c) a base copy with one flipped byte, a missing copy and a copy rewritten by another run
      are refused, each in one line naming the file;
      megatron_to_hf.py refuses the step folder whose copy is missing in one line;
  (d) with an HF base (`hf_bases`) no copy is written and the step folder records the HF
      folder's fingerprint; one changed byte of its config.json, or of a safetensors
      header, and a run without `model.hf_path` are refused in one line.

Tolerance: none: save and load copy bytes, and the same step on the same bytes is the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multirank.test_training_state import (
    _actor_loss,
    _assert_same,
    _batch,
    _setup,
    _snapshot,
    _write_hf_config,
)
from tests.spawn import run_on_ranks

MODULES = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
B = 4
TOOL = Path(__file__).resolve().parents[2] / "checkpoints_tools" / "megatron_to_hf.py"


def _lora_actor(hf: Path, seed: int):
    """A LoRA actor at the current layout: base and adapters drawn from `seed`."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.config import OptimConfig
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.models.lora import apply_lora
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.roles import MegatronRole

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    chunks = build_gpt_chunks(
        load_hf_config(hf), ParallelLayout.from_megatron(), dtype=torch.float32, use_te=False
    )
    apply_lora(chunks, rank=4, alpha=8.0, dropout=0.0, target_modules=MODULES, seed=seed)
    optim = OptimConfig(lr=1e-2, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5)
    return {"actor": MegatronRole(chunks, optim=optim, micro_batch_size=2)}


def _train(roles: dict) -> dict:
    return {"actor": roles["actor"].train_step(_batch(), _actor_loss)}


def _stored(folder: Path) -> dict[str, int]:
    """Key → global element count of each tensor in a dist checkpoint's index."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rl_megatron.checkpoint import safe_metadata

    index = safe_metadata.read_metadata(folder).state_dict_metadata
    return {k: md.size.numel() for k, md in index.items() if isinstance(md, TensorStorageMetadata)}


def _tensor_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


def _expect_refused(manager, path: Path, roles: dict, needle: str, **kw) -> None:
    from rl_megatron.checkpoint.training_state import CheckpointError

    with pytest.raises(CheckpointError) as info:
        manager.load(path, roles, **kw)
    message = str(info.value)
    assert "\n" not in message and needle in message, message


def _check_layout_on_disk(run: Path) -> None:
    """(a) what the step folders and the base copy hold."""
    base = run / "lora_base" / "actor"
    base_keys = _stored(base)
    assert base_keys and not any("_lora." in k for k in base_keys), base_keys
    for step in ("step_00000001", "step_00000002"):
        folder = run / step / "actor"
        keys = _stored(folder)
        model = {k: n for k, n in keys.items() if not k.startswith("optimizer.")}
        assert model and all("_lora." in k for k in model), model
        assert not set(keys) & set(base_keys)
        # 2 layers x 4 adapters of rank 4: 2 x (4·(64+128) + 4·(64+64) + 4·(64+192) + 4·(96+64))
        assert sum(model.values()) == 2 * 4 * (192 + 128 + 256 + 160)
        # The distributed optimizer's buckets: only the adapters have a grad buffer.
        params = [n for k, n in keys.items() if k.startswith("optimizer.") and k.endswith("param")]
        # Each TP rank's padded bucket of its adapter shards (the base would be ~100k).
        assert params and sum(params) < 2 * sum(model.values()), params
        # Bytes: here the adapters are 8 % of the weights, and Adam keeps three fp32 copies
        # of them in padded buckets, so the folder is about 3/4 of the base alone (on a 7B
        # model at rank 16 the adapters are ~0.6 %: a few % of the base).
        ratio = _tensor_bytes(folder) / _tensor_bytes(base)
        assert ratio < 0.8, f"{step}: adapters + optimizer are {ratio:.2f} of the base"
        meta = json.loads((run / step / "trainer_state.json").read_text())
        record = meta["roles"]["actor"]["base"]
        assert record["kind"] == "copy" and record["path"] == "../lora_base/actor"
        sidecar = json.loads((folder / "rl_megatron.json").read_text())
        assert sidecar["lora_base"] == record


def _check_tool_refuses(folder: Path, base: Path) -> None:
    """megatron_to_hf.py on an adapters-only step folder whose base copy is gone."""
    out = folder.parent / "hf_out"
    result = subprocess.run(
        [sys.executable, str(TOOL), "--ckpt", str(folder), "--out", str(out)],
        cwd=TOOL.parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if line.startswith("megatron_to_hf: ")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"{base.resolve()}: missing" in lines[0], lines
    assert not out.exists()


def _body(rank: int, world_size: int, root: Path, hf: Path) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint import integrity
    from rl_megatron.checkpoint.training_state import CheckpointManager

    _setup(2)
    roles = _lora_actor(hf, seed=0)
    sidecar = {
        "actor": {
            **{"format_version": 1, "head": "lm", "dtype": "fp32", "padded_vocab_size": 128},
            "source": str(hf),
        }
    }
    run = root / "run"
    manager = CheckpointManager(run)
    _train(roles)
    manager.save(1, roles, {}, sidecar=sidecar)
    base = run / "lora_base" / "actor"
    first = (base.stat().st_ino, integrity.hash_file(base / "manifest.json"))
    _train(roles)
    saved = _snapshot(roles)
    path = manager.save(2, roles, {}, sidecar=sidecar)
    dist.barrier()
    # (a) written once: the same folder, not rewritten by the second save.
    assert (base.stat().st_ino, integrity.hash_file(base / "manifest.json")) == first
    assert sorted(p.name for p in (run / "lora_base").iterdir()) == ["actor"]
    if rank == 0:
        _check_layout_on_disk(run)

    # (b) another base and other adapters, then the resume.
    fresh = _lora_actor(hf, seed=5)
    # Every matrix differs (norms start at ones in both), base and adapters alike.
    other = fresh["actor"].model[0].module.named_parameters()
    matrices = {k: p.detach().clone() for k, p in other if p.dim() == 2}
    assert len(matrices) > 20
    for key, value in matrices.items():
        assert not torch.equal(value, saved["actor"][0][f"0.{key}"]), key
    resumer = CheckpointManager(run)
    assert resumer.load(path, fresh) == (2, {})
    _assert_same("resumed LoRA actor", saved, _snapshot(fresh))
    a, b = _train(roles), _train(fresh)
    assert a["actor"] == b["actor"], (a, b)
    _assert_same("one step after the resume", _snapshot(roles), _snapshot(fresh))
    # The resumed manager reuses the copy it loaded from: still not rewritten.
    resumer.save(3, fresh, {})
    dist.barrier()
    assert (base.stat().st_ino, integrity.hash_file(base / "manifest.json")) == first

    # (c) a broken base copy: one flipped byte, missing, rewritten.
    copies = {k: root / k for k in ("flipped", "missing", "rewritten")}
    if rank == 0:
        for folder in copies.values():
            shutil.copytree(run, folder)
        tensor_file = sorted((copies["flipped"] / "lora_base/actor").glob("*.distcp"))[0]
        data = bytearray(tensor_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        tensor_file.write_bytes(bytes(data))
        shutil.rmtree(copies["missing"] / "lora_base")
        manifest = copies["rewritten"] / "lora_base/actor/manifest.json"
        manifest.write_text(manifest.read_text() + "\n")  # as if another run had written it
    dist.barrier()
    step = "step_00000002"
    flipped = copies["flipped"] / "lora_base/actor" / tensor_file.name if rank == 0 else None
    box = [str(flipped)]
    dist.broadcast_object_list(box)
    _expect_refused(manager, copies["flipped"] / step, fresh, f"{box[0]}: checksum mismatch")
    missing = copies["missing"] / "lora_base/actor/manifest.json"
    _expect_refused(manager, copies["missing"] / step, fresh, f"{missing}: not found")
    if rank == 0:  # the export tool too: one line naming the missing base copy
        _check_tool_refuses(copies["missing"] / step / "actor", missing.parent)
    rewritten = copies["rewritten"] / "lora_base/actor/manifest.json"
    _expect_refused(manager, copies["rewritten"] / step, fresh, f"{rewritten}: changed")

    # (d) an HF base: referenced by fingerprint, never copied.
    hf_run = root / "hf_run"
    hf_manager = CheckpointManager(hf_run)
    hf_path = hf_manager.save(4, roles, {}, hf_bases={"actor": str(hf)})
    dist.barrier()
    assert not (hf_run / "lora_base").exists()
    record = json.loads((hf_path / "trainer_state.json").read_text())["roles"]["actor"]["base"]
    assert record["kind"] == "hf" and record["path"] == str(hf.resolve())
    assert sorted(record["files"]) == ["config.json", "model.safetensors"]
    assert hf_manager.load(hf_path, fresh, hf_bases={"actor": str(hf)})[0] == 4
    _expect_refused(hf_manager, hf_path, fresh, "this run has no model.hf_path")
    _expect_refused(manager, path, fresh, "randomly initialised base", hf_bases={"actor": str(hf)})
    dist.barrier()
    if rank == 0:  # one byte of the safetensors header (a dtype name), then of config.json
        weights = hf / "model.safetensors"
        weights.write_bytes(weights.read_bytes().replace(b"F32", b"F16", 1))
    dist.barrier()
    name = f"{hf / 'model.safetensors'}: changed"
    _expect_refused(hf_manager, hf_path, fresh, name, hf_bases={"actor": str(hf)})
    if rank == 0:
        config = hf / "config.json"
        config.write_text(config.read_text().replace('"vocab_size": 100', '"vocab_size": 101'))
    dist.barrier()
    name = f"{hf / 'config.json'}: changed"
    _expect_refused(hf_manager, hf_path, fresh, name, hf_bases={"actor": str(hf)})


def test_lora_checkpoints_hold_adapters_only(tmp_path):
    from safetensors.torch import save_file

    hf = _write_hf_config(tmp_path / "hf")
    save_file({"w": torch.zeros(2)}, str(hf / "model.safetensors"))
    os.sync()
    run_on_ranks(_body, world_size=2, root=tmp_path, hf=hf)
