"""Process groups from torchrun or Slurm, Megatron initialisation, seeding and teardown.

    env = launch_env()                         # torchrun variables, else Slurm's
    with distributed_run(ParallelLayout.from_config(config.parallel, env.world_size),
                         seed=config.trainer.seed) as run:
        ...                  # run.layout, run.groups, run.coordinates, run.stop_requested

`distributed_run` makes failures clean: a failing rank prints its error once, with its
(tp, pp, dp, cp) coordinates, and the process group is torn down on normal exit, on an
exception and on SIGTERM (which only sets `stop_requested`, so the trainer can checkpoint).
`exit_with_launcher()` makes a torchrun rank die with its launcher (no orphan ranks).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelGroups, ParallelLayout
from rl_megatron.placement import SplitWorld


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `gpu[003-005,9],cpu1`."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        )
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    head = nodelist.split(",")[0]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Rank/world from torchrun's variables, falling back to Slurm's (srun without torchrun)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    if "SLURM_PROCID" in env:
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env["SLURM_JOB_NODELIST"]),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    return LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_launcher(environ: dict[str, str] | None = None) -> bool:
    """Have the kernel SIGKILL this rank when its torchrun agent dies; True when armed.

    torchrun starts every rank in a session of its own, so when the agent itself is
    SIGKILLed (by a user, the OOM killer, a dying job step) nothing stops the ranks: they
    would train on as orphans, writing checkpoints nobody asked for. Decisions:

    * `prctl(PR_SET_PDEATHSIG)` rather than a thread polling `os.getppid()`: the kernel
      delivers it at once, even while the interpreter is stuck in a C call (a collective)
      that never lets a Python thread run. The signal fires when the thread that forked
      the rank exits; torchrun's agent starts its workers from its main thread, whose exit
      is the agent's exit.
    * SIGKILL, not SIGTERM: with the agent gone, so is the rendezvous store it hosts and
      its teardown of the other ranks; a graceful "finish the step and save" would need
      every rank's collectives and could hang until `parallel.timeout_s`. The run resumes
      from its last checkpoint, and the run-directory lock goes with the process.
    * Armed only under torchrun (`TORCHELASTIC_RUN_ID` set): a rank started by srun or
      from a shell (`nohup python launch/ppo.py &`) must outlive that parent.
    * Linux only (prctl); elsewhere nothing is armed. Called first thing in
      `launch/ppo.py`; a launcher that dies in the rank's first seconds, before the call,
      is not caught (checking `os.getppid() == 1` instead would kill every rank of a
      container whose PID 1 is torchrun itself).
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        warnings.warn(
            f"prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}); a rank may outlive its launcher",
            stacklevel=2,
        )
        return False
    return True


@dataclass
class DistributedRun:
    env: LaunchEnv
    layout: ParallelLayout
    coordinates: dict[str, int]  # this rank's, from the layout
    device: torch.device
    groups: ParallelGroups | None = None  # megatron-core's, once initialised
    # split placement (`placement.py`): the launch beyond this side's ranks; None: one side
    split: SplitWorld | None = None
    stop_requested: bool = False  # set by SIGTERM; the trainer checkpoints and exits
    _previous_handlers: dict = field(default_factory=dict, repr=False)

    def describe_rank(self) -> str:
        c = self.coordinates
        return f"rank {self.env.rank} (tp={c['tp']}, pp={c['pp']}, dp={c['dp']}, cp={c['cp']})"


def rank_device(env: LaunchEnv) -> tuple[str, torch.device]:
    """This rank's backend and device: NCCL on its GPU, else gloo on the CPU (with the
    shim megatron-core needs there, `cpu_compat`)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return "nccl", torch.device("cuda", torch.cuda.current_device())
    from rl_megatron import cpu_compat

    cpu_compat.enable()
    return "gloo", torch.device("cpu")


def init_process_group(
    env: LaunchEnv, timeout_s: int, rendezvous_timeout_s: float = 600
) -> torch.device:
    """NCCL on GPUs, gloo (with the CPU shim for megatron-core) without; returns the device.

    Without torchrun (srun, a shell per rank) the ranks meet through `rendezvous_store`, which
    gives up after `rendezvous_timeout_s` with a `RendezvousError`; under torchrun its agents
    have met already and the ranks use the agent's store.
    """
    backend, device = rank_device(env)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        store = None
        if env.world_size == 1:
            # Nobody to meet: an in-memory store. `env://` would bind MASTER_PORT (29500
            # unless given), and a second one-rank run on the machine would fail on it.
            store = dist.HashStore()
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            store = rendezvous_store(env, rendezvous_timeout_s)
            store.set_timeout(datetime.timedelta(seconds=timeout_s))  # from here on: collectives'
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return device


class RendezvousError(RuntimeError):
    """The ranks did not meet at MASTER_ADDR:MASTER_PORT in time; the message is one line."""


def rendezvous_store(env: LaunchEnv, timeout_s: float) -> dist.TCPStore:
    """The launch's TCPStore at `env.master_addr:master_port`, hosted by rank 0 (collective).

    Rank 0 waits for every other rank to connect; the others wait for rank 0's store to
    accept connections, probing with plain sockets (torch's own client would print a C++
    warning with a stack trace for every refused attempt). Either way, after `timeout_s`
    seconds a `RendezvousError` names the address, this rank and its host.
    """
    where = f"{env.master_addr}:{env.master_port}"
    me = f"rank {env.rank} of {env.world_size} on {socket.gethostname()}"
    deadline = time.monotonic() + timeout_s
    if env.rank != 0:
        while not _accepts_connections(env.master_addr, env.master_port):
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"rendezvous: nothing answered at {where} within {timeout_s:g} s ({me}); "
                    "is rank 0 running on that host, and is the port open between the nodes?"
                )
            time.sleep(0.5)
    remaining = max(1.0, deadline - time.monotonic())
    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=datetime.timedelta(seconds=remaining),
            wait_for_workers=True,
        )
    except (dist.DistError, RuntimeError) as exc:  # DistStoreError, DistNetworkError
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise RendezvousError(
            f"rendezvous at {where} failed within {timeout_s:g} s ({me}): {reason}"
        ) from None


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def init_megatron(layout: ParallelLayout, timeout_s: int) -> None:
    """Megatron's parallel_state with our rank order (each DP replica = consecutive ranks).

    Every subgroup gets `timeout_s` seconds, as the world group does.
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        # megatron-core makes this timedelta(minutes=...): a fraction keeps the seconds exact.
        distributed_timeout_minutes=timeout_s / 60,
        order=MEGATRON_RANK_ORDER,
    )
    # megatron-core 0.16.1 creates the expert-DP gloo group without a timeout (torch's
    # 30-minute default); set it on every group it made, as its own update_pg_timeout does.
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in parallel_state._global_process_group_list or []:
        if group is not None:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def seed_everything(seed: int, layout: ParallelLayout, rank: int, deterministic: bool) -> None:
    """Megatron-LM's seeding: stage-dependent base seed, model-parallel RNG tracker.

    Pipeline stages get different seeds (different layers); data-parallel replicas share
    them so replicas initialise identically. Dropout inside TP regions uses the tracker.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    pp_rank = layout.coordinates(rank)["pp"]
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    try:
        import numpy as np

        np.random.seed(stage_seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def gather_rank_table(run: DistributedRun) -> list[dict] | None:
    """Every rank's (node, coordinates), on rank 0 (None elsewhere)."""
    row = {"rank": run.env.rank, "node": socket.gethostname(), **run.coordinates}
    rows: list = [None] * run.env.world_size if run.env.rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    return rows


@contextlib.contextmanager
def distributed_run(
    layout: ParallelLayout | None = None,
    *,
    seed: int = 1234,
    timeout_s: int = 1800,
    deterministic: bool = False,
    rendezvous_timeout_s: float = 600,
) -> Iterator[DistributedRun]:
    """Initialise torch.distributed + Megatron at `layout`; tear down on every way out.

    layout: from `ParallelLayout.from_config`; None = data parallelism over every rank.
    rendezvous_timeout_s: how long ranks started without torchrun wait for each other.
    """
    env = launch_env()
    device = init_process_group(env, timeout_s, rendezvous_timeout_s)
    if layout is None:
        layout = ParallelLayout(tp=1, pp=1, dp=env.world_size)
    if layout.world_size != env.world_size:
        raise RuntimeError(f"layout {layout.describe()} is not for {env.world_size} ranks")
    run = DistributedRun(
        env=env, layout=layout, coordinates=layout.coordinates(env.rank), device=device
    )
    init_megatron(layout, timeout_s)
    run.groups = ParallelGroups.from_megatron(layout)  # checks megatron-core's coordinates
    seed_everything(seed, layout, env.rank, deterministic)

    def on_sigterm(signum, frame):
        run.stop_requested = True

    run._previous_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield run
    except SystemExit:
        raise
    except BaseException:
        # Print once, by the failing rank, with where it sits in the layout; then let
        # torchrun's elastic agent take the other ranks down (they may be in a collective).
        sys.stderr.write(f"[{run.describe_rank()}] failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise
    finally:
        for signum, handler in run._previous_handlers.items():
            signal.signal(signum, handler)
        teardown()


# What still holds process groups at teardown, run before they go, last registered first:
# vLLM's in-process engine (rollout/vllm/engine.py) shuts its engine core down there,
# which destroys its own groups; left to interpreter exit, its shutdown would find them
# gone and print a traceback per rank.
_BEFORE_TEARDOWN: list[Callable[[], None]] = []


def before_teardown(fn: Callable[[], None]) -> None:
    """Have `teardown` call `fn` (once) while every process group still exists."""
    _BEFORE_TEARDOWN.append(fn)


def teardown() -> None:
    """Shut down what uses the process groups, then destroy Megatron's groups and the
    default process group (idempotent)."""
    try:
        while _BEFORE_TEARDOWN:
            _BEFORE_TEARDOWN.pop()()
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
