"""Ports for test launches that no concurrent launch can take.

A port found free by binding port 0 comes from the kernel's ephemeral range, the range it
also hands out for every outgoing connection: between the test picking it and the launched
ranks binding it, another run's gloo or store connection can take it (`EADDRINUSE`; seen
when the Slurm tests start five launches at once). The ports here lie below that range, so
no connection is ever given one, and each is handed out once per test process.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_LOWEST = 20000
_HANDED_OUT: set[int] = set()


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


def reserve_port() -> int:
    """A free port below the ephemeral range, never the same twice in this process.

    The start depends on the process id, so two test processes on one machine (two
    `make test` at once) begin far apart.
    """
    high = _ephemeral_low()
    span = high - _LOWEST
    if span <= 0:
        raise RuntimeError(f"no ports below the ephemeral range (which starts at {high})")
    start = (os.getpid() * 7919) % span
    for offset in range(span):
        port = _LOWEST + (start + offset) % span
        if port not in _HANDED_OUT and _is_free(port):
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port below the ephemeral range")
