"""Run a test body on N ranks (the one spawn helper every multi-rank test uses).

    def _body(rank, world_size, tmp_path):          # module-level, so spawn can pickle it
        ...                                           # ordinary asserts; raise on failure

    def test_something(tmp_path):
        run_on_ranks(_body, world_size=4, tmp_path=tmp_path)

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT like under
torchrun. A failure on any rank fails the test with that rank's traceback.

The device comes from the environment variable RL_MEGATRON_TEST_DEVICE:

* ``cpu`` (default): a gloo process group, the CPU shim for megatron-core
  (`rl_megatron.cpu_compat`), one thread per rank (two cores shared by up to four ranks).
* ``cuda``: rank r uses GPU r and an NCCL process group; no shim, torch's own threading,
  and fp32 matmuls kept in true fp32 (no TF32), so fp32 tolerances mean fp32. NCCL cannot
  put two ranks on one GPU: `run_on_ranks` skips a test that asks for more ranks than
  there are GPUs (`max_ranks()`); tests that adapt their size use `min(4, max_ranks())`.

Tests read the mode through `ON_GPU`, `test_device()` and `max_ranks()`.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import reserve_port

DEVICE_ENV = "RL_MEGATRON_TEST_DEVICE"
_MODE = os.environ.get(DEVICE_ENV, "cpu")
if _MODE not in ("cpu", "cuda"):
    raise ValueError(f"{DEVICE_ENV}={_MODE!r}: use 'cpu' or 'cuda'")
ON_GPU = _MODE == "cuda"
# The largest world the CPU tests use; more ranks on the 2-core CI machine only thrash.
CPU_MAX_RANKS = 4


def max_ranks() -> int:
    """How many ranks a test may spawn: the GPU count in cuda mode, else CPU_MAX_RANKS."""
    if not ON_GPU:
        return CPU_MAX_RANKS
    if not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda but torch sees no GPU")
    return torch.cuda.device_count()


def require_ranks(world_size: int) -> None:
    """Skip the calling test when `world_size` ranks do not fit (one GPU per rank)."""
    import pytest

    if world_size > max_ranks():
        pytest.skip(f"needs {world_size} ranks; {_MODE} mode allows {max_ranks()}")


def test_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK in cuda mode, else the CPU."""
    if ON_GPU:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# Not a test, whatever its name says.
test_device.__test__ = False  # type: ignore[attr-defined]


def _free_port() -> int:
    # Below the ephemeral range, once per process: tests/ports.py says why.
    return reserve_port()


def _setup_device(rank: int) -> str:
    """Prepare this rank's device; return the process-group backend."""
    if ON_GPU:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return "nccl"
    torch.set_num_threads(1)
    from rl_megatron import cpu_compat

    cpu_compat.enable_if_no_gpu()
    return "gloo"


def _worker(rank: int, world_size: int, port: int, fn: Callable, kwargs: dict, errors: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if not ON_GPU:
        # Two cores shared by up to four ranks: more threads only thrash.
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        backend = _setup_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, **kwargs)
    except BaseException:
        # A file, not a queue: a long traceback would fill the pipe and block the rank.
        (Path(errors) / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        from rl_megatron.distributed import teardown

        teardown()  # what a run does: engines first, then Megatron's groups and the world


def run_on_ranks(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> None:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` ranks; re-raise any failure.

    Skips the test (pytest.skip) when `world_size` exceeds `max_ranks()`.
    """
    require_ranks(world_size)
    port = _free_port()
    with tempfile.TemporaryDirectory() as errors:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, port, fn, kwargs, errors),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as exc:
            reports = [
                f"--- {path.stem} ---\n{path.read_text()}"
                for path in sorted(Path(errors).iterdir())
            ]
            raise AssertionError("\n".join(reports) or str(exc)) from None
