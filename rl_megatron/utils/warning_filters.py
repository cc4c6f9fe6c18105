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

Our own warnings (`warnings.warn` in `rl_megatron`, the `rl_megatron` logger) and any other
UserWarning still print. vLLM's INFO lines are held back the same way (`VLLM_LOGGING_LEVEL`
defaults to WARNING), unless the user sets that variable.
"""

from __future__ import annotations

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
