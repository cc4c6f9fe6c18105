"""Move a role's parameters, gradient buffers and optimizer state off the device and back.

Co-located roles take turns on the same GPUs (DESIGN.md §1): while the critic trains, the
actor's weights, gradients and Adam moments need not occupy device memory. Offloading
works on *storages*, not on tensors: the data is copied to (pinned, when the storage is
on CUDA) host memory and the device storage is shrunk to 0 bytes with
`UntypedStorage.resize_(0)`. Every tensor object keeps its identity, and every view keeps
its offset into the storage, so megatron-core's many aliases stay valid without being
re-pointed: parameters are views into DDP's contiguous `param_data` buffer, `main_grad`s
are views into `grad_data`, and fp32 master weights may alias the parameters. Reloading
grows the storage back and copies the bytes in.

What moves, per flag of `OffloadConfig`:
* `params`: the storages of the model parameters (DDP's param buffers when wrapped).
* `grads`: DDP's gradient buffers. Their contents are not kept: gradients are zeroed at
  the start of every train step, so they are freed on offload and zero-filled on reload.
* `optimizer`: the inner optimizer's state (Adam moments, step) and its fp32 master
  weights, except where those alias the parameters (fp32 models: they are the params).
  With megatron-core's optimizer CPU offload (`optim.cpu_offload_fraction`) only its device
  share moves: the offloaded share lives in host memory for good, and moving it would only
  make a second host copy.

The same code runs on CPU, where it frees and restores host memory; there the round trip
still proves that nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from rl_megatron.checkpoint.mcore_compat import inner_optimizers
from rl_megatron.config import OffloadConfig


def _storage_key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return (str(storage.device), storage.data_ptr())


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        s = t.untyped_storage()
        if s.nbytes() > 0:
            seen.setdefault(_storage_key(s), s)
    return list(seen.values())


def param_tensors(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Parameters and DDP param buffers of all chunks."""
    out: list[torch.Tensor] = []
    for chunk in model:
        out.extend(p.data for p in chunk.parameters())
        for buf in _ddp_buffers(chunk):
            if getattr(buf, "param_data", None) is not None:
                out.append(buf.param_data)
    return out


def grad_tensors(model: list[torch.nn.Module]) -> list[torch.Tensor]:
    """DDP gradient buffers (`main_grad` views live in them) of all chunks."""
    out = []
    for chunk in model:
        out.extend(buf.grad_data for buf in _ddp_buffers(chunk))
        out.extend(p.grad for p in chunk.parameters() if p.grad is not None)
    return out


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Adam state and master weights of the (possibly chained) megatron optimizer, without
    what its CPU offload keeps in host memory (`_device_optimizers`)."""
    out: list[torch.Tensor] = []
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for device_opt in _device_optimizers(inner):
            for group in device_opt.param_groups:
                out.extend(group["params"])
            for state in device_opt.state.values():
                out.extend(v for v in state.values() if torch.is_tensor(v))
    return out


def _device_optimizers(inner: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers whose weights and state live on the role's device.

    A `HybridDeviceOptimizer` steps its offloaded share with CPU optimizers on host copies
    (left alone) and the rest with its `gpu_optimizer` on fp32 copies of the weights; its own
    param groups hold the model's weights, which move with `params`.
    """
    if isinstance(inner, HybridDeviceOptimizer):
        return [inner.gpu_optimizer] if inner.gpu_optimizer is not None else []
    return [inner]


def _ddp_buffers(chunk: torch.nn.Module) -> list:
    """DDP's parameter/gradient buffers; none for an unwrapped (frozen) model, whose
    `buffers` attribute is `nn.Module.buffers`, a method."""
    if not isinstance(chunk, DistributedDataParallel):
        return []
    return list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", None) or [])


class Offloader:
    """Offload / reload one role's state; holds the host copies in between.

    model: the role's chunks (DDP-wrapped or not); optimizer: its megatron optimizer or None.
    """

    def __init__(self, model: list[torch.nn.Module], optimizer=None) -> None:
        self.model = model
        self.optimizer = optimizer
        # storage key -> (storage, host copy or None when contents are not kept, bytes)
        self._offloaded: dict[
            tuple[str, int], tuple[torch.UntypedStorage, torch.Tensor | None, int]
        ] = {}

    @property
    def is_offloaded(self) -> bool:
        return bool(self._offloaded)

    def _targets(self, config: OffloadConfig) -> list[tuple[torch.UntypedStorage, bool]]:
        """(storage, keep contents) for what `config` asks to move, without duplicates."""
        params = _unique_storages(param_tensors(self.model))
        param_keys = {_storage_key(s) for s in params}
        chosen: list[tuple[torch.UntypedStorage, bool]] = []
        if config.params:
            chosen += [(s, True) for s in params]
        if config.grads:
            chosen += [
                (s, False)
                for s in _unique_storages(grad_tensors(self.model))
                if _storage_key(s) not in param_keys
            ]
        if config.optimizer and self.optimizer is not None:
            # Master weights that alias the parameters move with `params`, or not at all.
            chosen += [
                (s, True)
                for s in _unique_storages(optimizer_tensors(self.optimizer))
                if _storage_key(s) not in param_keys
            ]
        return chosen

    @torch.no_grad()
    def offload(self, config: OffloadConfig) -> int:
        """Move what `config` selects to host memory; returns the bytes freed."""
        freed = 0
        for storage, keep in self._targets(config):
            key = _storage_key(storage)
            if key in self._offloaded:
                continue
            host = None
            if keep:
                pin = storage.device.type == "cuda"
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.untyped_storage().copy_(storage, non_blocking=pin)
            self._offloaded[key] = (storage, host, storage.nbytes())
            freed += storage.nbytes()
        if torch.cuda.is_available():
            # Asynchronous copies must land before the device memory is released.
            torch.cuda.synchronize()
        for storage, _, _ in self._offloaded.values():
            storage.resize_(0)
        return freed

    @torch.no_grad()
    def reload(self) -> None:
        """Bring back everything offloaded: same tensors, same views, same values
        (gradient buffers come back zeroed)."""
        for storage, host, nbytes in self._offloaded.values():
            storage.resize_(nbytes)
            if host is not None:
                storage.copy_(host.untyped_storage(), non_blocking=True)
            else:
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._offloaded = {}
