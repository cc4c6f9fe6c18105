"""What the two conversion tools share: process-group setup, dtype names, error reporting.

A Megatron checkpoint written by `hf_to_megatron.py` is a `dist_checkpointing` directory
(loadable at any TP / PP, by these tools or the trainer) plus two things of ours:

    <dir>/hf/               config.json, generation_config.json and tokenizer files of the
                            source HF model, so the export can rebuild a complete HF dir
    <dir>/rl_megatron.json  {"format_version", "head", "dtype", "padded_vocab_size", "tp",
                            "pp", "vpp", "source"}: what the Megatron model looked like
    <dir>/manifest.json     size and CRC-32 of every other file (rl_megatron/checkpoint/
                            integrity.py), checked by megatron_to_hf.py unless --no-verify
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from rl_megatron.utils.warning_filters import install as install_warning_filters

# Before the imports below, which import megatron-core: its notices about our set-up (no
# apex, no Transformer Engine) would surround a tool's one-line error.
install_warning_filters()

from rl_megatron.checkpoint.hf_loader import CheckpointError  # noqa: E402
from rl_megatron.checkpoint.hf_mapping import MappingError  # noqa: E402
from rl_megatron.models.hf_config import HFConfigError  # noqa: E402
from rl_megatron.utils.disk_space import DiskFullError  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
META_FILE = "rl_megatron.json"
HF_SUBDIR = "hf"
FORMAT_VERSION = 1
USER_ERRORS = (HFConfigError, CheckpointError, MappingError, DiskFullError)


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) for a plain `python` run."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed() -> None:
    """Start the process group (gloo on CPU, NCCL on GPU) and the CPU shim when needed."""
    import torch.distributed as dist

    from rl_megatron import cpu_compat

    if "MASTER_ADDR" not in os.environ:  # plain `python tool.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    on_cpu = cpu_compat.enable_if_no_gpu()
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, size = world()
    dist.init_process_group("gloo" if on_cpu else "nccl", rank=rank, world_size=size)


# The fields of rl_megatron.json that megatron_to_hf.py reads, with their types (the others,
# tp / pp / vpp / source, only record where the checkpoint came from).
META_FIELDS = {"format_version": int, "head": str, "dtype": str, "padded_vocab_size": int}
HEADS = ("lm", "value")


def meta_path(ckpt_dir: Path) -> Path:
    """The checkpoint's rl_megatron.json; its absence means it is no checkpoint of ours."""
    path = ckpt_dir / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (not a checkpoint written by hf_to_megatron.py)")
    return path


def read_meta(ckpt_dir: Path) -> dict:
    """The checkpoint's rl_megatron.json, checked field by field (one-line CheckpointError)."""
    path = meta_path(ckpt_dir)
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    for key, kind in META_FIELDS.items():
        if key not in meta:
            raise CheckpointError(f"{path}: no '{key}' field")
        value = meta[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{path}: '{key}' is {value!r}, expected {kind.__name__}")
    if meta["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version={meta['format_version']} is not {FORMAT_VERSION}"
        )
    if meta["head"] not in HEADS:
        raise CheckpointError(f"{path}: 'head' is {meta['head']!r}, not one of {list(HEADS)}")
    names = sorted(str(dtype).split(".")[-1] for dtype in DTYPES.values())
    if meta["dtype"] not in names:
        raise CheckpointError(f"{path}: 'dtype' is {meta['dtype']!r}, not one of {names}")
    if meta["padded_vocab_size"] <= 0:
        raise CheckpointError(f"{path}: 'padded_vocab_size' is {meta['padded_vocab_size']}")
    return meta


def check_out_parent(out: Path) -> None:
    """`out` can be created: its nearest existing ancestor is a writable directory (else
    the partial directory's mkdir would fail with a traceback, after the inputs were read)."""
    parent = out.absolute().parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(f"--out: {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"--out: {out}: {parent} is not writable")


def raise_if_any(problem: str | None) -> None:
    """Collective: raise a CheckpointError on every rank if any rank has a problem."""
    import torch.distributed as dist

    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if problem:
        raise CheckpointError(problem)
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(f"another rank failed: {first}")


def run_cli(
    prog: str,
    preflight: Callable[[], object],
    convert: Callable[[object], None],
    cleanup: Callable[[], None],
) -> int:
    """Run `convert(preflight())`; a user error prints one line to stderr and returns 2.

    `preflight` checks the inputs without touching the output or other ranks: its errors
    are the same on every rank, so rank 0 alone reports them. An error in `convert` is
    reported by the rank that hit it, with its rank. `cleanup` removes partial output,
    after any failure of `convert`. Internal errors keep their traceback.
    """
    rank, size = world()
    try:
        plan = preflight()
    except USER_ERRORS as exc:
        if rank == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        convert(plan)
    except USER_ERRORS as exc:
        where = f" (rank {rank} of {size})" if size > 1 else ""
        print(f"{prog}: error{where}: {exc}", file=sys.stderr)
        if rank == 0:
            cleanup()
        return 2
    except BaseException:  # an internal error (its traceback follows) or ^C: no half output
        if rank == 0:
            cleanup()
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            from rl_megatron.distributed import teardown

            teardown()  # megatron-core's groups, then the default one
    return 0
