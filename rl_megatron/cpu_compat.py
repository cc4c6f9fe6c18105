"""Let megatron-core run on CPU with gloo (tests, CI and the CPU demo).

megatron-core assumes CUDA in a handful of places: tensors created with ``device="cuda"``
or ``torch.cuda.current_device()``, ``Tensor.cuda()``, the CUDA RNG tracker,
``torch.cuda.synchronize``/streams, and ``Tensor.type() == "torch.cuda.FloatTensor"``
checks in the optimizers. This module redirects all of them to the CPU:

* a ``TorchFunctionMode`` rewrites every ``device=`` argument (and ``Tensor.cuda()`` /
  ``Tensor.to("cuda")``) to CPU, and reports CPU tensors' ``type()`` with the CUDA name
  that the optimizers check for;
* a few ``torch.cuda`` functions become CPU equivalents or no-ops;
* Megatron's RNG tracker keeps its states as CPU generator states;
* the MoE all-to-all dispatcher gets its split sizes as numpy arrays, as it does on a GPU,
  and its all-to-all allocates on the CPU in the backward pass too
  (`_patch_megatron_moe_splits`);
* the optimizer CPU offload splits its parameters between host and device as on a GPU
  (`_patch_hybrid_optimizer`).

It is enabled only when no GPU is present (``enable_if_no_gpu``) and never on a GPU run.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "CUDA device <int>" in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device requests to CPU for every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            # Factory functions asked for pinned host memory (megatron-core's RoPE slice
            # under context parallelism): there is no pinned allocator without a GPU.
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # The optimizers accept only "torch.cuda.*Tensor" parameters.
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NullStream:
        return self

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator
    # directly, or the two would recurse.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None


def _patch_megatron_rng() -> None:
    """Keep Megatron's tensor-parallel RNG tracker states on the CPU generator."""
    try:
        from megatron.core.tensor_parallel import random as mcore_random
    except ImportError:
        return

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state


def _patch_megatron_moe_splits() -> None:
    """megatron-core's alltoall token dispatcher moves its split sizes off the GPU with
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on the
    CPU the splits stayed tensors and gloo's `all_to_all_single` refused them (it takes
    sequences of ints). Here a CPU tensor asked for as numpy becomes numpy too."""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move
    token_dispatcher.maybe_move_tensor_to_cpu = move

    # Its all-to-all allocates the output on `torch.cuda.current_device()` (0 here); in the
    # backward pass, where torch function modes are not active, that 0 meant a GPU.
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward

    def forward_on_cpu(ctx: Any, *args: Any) -> Any:
        with _CudaToCpuMode():
            return forward(ctx, *args)

    mappings._AllToAll.forward = staticmethod(forward_on_cpu)


class _DeviceResidentMode(TorchFunctionMode):
    """`is_cuda` is True for the given tensors and for the copies `clone`, `detach` and
    `float` make of them; `.cpu()` of one is a host tensor of its own."""

    _INHERIT = (torch.Tensor.clone, torch.Tensor.detach, torch.Tensor.float)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._alive = list(tensors)  # kept alive while the mode is, so their ids stay theirs
        self._ids = {id(t) for t in self._alive}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == _IS_CUDA:
            return id(args[0]) in self._ids
        out = func(*args, **(kwargs or {}))
        resident = bool(args) and id(args[0]) in self._ids
        if resident and func is torch.Tensor.cpu and out is args[0]:
            return out.detach()  # a new tensor object: the host copy
        if resident and func in self._INHERIT and out is not args[0]:
            self._alive.append(out)
            self._ids.add(id(out))
        return out


_IS_CUDA = torch.Tensor.is_cuda.__get__  # a method-wrapper: compared with ==, not `is`


def _patch_hybrid_optimizer() -> None:
    """megatron-core's `HybridDeviceOptimizer` (`optim.cpu_offload_fraction`) gives the first
    `fraction` of its device-resident parameters (by `is_cuda`) host copies stepped by CPU
    optimizers and leaves the rest to a device optimizer. Without a GPU no parameter is
    device-resident: every one lands in a CPU optimizer without a device twin, and the first
    step fails (KeyError in `_set_sub_optimizer_grads`). While it splits, the parameters it
    was given count as device-resident here, with the copies made from them, and `.cpu()`
    makes a host copy: the split of a GPU run, both kinds of sub-optimizer on the CPU."""
    try:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    except ImportError:
        return
    split = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def split_as_on_a_gpu(self: Any, offload_fraction: float) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        with _DeviceResidentMode(params):
            return split(self, offload_fraction)

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = split_as_on_a_gpu


def enable() -> None:
    """Install the CPU redirect for the rest of the process (idempotent)."""
    global _ENABLED, _MODE
    if _ENABLED:
        return
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_moe_splits()
    _patch_hybrid_optimizer()
    # The "CUDA" RNG is the CPU generator here, so Megatron's fork() always sees the CPU
    # state change and would warn on every dropout.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ENABLED = True


def enable_if_no_gpu() -> bool:
    """Enable the CPU redirect when CUDA is unavailable; return whether it is active."""
    if torch.cuda.is_available():
        return False
    enable()
    return True


def is_enabled() -> bool:
    return _ENABLED
