"""Ports for test launches that no concurrent launch can take.

A port found free by binding port 0 comes from the kernel's ephemeral range, the range it
also hands out for every outgoing connection: between the test picking it and the launched
ranks binding it, another run's gloo or store connection can take it (`EADDRINUSE`; seen
when the Slurm tests start five launches at once). The ports here lie below that range, so
no connection is ever given one, and each is handed out once per test process.

Two test processes on one machine (two `make test` at once) could still both find a port
free and bind it later. So a port is handed out only to the process holding its lock, an
exclusive `flock` on `<tmp>/rl_megatron_test_ports/<port>.lock`, kept until that process
exits (the kernel drops it then, however the process ends: no stale reservation) or has
reserved `_MAX_HELD` newer ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from pathlib import Path

_LOWEST = 20000
# torch's default ports (c10d rendezvous, MASTER_PORT): a launch told no port binds them.
_TORCH_DEFAULTS = {29400, 29500}
_HANDED_OUT: set[int] = set()
_LOCKS: dict[int, int] = {}  # port → the open lock file's descriptor, oldest first
# Reservations held at once: the oldest is given back beyond this (its launch ended long
# ago: a test's launches run at once, tests one after another), so a whole `make test`
# stays far below a 1024-descriptor limit. The port is still never handed out again here.
_MAX_HELD = 128
LOCK_DIR = Path(tempfile.gettempdir()) / "rl_megatron_test_ports"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _lock(port: int) -> bool:
    """Take the machine-wide reservation of `port` for this process; False: another has it."""
    LOCK_DIR.mkdir(exist_ok=True)
    with contextlib.suppress(OSError):  # another user's folder: theirs to keep open
        LOCK_DIR.chmod(0o1777)
    try:
        fd = os.open(LOCK_DIR / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's lock file
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _LOCKS[port] = fd
    return True


def _start(span: int) -> int:
    """Where this process begins its search, as an offset from the lowest port."""
    return (os.getpid() * 7919) % span


def reserve_port() -> int:
    """A free port below the ephemeral range, never the same twice on this machine while
    this process lives.

    The start depends on the process id, so two test processes on one machine (two
    `make test` at once) begin far apart.
    """
    high = _ephemeral_low()
    span = high - _LOWEST
    if span <= 0:
        raise RuntimeError(f"no ports below the ephemeral range (which starts at {high})")
    start = _start(span)
    for offset in range(span):
        port = _LOWEST + (start + offset) % span
        if port in _HANDED_OUT or port in _TORCH_DEFAULTS or not _lock(port):
            continue
        if _is_free(port):  # checked under the lock: another process's run may hold it
            _HANDED_OUT.add(port)
            while len(_LOCKS) > _MAX_HELD:
                os.close(_LOCKS.pop(next(iter(_LOCKS))))
            return port
        os.close(_LOCKS.pop(port))
    raise RuntimeError("no free port below the ephemeral range")
