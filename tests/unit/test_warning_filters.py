"""The quiet console's filters (`utils/warning_filters.py`), in a fresh interpreter each.

The launch-level check — a real 4-rank run prints no warning line, and DEBUG shows them —
is in tests/e2e/test_slurm.py; here each rule is checked alone, including that a warning
of ours (or any other UserWarning) still prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rl_megatron.utils.warning_filters import CPU_ONLY_NOISE, NOISE

EMIT = """
import json, os, sys, warnings
from rl_megatron.utils import warning_filters
warning_filters.install(sys.argv[1], on_gpu=sys.argv[2] == "gpu")
THIRD_PARTY = '''
import warnings
for message in MESSAGES:
    warnings.warn(message + " (noise)", UserWarning)
warnings.warn("`all_gather_into_tensor` is deprecated", FutureWarning)
warnings.warn("old API", DeprecationWarning)
'''
# Raised from a module of another package, as megatron-core's and torch's are (Python's own
# defaults treat __main__'s deprecations differently).
exec(THIRD_PARTY, {"__name__": "megatron.core.stand_in", "MESSAGES": json.loads(sys.argv[3])})
warnings.warn("rl_megatron: a real warning", UserWarning)
print(os.environ.get("VLLM_LOGGING_LEVEL"))
"""
MESSAGES = [m for m, _ in NOISE + CPU_ONLY_NOISE]


def _emit(level: str, device: str = "cpu", flags: tuple[str, ...] = ("-W", "default")):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "VLLM_LOGGING_LEVEL")}
    result = subprocess.run(
        # -W default: every warning shown unless our filters say otherwise (as with a
        # user's PYTHONWARNINGS), so Python's own defaults cannot pass the test for them.
        [sys.executable, *flags, "-c", EMIT, level, device, json.dumps(MESSAGES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return result.stdout.strip(), result.stderr


def test_info_filters_the_noise_and_keeps_real_warnings():
    vllm_level, stderr = _emit("INFO")
    shown = [line for line in stderr.splitlines() if "Warning:" in line]
    assert shown == [line for line in shown if "rl_megatron: a real warning" in line]
    assert len(shown) == 1
    assert vllm_level == "WARNING"


def test_cpu_only_noise_is_shown_on_gpus():
    _, stderr = _emit("INFO", "gpu")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in stderr
    for message, _ in NOISE:
        assert message not in stderr


def test_debug_shows_everything():
    # Python's default filters (deprecations from other modules hidden): DEBUG lifts them.
    vllm_level, stderr = _emit("DEBUG", flags=())
    for message in MESSAGES:
        assert message in stderr
    assert "FutureWarning" in stderr and "DeprecationWarning" in stderr
    assert "rl_megatron: a real warning" in stderr
    assert vllm_level == "None"
