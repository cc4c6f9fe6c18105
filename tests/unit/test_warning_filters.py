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

from rl_megatron.utils.warning_filters import CPU_ONLY_NOISE, NOISE, VLLM_NOISE

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


# vLLM's log records, through a handler set up after `install` (as vLLM's own is).
EMIT_VLLM = """
import json, logging, sys
from rl_megatron.utils import warning_filters
warning_filters.install(sys.argv[1], on_gpu=False)
logging.basicConfig(stream=sys.stderr, format="%(name)s|%(message)s", level=logging.DEBUG)
for name, message, *_ in json.loads(sys.argv[2]):
    logging.getLogger(name).warning(message + " (noise)")
base = logging.getLogger("vllm.renderers.base")
for why in ("Tokenizer not available when `skip_tokenizer_init=True`", "a broken template"):
    try:
        raise ValueError(why)
    except ValueError:
        base.warning("Chat template warmup failed", exc_info=True)
# Elsewhere, or another message of the same logger: shown.
logging.getLogger("vllm.v1.worker.cpu_worker").warning("libtcmalloc (noise) elsewhere")
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
    "ParallelLMHead: Failed to load weights")
"""


def _emit_vllm(level: str) -> str:
    noise = [list(entry) for entry in VLLM_NOISE]
    result = subprocess.run(
        [sys.executable, "-c", EMIT_VLLM, level, json.dumps(noise)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stderr


def test_vllm_noise_is_filtered_at_info_and_nothing_else():
    stderr = _emit_vllm("INFO")
    for _name, message, *_ in VLLM_NOISE:
        if message != "Chat template warmup failed":
            assert message not in stderr
    # The warm-up's failure for want of a tokenizer goes; any other failure of it stays
    # (another exception, or none: the "(noise)" record above).
    assert stderr.count("Chat template warmup failed") == 2
    assert "Chat template warmup failed (noise)" in stderr
    assert "a broken template" in stderr and "skip_tokenizer_init" not in stderr
    assert "libtcmalloc (noise) elsewhere" in stderr
    assert "ParallelLMHead: Failed to load weights" in stderr  # fixed at its cause, not here


def test_debug_shows_the_vllm_noise():
    stderr = _emit_vllm("DEBUG")
    for name, message, *_ in VLLM_NOISE:
        assert f"{name}|{message} (noise)" in stderr
    assert stderr.count("Chat template warmup failed") == 3
    assert "skip_tokenizer_init" in stderr
