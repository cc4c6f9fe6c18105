"""Checkpoint integrity on one process: manifests and checksums, the restricted unpickler,
the tools' output-directory rule.

The multi-rank and end-to-end versions (a real training checkpoint, the tools as users run
them) are in tests/multirank/test_checkpoint_integrity.py.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch

from rl_megatron.checkpoint import integrity, safe_metadata
from rl_megatron.checkpoint.hf_export import check_output_dir
from rl_megatron.checkpoint.hf_loader import CheckpointError


class _Evil:
    """Unpickled by a plain unpickler, it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _write_dir(root: Path) -> dict[str, integrity.Entry]:
    """Three files written the three ways a save writes them; their entries."""
    root.mkdir()
    (root / "sub").mkdir()
    written = {"a.bin": integrity.write_bytes(root / "a.bin", os.urandom(100_000))}
    with integrity.open_hashed(root / "sub" / "b.bin") as f:
        for _ in range(3):
            f.write(os.urandom(5000))
        written["sub/b.bin"] = f.entry()
    (root / "c.json").write_text("{}")  # written by someone else: hashed after
    return integrity.complete_entries(root, written)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_entries_are_the_files_checksums(tmp_path):
    files = _write_dir(tmp_path / "ckpt")
    assert sorted(files) == ["a.bin", "c.json", "sub/b.bin"]
    for rel, entry in files.items():
        data = (tmp_path / "ckpt" / rel).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, rel
        assert integrity.hash_file(tmp_path / "ckpt" / rel) == entry
    copied = integrity.copy_file(tmp_path / "ckpt" / "a.bin", tmp_path / "copy.bin")
    assert copied == files["a.bin"]


def test_manifest_refuses_flipped_missing_extra_and_resized_files(tmp_path):
    root = tmp_path / "ckpt"
    integrity.write_manifest(root, _write_dir(root))
    files = integrity.read_manifest(root)
    integrity.check_listing(root, files)
    assert integrity.verify_share(root, files) is None

    # A flipped byte, same size: only the checksum sees it.
    data = bytearray((root / "a.bin").read_bytes())
    data[50_000] ^= 0x01
    (root / "a.bin").write_bytes(data)
    integrity.check_listing(root, files)
    problem = integrity.verify_share(root, files)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"{root / 'a.bin'}: checksum mismatch"), problem
    data[50_000] ^= 0x01
    (root / "a.bin").write_bytes(data)

    (root / "extra.txt").write_text("x")
    with pytest.raises(CheckpointError) as info:
        integrity.check_listing(root, files)
    assert _one_line(info).startswith(f"{root / 'extra.txt'}: not in manifest.json")
    (root / "extra.txt").unlink()

    os.truncate(root / "sub" / "b.bin", 100)
    with pytest.raises(CheckpointError) as info:
        integrity.check_listing(root, files)
    assert _one_line(info) == f"{root / 'sub' / 'b.bin'}: truncated (100 of 15000 bytes)"

    (root / "sub" / "b.bin").unlink()
    with pytest.raises(CheckpointError) as info:
        integrity.check_listing(root, files)
    assert _one_line(info).startswith(f"{root / 'sub' / 'b.bin'}: missing")

    (root / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as info:
        integrity.read_manifest(root)
    assert "checkpoint.verify=false" in _one_line(info) and "--no-verify" in str(info.value)


def test_verification_is_shared_out_over_ranks():
    files = {f"f{i}": {"size": size, "crc32": "0"} for i, size in enumerate([9, 1, 5, 5, 3, 0])}
    shares = [integrity.share(files, rank, 3) for rank in range(3)]
    assert sorted(sum(shares, [])) == sorted(files)  # each file exactly once
    loads = [sum(files[f]["size"] for f in share) for share in shares]
    assert max(loads) - min(loads) <= 5


def test_sealed_json_detects_a_changed_value():
    sealed = integrity.seal({"step": 42, "nested": {"a": [1, 2]}})
    assert integrity.is_sealed_intact(sealed) is True
    assert integrity.is_sealed_intact({**sealed, "step": 43}) is False
    assert integrity.is_sealed_intact({"step": 42}) is None


# ---- no code runs from a checkpoint ---------------------------------------------------------


def _dcp_checkpoint(path: Path) -> None:
    """A torch_dist-format directory written by torch itself (one process)."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_restricted_index_reader_reads_real_indexes(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    _dcp_checkpoint(tmp_path / "ckpt")
    ours = safe_metadata.read_metadata(tmp_path / "ckpt")
    torch_s = FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert ours.state_dict_metadata == torch_s.state_dict_metadata
    assert ours.storage_data == torch_s.storage_data
    safe_metadata.check_index_files(tmp_path / "ckpt", ours)


def test_crafted_index_does_not_run(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    _dcp_checkpoint(ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError) as info:
        safe_metadata.read_metadata(ckpt)
    assert _one_line(info) == (
        f"{ckpt / '.metadata'}: refusing to unpickle 'posix.system' (not part of the format)"
    )
    # torch's and megatron-core's readers, inside the context every load of ours uses.
    with safe_metadata.restricted_loading(), pytest.raises(CheckpointError):
        FileSystemReader(str(ckpt)).read_metadata()
    assert not marker.exists()
    (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match="unreadable index"):
        safe_metadata.read_metadata(ckpt)
    assert not marker.exists()


def test_torch_load_is_weights_only_inside_restricted_loading(tmp_path):
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save([{"lr": 0.1}, _Evil(marker)], buf)
    original = torch.load
    with safe_metadata.restricted_loading():
        # What torch DCP's `load_bytes` does with a ShardedObject's bytes.
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        # What a checkpoint legitimately holds still loads (a TE-style buffer included).
        ok = io.BytesIO()
        torch.save([{"betas": (0.9, 0.99)}, torch.ones(2), io.BytesIO(b"te")], ok)
        loaded = torch.load(io.BytesIO(ok.getvalue()))
        assert loaded[0] == {"betas": (0.9, 0.99)} and loaded[2].getvalue() == b"te"
    assert torch.load is original
    assert not marker.exists()


# ---- the tools' output directory --------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
@pytest.mark.parametrize("force", [False, True])
def test_output_dir_may_not_be_near_the_input(tmp_path, where, force):
    src = tmp_path / "models" / "ckpt"
    src.mkdir(parents=True)
    (src / "weights.bin").write_bytes(b"precious")
    out = {"same": src, "parent": tmp_path / "models", "inside": src / "export"}[where]
    with pytest.raises(CheckpointError) as info:
        check_output_dir(out, force, src=src)
    assert _one_line(info).startswith(f"{out}: ")
    assert (src / "weights.bin").read_bytes() == b"precious"
    check_output_dir(tmp_path / "elsewhere", force, src=src)  # a sibling is fine
