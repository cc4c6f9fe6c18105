"""A quiet console: third-party warning noise filtered in the process that raises it.

`launch/ppo.py` calls `install(config.logging.level)` on every rank, right after the config
is read and before megatron-core, transformers or vLLM are imported, so each rank filters
its own warnings (flags given to the launcher, such as `python -W ignore -m torchrun`, never
reach the ranks). With `logging.level=DEBUG` nothing is filtered and every warning is shown
once per place (Python's "default" action, deprecations included).

What is filtered at INFO and above, and why:

* FutureWarning and DeprecationWarning, whoever raises them: they tell the authors of the
  calling code that an API will change (torch 2.13 deprecates the `*_tensor` collectives
  megatron-core 0.16 calls on every step, transformers renames config keys), not the user
  something about their run.
* The UserWarnings in `NOISE`, each named by the start of its message: notices about our
  supported set-up (no apex, no Transformer Engine, megatron-core's own default), or a
  pattern of megatron-core's that is harmless here.

* The vLLM log records in `VLLM_NOISE`, each named by its logger and the start of its
  message (a logger filter: vLLM's own handlers, set up later, never see them): notices
  about the set-up the trainer chooses (token ids in, no tokenizer; eager CPU kernels for
  the tests and the CPU demo), each with why it is harmless there.

Our own warnings (`warnings.warn` in `rl_megatron`, the `rl_megatron` logger) and any other
UserWarning still print. vLLM's INFO lines are held back the same way (`VLLM_LOGGING_LEVEL`
defaults to WARNING), unless the user sets that variable.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (start of the message, why it is noise); UserWarning, from any module.
NOISE: tuple[tuple[str, str], ...] = (
    (
        "Apex is not installed",
        "megatron-core falls back to torch's norms; we run without apex by design",
    ),
    (
        "Transformer Engine and Apex are not installed",
        "megatron-core uses its local layer specs; TE and apex are optional (DESIGN.md §1)",
    ),
    (
        "full scope is deprecated",
        "megatron-core 0.16's TransformerConfig warns about its own default cuda_graph_scope",
    ),
    (
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        "megatron-core's zero_grad probes `.grad` of the distributed optimizer's views",
    ),
)
# Only without a GPU: it names a CUDA setting, which the CPU run has no use for (GPU runs
# set it in launch/slurm/ppo.sbatch and the Dockerfile; a GPU run without it should hear).
CPU_ONLY_NOISE = (
    (
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "a CUDA stream setting, meaningless on the CPU",
    ),
)


# (logger, start of the message, why it is harmless); records at any level. A fourth item,
# when present, must appear in the record's exception text too.
VLLM_NOISE: tuple[tuple[str, ...], ...] = (
    (
        "vllm.renderers.base",
        "Chat template warmup failed",
        "vllm.LLM renders a chat template at start-up; the engine is made without a "
        "tokenizer (prompts arrive as token ids), so there is no template to warm up",
        "skip_tokenizer_init",
    ),
    (
        "vllm.renderers.base",
        "Using None for EOS token id because tokenizer is not initialized",
        "no tokenizer, as above; the engine passes its stop ids (config.json's and "
        "generation_config.json's EOS ids) with every request",
    ),
    (
        "vllm.config.vllm",
        "Enforce eager set, disabling torch.compile",
        "rollout.enforce_eager, eager by default on the CPU build (no graph compile in tests)",
    ),
    (
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings",
        "the same eager mode as above",
    ),
    (
        "vllm.triton_utils.importing",
        "Triton is installed, but doesn't include CPU backend",
        "the CPU build runs its own C++ kernels; Triton is for GPUs (torch brings it)",
    ),
    (
        "vllm.platforms.cpu",
        "Triton is not installed. triton-cpu is expected",
        "the same: the CPU build's kernels need no Triton",
    ),
    (
        "vllm.config.vllm",
        "Model Runner V2 requires Triton; using the V1 model runner instead",
        "the same; the trainer steps vLLM's engine core through either runner",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "libtcmalloc is not found in LD_PRELOAD",
        "a speed hint for serving on CPUs; the CPU build runs the tests and the CPU demo",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "libiomp is not found in LD_PRELOAD",
        "the same speed hint",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
        "vLLM has bound each rank's threads already and ignores later calls, as intended",
    ),
)


class _DropRecords(logging.Filter):
    """Drops a logger's records whose message starts with one of `starts` (and whose
    exception text, where a pair names one, contains it)."""

    def __init__(self, starts: list[tuple[str, str | None]]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for start, in_exception in self.starts:
            if not message.startswith(start):
                continue
            if in_exception is None:
                return False
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None and in_exception in str(exc):
                return False
        return True


def _filter_vllm_noise() -> None:
    by_logger: dict[str, list[tuple[str, str | None]]] = {}
    for name, start, _why, *in_exception in VLLM_NOISE:
        by_logger.setdefault(name, []).append((start, in_exception[0] if in_exception else None))
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)  # vLLM's init_logger returns this same logger
        for old in [f for f in logger.filters if isinstance(f, _DropRecords)]:
            logger.removeFilter(old)  # installed twice in one process: one filter
        logger.addFilter(_DropRecords(starts))


def install(level: str = "INFO", on_gpu: bool | None = None) -> None:
    """Filter third-party warning noise in this process; show everything at DEBUG.

    Args:
        level: `logging.level` of the run ("DEBUG" shows every warning).
        on_gpu: whether CUDA is used; None asks torch (imported only then).
    """
    if level == "DEBUG":
        warnings.simplefilter("default")  # every warning once per place, deprecations too
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for message, _why in NOISE + (() if on_gpu else CPU_ONLY_NOISE):
        # filterwarnings matches the message's start (a regex), case-insensitively.
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)
    _filter_vllm_noise()
