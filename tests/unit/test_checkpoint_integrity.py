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


def _crafted(module: str, name: str, *args, stack: bool = False) -> bytes:
    """A pickle that calls `module.name(*args)`, written opcode by opcode as an attacker
    would (any module and name, not only an importable object's own): GLOBAL (protocol 2)
    or STACK_GLOBAL (protocol 4), the arguments' tuple, REDUCE."""
    packed = pickle.dumps(args, protocol=4 if stack else 2)[2:-1]  # no PROTO, no STOP
    if not stack:
        return b"\x80\x02c" + f"{module}\n{name}\n".encode() + packed + b"R."
    packed = packed[9:] if packed[:1] == b"\x95" else packed  # no FRAME
    strings = b"".join(b"\x8c" + bytes([len(t)]) + t.encode() for t in (module, name))
    return b"\x80\x04" + strings + b"\x93" + packed + b"R."


# Callables the format never needs, with arguments that would leave `{marker}` behind (or
# fail loudly) if the call ran: code execution, processes, files, torch's own loaders and
# savers, torch internals, the pickle machinery itself.
_REFUSED = [
    ("posix", "system", ("touch {marker}",)),
    ("os", "system", ("touch {marker}",)),
    ("subprocess", "Popen", (["touch", "{marker}"],)),
    ("subprocess", "check_call", (["touch", "{marker}"],)),
    ("builtins", "eval", ("open({marker!r}, 'w').close()",)),
    ("builtins", "exec", ("open({marker!r}, 'w').close()",)),
    (
        "builtins",
        "getattr",
        (
            "{marker}",
            "upper",
        ),
    ),
    ("builtins", "__import__", ("os",)),
    (
        "builtins",
        "open",
        (
            "{marker}",
            "w",
        ),
    ),
    ("torch", "load", ("{marker}",)),
    (
        "torch",
        "save",
        (
            [],
            "{marker}",
        ),
    ),
    ("torch.serialization", "load", ("{marker}",)),
    (
        "torch.serialization",
        "save",
        (
            [],
            "{marker}",
        ),
    ),
    (
        "torch.hub",
        "load",
        (
            "owner/repo",
            "model",
        ),
    ),
    (
        "torch.hub",
        "download_url_to_file",
        (
            "file:///dev/null",
            "{marker}",
        ),
    ),
    ("torch", "set_default_dtype", ("{marker}",)),
    ("torch._C", "_set_grad_enabled", (False,)),
    ("torch._utils", "_rebuild_tensor_v2", ("{marker}",)),
    ("torch", "dtype", ("{marker}",)),
    ("pickle", "loads", (b".",)),
    ("copyreg", "_reconstructor", ("{marker}",)),
    ("functools", "partial", ("{marker}",)),
    ("pathlib", "Path", ("{marker}",)),
    ("shutil", "rmtree", ("{marker}",)),
]


def _args(args, marker: Path):
    def fill(a):
        if isinstance(a, str):
            return a.format(marker=str(marker))
        return [fill(x) for x in a] if isinstance(a, list) else a

    return [fill(a) for a in args]


def test_crafted_pickles_would_run_unrestricted(tmp_path):
    """The crafting is sound: a plain unpickler runs what `_crafted` writes."""
    for stack in (False, True):
        marker = tmp_path / f"pwned{stack}"
        pickle.loads(_crafted("torch", "save", [], str(marker), stack=stack))
        assert marker.exists()


@pytest.mark.parametrize("stack", [False, True], ids=["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize("module, name, args", _REFUSED, ids=[f"{m}.{n}" for m, n, *_ in _REFUSED])
def test_the_index_reader_refuses_every_callable_the_format_does_not_need(
    tmp_path, module, name, args, stack
):
    marker = tmp_path / "pwned"
    data = _crafted(module, name, *_args(args, marker), stack=stack)
    with pytest.raises(CheckpointError) as info:
        safe_metadata.load_index(io.BytesIO(data), tmp_path / ".metadata")
    assert _one_line(info) == (
        f"{tmp_path / '.metadata'}: refusing to unpickle '{module}.{name}' (not part of the format)"
    )
    # The readers of the ShardedObjects' bytes and of common.pt: weights-only, whatever
    # the caller asked for (torch DCP asks weights_only=False). Tensors are made of
    # `_rebuild_tensor_v2` there, so that one call is torch's to check.
    if (module, name) != ("torch._utils", "_rebuild_tensor_v2"):
        with safe_metadata.restricted_loading(), pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(data), weights_only=False)
    assert not marker.exists()


def test_the_index_reader_admits_the_formats_own_globals():
    """The edge on the other side: dtypes, sizes, layouts (which the refusals must not
    catch), through the same crafted opcodes."""
    assert safe_metadata.load_index(io.BytesIO(_crafted("torch", "Size", [2, 3])), "i") == (2, 3)
    layout = safe_metadata.load_index(
        io.BytesIO(_crafted("torch.serialization", "_get_layout", "torch.strided")), "i"
    )
    assert layout is torch.strided
    data = b"\x80\x02ctorch\nbfloat16\n."  # a dtype is a global, not a call
    assert safe_metadata.load_index(io.BytesIO(data), "i") is torch.bfloat16


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
