"""The Python tool's limits hold: each call ends within a few seconds, nothing it started
outlives it, and what went wrong is in the result."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest

from rl_megatron.environments import python_tool
from rl_megatron.environments.python_tool import PythonLimits, run_python

LIMITS = PythonLimits(cpu_s=1, wall_s=2.0, memory_bytes=512 << 20, output_bytes=4096, processes=16)


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _session_members(sid: int) -> list[int]:
    """Live processes whose session is `sid` (field 6 of /proc/<pid>/stat)."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(name))
    return out


def _timed(code: str, limits: PythonLimits = LIMITS):
    start = time.monotonic()
    result = run_python(code, limits)
    return result, time.monotonic() - start


def test_plain_script_runs_in_a_fresh_directory_removed_afterwards():
    result, _ = _timed("import os\nprint(os.getcwd())\nprint(6 * 7)\nopen('f.txt', 'w').write('x')")
    cwd, answer = result.stdout.split()
    assert answer == "42" and result.exit_status == 0 and result.killed_for is None
    assert cwd != os.getcwd() and not os.path.exists(cwd)


def test_fork_bomb_fails_and_leaves_no_process():
    result, seconds = _timed(
        "import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()"
    )
    pid = int(result.stdout.split()[0])
    assert result.process_limit in ("rlimit", "cgroup", "audit_hook"), result
    assert "BlockingIOError" in result.stderr  # fork refused at the process limit
    assert seconds < 5
    assert not _alive(pid) and _session_members(pid) == []


def test_root_without_a_cgroup_starts_no_process(monkeypatch):
    """RLIMIT_NPROC does not bind uid 0: without a pids cgroup, no process is started at
    all (else a fork bomb would load the whole machine until the wall clock)."""
    if os.geteuid() != 0:
        pytest.skip("the rlimit binds a user that is not root")
    monkeypatch.setattr(python_tool, "_pids_cgroup", lambda processes: None)
    result, seconds = _timed(
        "import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()"
    )
    assert result.process_limit == "audit_hook", result
    assert "BlockingIOError: no new processes in this sandbox (os.fork refused)" in result.stderr
    assert seconds < 5 and not _alive(int(result.stdout.split()[0]))
    sub = run_python("import subprocess\nsubprocess.run(['true'])", LIMITS)
    assert "subprocess.Popen refused" in sub.stderr and sub.exit_status == 1


def test_a_process_that_left_the_session_is_killed_too():
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n"
        "    time.sleep(60)\nelse:\n    time.sleep(0.5)"
    )
    result, _ = _timed(code)
    if result.process_limit != "cgroup":
        pytest.skip("without a cgroup a process that calls setsid leaves the process group")
    assert not _alive(int(result.stdout.split()[0]))


def test_infinite_loop_ends_at_the_cpu_limit():
    # A wall clock far past the CPU limit: on a loaded machine (two cores shared by the
    # suite's other processes) the loop got less than 1 s of CPU in 2 s of wall time.
    limits = dataclasses.replace(LIMITS, wall_s=20.0)
    result, seconds = _timed("while True:\n    pass", limits)
    assert result.killed_for == "cpu" and result.timed_out
    assert seconds < limits.wall_s


def test_sleeping_code_ends_at_the_wall_clock():
    result, seconds = _timed("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert result.killed_for == "wall" and result.timed_out and result.stdout == "started\n"
    assert LIMITS.wall_s <= seconds < LIMITS.wall_s + 2


def test_huge_print_is_cut_at_the_cap_and_killed():
    result, seconds = _timed("print('x' * 100_000_000)\nimport time\ntime.sleep(60)")
    assert result.output_truncated and result.killed_for == "output"
    assert result.stdout == "x" * LIMITS.output_bytes
    assert result.exit_status < 0  # killed, not finished
    assert seconds < 4


def test_large_allocation_fails_under_the_memory_limit():
    result, seconds = _timed("b = bytearray(2 * 1024**3)\nprint('allocated')")
    assert result.killed_for == "memory" and "MemoryError" in result.stderr
    assert "allocated" not in result.stdout and seconds < 4


def test_file_size_limit():
    limits = PythonLimits(cpu_s=1, wall_s=2.0, file_bytes=1 << 16)
    result, _ = _timed("open('big', 'wb').write(b'x' * (1 << 20))", limits)
    assert result.exit_status == 1 and "File too large" in result.stderr


def test_network_connect_fails():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result, seconds = _timed(code)
    assert result.network in ("netns", "audit_hook")
    assert "connected" not in result.stdout and result.exit_status == 1
    assert (
        ("unreachable" in result.stderr)
        if result.network == "netns"
        else ("refused" in result.stderr)
    )
    assert seconds < 4


def test_environment_of_the_trainer_does_not_reach_the_code(monkeypatch):
    monkeypatch.setenv("RLM_SECRET_TOKEN", "abc")
    result, _ = _timed("import os\nprint(os.environ.get('RLM_SECRET_TOKEN'))")
    assert result.stdout == "None\n"
