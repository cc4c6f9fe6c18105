"""Run a test body on N gloo ranks (the one spawn helper every multi-rank test uses).

    def _body(rank, world_size, tmp_path):          # module-level, so spawn can pickle it
        ...                                           # ordinary asserts; raise on failure

    def test_something(tmp_path):
        run_on_ranks(_body, world_size=4, tmp_path=tmp_path)

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT like under
torchrun, a gloo process group, and the CPU shim for megatron-core. A failure on any rank
fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, kwargs: dict, errors: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # Two cores shared by up to four ranks: more threads only thrash.
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from rl_megatron import cpu_compat

    cpu_compat.enable_if_no_gpu()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, **kwargs)
    except BaseException:
        # A file, not a queue: a long traceback would fill the pipe and block the rank.
        (Path(errors) / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, **kwargs: Any) -> None:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` gloo ranks; re-raise any failure."""
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
