"""No code runs from a checkpoint directory: dist_checkpointing's pickles, read restricted.

A torch_dist checkpoint has three pickled parts:
  * `.metadata`, the index, which torch's `FileSystemReader.read_metadata` reads with a
    plain `pickle.load`: a crafted index could call anything (`os.system`) on every rank;
  * the ShardedObjects (a layer's `_extra_state`, the optimizer's param groups and bucket
    sizes) stored as bytes inside the `.distcp` files, which torch's
    `DefaultLoadPlanner.load_bytes` reads with `torch.load(weights_only=False)`;
  * `common.pt`, which megatron-core reads with `torch.load` at torch's default (weights
    only since torch 2.6, unless `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` is set).
(`metadata.json` is JSON; the tensors themselves are read with `weights_only=True`.)

`read_metadata` unpickles an index admitting only the classes the format is made of
(`_ALLOWED`: torch's checkpoint dataclasses and enums, `torch.Size`, dtypes, layouts); and
`restricted_loading()`, around every load of ours (resume, the tools), makes torch's and
megatron-core's readers use it and turns every `torch.load` into a weights-only one. What
else a pickle asks for is refused with one line naming the file and the global.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_megatron.checkpoint.hf_loader import CheckpointError

INDEX_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"
# What the index of a torch_dist checkpoint is made of (torch 2.x, megatron-core 0.16; the
# two empty `MCore*` classes are what megatron-core itself defines to read older indexes).
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name → torch.strided etc., nothing else
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, as torch's own writer records it
    ("pathlib", "PurePosixPath"),
    *(
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(
        (f"{_DCP}.planner", name)
        for name in (
            "SavePlan",
            "WriteItem",
            "WriteItemType",
            "TensorWriteData",
            "BytesIOWriteData",
        )
    ),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.filesystem", "_StoragePrefix"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
}
# Besides tensors and plain containers, the only type in ShardedObjects: the `_extra_state`
# of Transformer Engine versions that return it as a buffer.
_WEIGHTS_ONLY_EXTRA = [io.BytesIO]


class UnsafePickle(pickle.UnpicklingError):
    """A pickle asked for a global the checkpoint format does not use."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafePickle(f"refusing to unpickle '{module}.{name}' (not part of the format)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("refusing a persistent id (not part of the format)")


def _is_torch_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def load_index(stream: Any, where: str | Path) -> Any:
    """Unpickle a torch_dist index from `stream`, admitting only `_ALLOWED` classes."""
    try:
        return _IndexUnpickler(stream).load()
    except UnsafePickle as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except Exception as exc:  # truncated, garbled: pickle raises many types
        raise CheckpointError(f"{where}: unreadable index ({type(exc).__name__})") from None


def read_metadata(ckpt_dir: str | Path) -> Any:
    """The `Metadata` index of a torch_dist checkpoint directory, read restricted."""
    # Imported here (as below): torch.distributed.checkpoint takes ~0.6 s to import, which
    # the tools' input errors need not wait for.
    from torch.distributed.checkpoint import FileSystemReader

    return _read_metadata(FileSystemReader(str(ckpt_dir)))


def _read_metadata(reader: Any, *args: Any, **kwargs: Any) -> Any:
    """`FileSystemReader.read_metadata` with the restricted unpickler (same result)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader._get_metadata_path(kwargs.get("rank"))
    try:
        with reader.fs.create_stream(path, "rb") as stream:
            metadata = load_index(stream, path)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


@functools.wraps(torch.load)
def _weights_only_load(*args: Any, **kwargs: Any) -> Any:
    kwargs["weights_only"] = True  # overrides torch DCP's explicit weights_only=False
    with torch.serialization.safe_globals(_WEIGHTS_ONLY_EXTRA):
        return _TORCH_LOAD(*args, **kwargs)


_TORCH_LOAD = torch.load


@contextlib.contextmanager
def restricted_loading() -> Iterator[None]:
    """For its duration: every torch_dist index is read restricted, every `torch.load` is
    weights-only. Put around `dist_checkpointing.load` (one thread: the patches are global).
    """
    from torch.distributed.checkpoint import FileSystemReader

    saved_read, saved_load = FileSystemReader.read_metadata, torch.load
    FileSystemReader.read_metadata = _read_metadata
    torch.load = _weights_only_load
    try:
        yield
    finally:
        FileSystemReader.read_metadata, torch.load = saved_read, saved_load


def check_index_files(ckpt_dir: Path, metadata: Any = None) -> None:
    """Every file the index names exists and is long enough for what it indexes there.

    Catches deleted or truncated `.distcp` files before dist_checkpointing's collectives
    start (where a rank would fail alone), with or without checksums.
    """
    metadata = read_metadata(ckpt_dir) if metadata is None else metadata
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, size in sorted(needed.items()):
        file = ckpt_dir / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"{file}: truncated ({file.stat().st_size} of {size} bytes)")


def describe_failure(where: str | Path, exc: BaseException) -> str:
    """One line for torch DCP's `CheckpointException` (a BaseException whose text holds
    every failed rank's traceback): our own refusals raised inside it keep their message;
    anything else is `where: cannot be read (rank r: Type: first line)`."""
    failures = sorted(getattr(exc, "failures", {}).items())
    if not failures:
        return f"{where}: cannot be read ({type(exc).__name__})"
    rank, (error, _) = failures[0]
    if isinstance(error, CheckpointError):
        return str(error)
    lines = str(error).strip().splitlines() or [""]
    return f"{where}: cannot be read (rank {rank}: {type(error).__name__}: {lines[0]})"
