"""The Python tool: run a model's code in a process of its own, inside limits.

Each call starts `sys.executable -I -u` (isolated: no user site, no PYTHON* variables) in a
new session, in a fresh temporary directory that is removed afterwards. Before the code
runs, a small bootstrap in the child applies the limits the code cannot lift:

* CPU time: RLIMIT_CPU (SIGXCPU at the limit, SIGKILL a second later).
* Memory: RLIMIT_AS (an allocation past it raises MemoryError).
* Files: RLIMIT_FSIZE (a write past it fails with EFBIG).
* Processes: RLIMIT_NPROC for an ordinary user. The kernel ignores it for root (uid 0), so
  as root the child also joins a fresh `pids` cgroup with `pids.max` where the cgroup
  filesystem is writable. As root without one, an audit hook refuses every new process
  (fork, spawn, exec, subprocess; advisory: ctypes gets around it). Which one bounds the
  call is `PythonResult.process_limit` ("rlimit", "cgroup" or "audit_hook").
* Network: the child unshares a new network namespace (root) or a new user + network
  namespace (others), where no interface is up, so connect/bind fail at the kernel. Where
  the kernel refuses that, an audit hook installed before the code refuses socket
  connect/bind/sendto/name lookups and starting programs (which would run without the hook);
  that is advisory (ctypes gets around it). Which one is active is `PythonResult.network`
  ("netns" or "audit_hook").

The parent reads stdout and stderr together up to `output_bytes`, then kills (the cut is
reported); at `wall_s` it kills; at the end it always kills the child's whole process
group and, with a cgroup, every process left in it, so nothing the code started outlives
the call. `run_python` never raises for anything the code does.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

__all__ = ["PythonLimits", "PythonResult", "run_python"]


@dataclass(frozen=True)
class PythonLimits:
    cpu_s: int = 5  # CPU seconds of the code's process (each process it forks has its own)
    wall_s: float = 10.0  # wall clock for the whole call, then everything is killed
    memory_bytes: int = 1 << 30  # address space per process (RLIMIT_AS)
    output_bytes: int = 16 << 10  # stdout + stderr read back, then the process is killed
    file_bytes: int = 16 << 20  # largest file the code may write (RLIMIT_FSIZE)
    processes: int = 32  # processes and threads the code may run at once


@dataclass
class PythonResult:
    stdout: str
    stderr: str
    exit_status: int | None  # the process's return code (negative: killed by that signal)
    timed_out: bool  # ended at the CPU or wall-clock limit
    killed_for: str | None  # "cpu", "memory", "output", "wall", or None
    output_truncated: bool  # stdout + stderr were cut at `output_bytes`
    network: str  # "netns" or "audit_hook" (module docstring)
    process_limit: str  # "rlimit", "cgroup" or "audit_hook" (module docstring)


# Runs in the child before the code: argv = snippet path, status fd, config JSON. It reports
# which isolation took effect, and a MemoryError that ended the code, on the status pipe.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys, traceback
snippet, status_fd, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
os.set_inheritable(status_fd, False)
status = os.fdopen(status_fd, "w", buffering=1)
procs = "rlimit" if os.geteuid() != 0 else "none"
if cfg["cgroup"]:
    try:
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        procs = "cgroup"
    except OSError:
        pass
if procs == "none":
    # Root without a pids cgroup: nothing in the kernel bounds the processes, so no new
    # process at all (advisory, as the network hook below: ctypes gets around it).
    SPAWN = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec",
             "subprocess.Popen"}
    def no_spawn(event, args):
        if event in SPAWN:
            raise BlockingIOError(f"no new processes in this sandbox ({event} refused)")
    sys.addaudithook(no_spawn)
    procs = "audit_hook"
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
if ctypes.CDLL(None, use_errno=True).unshare(flags) == 0:
    net = "netns"
else:
    net = "audit_hook"
    BLOCKED = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
               "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
               "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system"}
    def refuse(event, args):
        if event in BLOCKED:
            raise PermissionError(f"no network in this sandbox ({event} refused)")
    sys.addaudithook(refuse)
nproc = cfg["processes"]
if os.geteuid() != 0 and net != "netns":
    # Outside a fresh user namespace RLIMIT_NPROC counts every task of this user.
    uid = str(os.getuid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields["Uid"].split()[0] == uid:
                nproc += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            pass
for name, soft, hard in (("RLIMIT_CPU", cfg["cpu_s"], cfg["cpu_s"] + 1),
                         ("RLIMIT_AS", cfg["memory_bytes"], cfg["memory_bytes"]),
                         ("RLIMIT_FSIZE", cfg["file_bytes"], cfg["file_bytes"]),
                         ("RLIMIT_NPROC", nproc, nproc), ("RLIMIT_CORE", 0, 0)):
    resource.setrlimit(getattr(resource, name), (soft, hard))
status.write(f"net={net}\nprocs={procs}\n")
sys.argv = [snippet]
sys.path[0] = os.getcwd()
try:
    with open(snippet) as f:
        code = compile(f.read(), os.path.basename(snippet), "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except MemoryError as e:
    status.write("memory\n")
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    os._exit(1)
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


def run_python(code: str, limits: PythonLimits = PythonLimits()) -> PythonResult:
    """Run `code` as a script in a sandboxed child process (module docstring); its result."""
    with tempfile.TemporaryDirectory(prefix="rlm-python-") as cwd:
        snippet = os.path.join(cwd, "snippet.py")
        with open(snippet, "w") as f:
            f.write(code)
        cgroup = _pids_cgroup(limits.processes) if os.geteuid() == 0 else None
        config = {
            "cgroup": cgroup,
            "cpu_s": int(limits.cpu_s),
            "memory_bytes": int(limits.memory_bytes),
            "file_bytes": int(limits.file_bytes),
            "processes": int(limits.processes),
        }
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-u",
                    "-c",
                    _BOOTSTRAP,
                    snippet,
                    str(status_w),
                    json.dumps(config),
                ],
                cwd=cwd,
                env=_child_env(cwd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,  # its own process group, killed whole at the end
            )
        finally:
            os.close(status_w)
        try:
            return _collect(proc, status_r, limits)
        finally:
            _kill_all(proc, cgroup)
            os.close(status_r)
            proc.stdout.close()
            proc.stderr.close()


def _child_env(cwd: str) -> dict[str, str]:
    # Nothing of the trainer's environment (tokens, paths) reaches the code; one thread per
    # BLAS library, or importing numpy reserves more address space than RLIMIT_AS allows.
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": cwd,
        "TMPDIR": cwd,
        "LANG": "C.UTF-8",
    }
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


def _collect(proc: subprocess.Popen, status_r: int, limits: PythonLimits) -> PythonResult:
    """Read the child's output until it ends, a limit is reached or the wall clock runs out."""
    out = {
        proc.stdout.fileno(): bytearray(),
        proc.stderr.fileno(): bytearray(),
        status_r: bytearray(),
    }
    selector = selectors.DefaultSelector()
    for fd in out:
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.wall_s
    killed_for, truncated, exit_status = None, False, None
    try:
        while selector.get_map():
            now = time.monotonic()
            if exit_status is None and (exit_status := proc.poll()) is not None:
                # Processes the code left behind may hold the pipes open; read what they
                # write for a moment, then the cleanup kills them.
                deadline = min(deadline, now + 0.2)
            if now >= deadline:
                if exit_status is None:
                    killed_for = "wall"
                break
            for key, _ in selector.select(min(deadline - now, 0.05)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                if key.fd == status_r:
                    out[status_r] += chunk
                    continue
                room = (
                    limits.output_bytes
                    - len(out[proc.stdout.fileno()])
                    - len(out[proc.stderr.fileno()])
                )
                out[key.fd] += chunk[:room]
                if len(chunk) > room:
                    truncated = True
            if truncated:
                if proc.poll() is None:
                    killed_for = "output"
                break
    finally:
        selector.close()
    _kill_group(proc.pid)
    exit_status = proc.wait()
    status = out[status_r].decode(errors="replace").split()
    if killed_for is None:
        if "memory" in status:
            killed_for = "memory"
        elif exit_status in (-signal.SIGXCPU, -signal.SIGKILL):
            killed_for = "cpu"  # SIGXCPU at the soft limit, SIGKILL at the hard one
    fields = dict(item.split("=", 1) for item in status if "=" in item)
    return PythonResult(
        stdout=out[proc.stdout.fileno()].decode(errors="replace"),
        stderr=out[proc.stderr.fileno()].decode(errors="replace"),
        exit_status=exit_status,
        timed_out=killed_for in ("cpu", "wall"),
        killed_for=killed_for,
        output_truncated=truncated,
        network=fields.get("net", "audit_hook"),
        process_limit=fields.get("procs", "none"),
    )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_all(proc: subprocess.Popen, cgroup: str | None) -> None:
    """Kill everything the call started: the process group, then whatever is in the cgroup
    (a process that left the group with setsid is still there)."""
    _kill_group(proc.pid)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if cgroup is None:
        return
    for _ in range(200):  # kills are asynchronous; the cgroup empties within milliseconds
        try:
            with open(os.path.join(cgroup, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.rmdir(cgroup)
            return
        except OSError:
            time.sleep(0.01)


def _pids_cgroup(processes: int) -> str | None:
    """A fresh `pids` cgroup under this process's own, holding at most `processes` tasks;
    None where cgroups cannot be written (then the call has no process bound as root)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    bases = []
    for _, controllers, path in lines:
        if "pids" in controllers.split(","):  # cgroup v1: its own hierarchy
            bases.append(f"/sys/fs/cgroup/pids{path}")
        elif controllers == "":  # cgroup v2: needs pids in the parent's subtree_control
            bases += [f"/sys/fs/cgroup{path}", f"/sys/fs/cgroup/unified{path}"]
    for base in bases:
        base = base.rstrip("/")
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue
        if os.path.exists(os.path.join(base, "cgroup.subtree_control")):
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    if "pids" not in f.read().split():
                        continue
            except OSError:
                continue
        path = os.path.join(base, f"rlm-python-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(processes))
            return path
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
    return None
