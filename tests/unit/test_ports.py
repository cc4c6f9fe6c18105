"""tests/ports.py: a port handed to a test launch is one nobody else can be handed or hold.

The Slurm tests once failed by chance (issue 36): five concurrent launches each took a port
found free and bound it later, and two collided (`EADDRINUSE`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ports

ROOT = Path(__file__).resolve().parents[2]


def _start_at(monkeypatch, port: int) -> None:
    monkeypatch.setattr(ports, "_start", lambda span: port - ports._LOWEST)


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    got = [ports.reserve_port() for _ in range(20)]
    assert len(set(got)) == 20
    assert all(ports._LOWEST <= p < ports._ephemeral_low() for p in got)
    assert not set(got) & ports._TORCH_DEFAULTS


def test_a_port_someone_holds_is_skipped(monkeypatch):
    held = ports.reserve_port()  # free, and no other test process will take it
    # Forget this process's own reservation: only the bound socket may keep it out.
    ports._HANDED_OUT.discard(held)
    ports.os.close(ports._LOCKS.pop(held))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", held))
        _start_at(monkeypatch, held)
        assert ports.reserve_port() != held


def test_torch_default_ports_are_skipped(monkeypatch):
    _start_at(monkeypatch, 29500)
    assert ports.reserve_port() not in ports._TORCH_DEFAULTS


def test_a_port_another_process_reserved_is_not_handed_out_until_it_exits(monkeypatch):
    """The cross-process case (two `make test` at once): the other process has only found
    its port free, not bound it yet; its lock alone keeps the port from this one."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from tests import ports; print(ports.reserve_port(), flush=True); "
         "sys.stdin.read()"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        theirs = int(holder.stdout.readline())
        _start_at(monkeypatch, theirs)
        assert ports.reserve_port() != theirs
    finally:
        holder.communicate(timeout=30)  # closes its stdin: it exits, the kernel drops its lock
    assert holder.returncode == 0
    assert ports.reserve_port() == theirs  # this process may have it now


@pytest.mark.parametrize("low", [ports._LOWEST, ports._LOWEST - 1])
def test_no_room_below_the_ephemeral_range_is_one_clear_error(monkeypatch, low):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: low)
    with pytest.raises(RuntimeError, match=f"no ports below the ephemeral range .*{low}"):
        ports.reserve_port()


def test_old_reservations_are_given_back_but_never_handed_out_again(monkeypatch):
    monkeypatch.setattr(ports, "_MAX_HELD", 3)
    got = [ports.reserve_port() for _ in range(6)]
    assert len(ports._LOCKS) == 3 and set(ports._LOCKS) == set(got[-3:])
    _start_at(monkeypatch, got[0])
    assert ports.reserve_port() not in got
