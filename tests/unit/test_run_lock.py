"""The run-directory lock (`utils/run_lock.py`): one holder, named in the refusal, and
released on every way out — including the holder's death, which the kernel handles."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from rl_megatron.utils.run_lock import LOCK_NAME, RunDirLock, run_dir_lock

HOLD = """
import sys, time
from rl_megatron.utils.run_lock import RunDirLock
lock = RunDirLock(sys.argv[1])
assert lock.acquire() is None
print("held", flush=True)
time.sleep(600)
"""


def test_second_lock_is_refused_naming_the_holder(tmp_path):
    first = RunDirLock(tmp_path / "run")
    assert first.acquire() is None and first.held
    refusal = RunDirLock(tmp_path / "run").acquire()
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith(f"trainer.experiment_name: the run directory {tmp_path / 'run'}")
    assert f"pid {os.getpid()} on host {socket.gethostname()}, started {holder['started']}" in (
        refusal
    )
    first.release()
    again = RunDirLock(tmp_path / "run")
    assert again.acquire() is None
    again.release()


def test_released_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError), run_dir_lock(tmp_path) as outcome:
        assert outcome.refusal is None
        assert RunDirLock(tmp_path).acquire() is not None  # held inside the block
        raise RuntimeError("boom")
    with RunDirLock(tmp_path) as lock:
        assert lock.acquire() is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_dead_holder_does_not_block(tmp_path, sig):
    """The holder's details stay in the file, but the kernel dropped its lock."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        refusal = RunDirLock(tmp_path).acquire()
        assert refusal is not None and f"pid {holder.pid} " in refusal
    finally:
        holder.send_signal(sig)
        holder.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid  # stale file
    lock = RunDirLock(tmp_path)
    assert lock.acquire() is None
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_filesystem_without_locks_warns_and_runs(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="rl_megatron"):
        assert RunDirLock(tmp_path).acquire() is None
    assert "running without the run-directory lock" in caplog.text


def test_the_holder_writing_its_details_is_named_vaguely(tmp_path):
    """Between the holder's flock and its write the file is empty: still one line."""
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        refusal = RunDirLock(tmp_path).acquire()
    finally:
        os.close(fd)
    assert refusal is not None and "another process" in refusal and "\n" not in refusal
    with RunDirLock(tmp_path) as lock:
        assert lock.acquire() is None
