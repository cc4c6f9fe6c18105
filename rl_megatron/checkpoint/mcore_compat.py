"""Workarounds for megatron-core 0.16.1's distributed optimizer: checkpoints and CPU offload.

Each is scoped to the call that needs it and says what it works around:
* with torch's Adam (no TE / apex) a fresh optimizer can neither be saved nor loaded into
  (`ensure_adam_state`), and Adam's `step` is aliased or lost on load
  (`restore_adam_steps`, `tolerate_missing_adam_step`);
* its checkpoint writer forks helper processes even for synchronous saves
  (`InProcessSaveStrategy`, which also hashes the files it writes for the manifest);
* its optimizer CPU offload (`HybridDeviceOptimizer`, `optim.cpu_offload_fraction`) cannot
  be configured without Transformer Engine (`precision_aware_without_te`), cannot save a
  fresh optimizer and loads into one by stepping it with random gradients
  (`ensure_adam_state`), saves classes in its param groups (`hybrid_groups_as_data`), and
  its dp_reshardable loader does not hand the loaded state to its sub-optimizers
  (`finish_hybrid_load`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import queue
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.optimizer import optimizer_config
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.utils import get_te_version
from torch.distributed.checkpoint.filesystem import _write_item

from rl_megatron.checkpoint import integrity

# ---- torch Adam state ---------------------------------------------------------------------


def inner_optimizers(optimizer: Any) -> list:
    """The `MegatronOptimizer`s inside a `ChainedOptimizer` (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def hybrid_optimizers(optimizer: Any) -> list[HybridDeviceOptimizer]:
    """The `HybridDeviceOptimizer`s (optimizer CPU offload) inside a megatron optimizer."""
    inner = [getattr(opt, "optimizer", None) for opt in inner_optimizers(optimizer)]
    return [opt for opt in inner if isinstance(opt, HybridDeviceOptimizer)]


def ensure_adam_state(optimizer: Any) -> None:
    """Give torch.optim.Adam its state before the first step.

    torch's Adam creates its state lazily, and megatron-core 0.16.1's
    `DistributedOptimizer.state_dict()` (without TE / apex) asserts that the state holds
    exactly one `step`: a fresh optimizer can neither be saved nor loaded into. Zero moments
    and step 0 are exactly what Adam's first step would create.
    """
    for hybrid in hybrid_optimizers(optimizer):
        _ensure_hybrid_state(hybrid)
    for opt in inner_optimizers(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue  # TE / apex FusedAdam keep `step` in the param groups instead
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def _ensure_hybrid_state(hybrid: HybridDeviceOptimizer) -> None:
    """The first step's state for a fresh `HybridDeviceOptimizer`'s sub-optimizers.

    megatron-core 0.16.1 cannot save a fresh one (its empty state has no `master_param`),
    and loads into one by first stepping it with random gradients (`dummy_step`), which
    moves the weights. Zero moments and step 0 are what each sub-optimizer's first step
    creates (torch's fused Adam keeps `step` on its parameter's device; TE's FusedAdam, the
    device share's optimizer on a GPU with TE, keeps it in its param groups); the master
    weights are the sub-optimizers' own fp32 parameters.
    """
    fresh = False
    for sub in hybrid.sub_optimizers:
        for group in sub.param_groups:
            for param in group["params"]:
                if sub.state[param]:
                    continue
                state = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
                if isinstance(sub, torch.optim.Adam | torch.optim.AdamW):
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                sub.state[param] = state
                fresh = True
    if fresh:
        hybrid._sync_sub_optimizers_state_to_hdo()  # its view of them, master_param included


def finish_hybrid_load(optimizer: Any) -> None:
    """Hand the loaded optimizer state to each `HybridDeviceOptimizer`'s sub-optimizers.

    megatron-core 0.16.1's dp_reshardable loader sets the loaded master weights and moments
    in the wrapper's state only; its other loaders also copy them into the sub-optimizers
    (`_sync_hdo_state_to_sub_optimizers`). The fp32 weights the sub-optimizers step hold the
    loaded values anyway today, because dist_checkpointing loads into the very tensors the
    state dict names; nothing promises that, the copy here does. Passing the state on also
    moves all of a torch Adam's state to the host (the device share's too, on a GPU without
    TE): it goes back to its parameters' device. Dropped: the loader's bucket-layout flag
    `padding`, which it leaves in each parameter's state, and the `step` the load leaves in
    the wrapper's param groups, which the wrapper copies into its sub-optimizers at every
    step (it would hold TE FusedAdam's step count, kept in its groups, at the loaded value).
    Call after `restore_adam_steps`.
    """
    for hybrid in hybrid_optimizers(optimizer):
        hybrid._sync_hdo_state_to_sub_optimizers()  # master weights into the fp32 params
        for sub in hybrid.sub_optimizers:
            for param, state in sub.state.items():
                state.pop("padding", None)  # the dp_reshardable loader's bucket-layout flag
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device != param.device:
                        state[key] = value.to(param.device)
        hybrid._sync_sub_optimizers_state_to_hdo()  # master_param: the stepped fp32 params
        for group in hybrid.param_groups:
            group.pop("step", None)
            for key, value in hybrid.defaults.items():  # its classes (`hybrid_groups_as_data`)
                if isinstance(value, type):
                    group.setdefault(key, value)


@contextlib.contextmanager
def hybrid_groups_as_data(optimizer: Any) -> Iterator[None]:
    """Keep a `HybridDeviceOptimizer`'s optimizer classes out of its state dict.

    Its param groups carry its settings, the CPU and device optimizer classes among them,
    and megatron-core saves the groups as they are: classes in a pickle, which our restricted
    loading (`safe_metadata`) rightly refuses. They are settings, not state: the optimizer
    loaded into has its own (`finish_hybrid_load` puts them back into its groups).
    """
    handles = [
        hybrid.register_state_dict_post_hook(_groups_without_classes)
        for hybrid in hybrid_optimizers(optimizer)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _groups_without_classes(_optimizer: Any, state_dict: dict) -> dict:
    state_dict["param_groups"] = [
        {k: v for k, v in group.items() if not isinstance(v, type)}
        for group in state_dict["param_groups"]
    ]
    return state_dict


@contextlib.contextmanager
def precision_aware_without_te() -> Iterator[None]:
    """Let megatron-core 0.16.1 build a precision-aware `OptimizerConfig` without TE.

    The optimizer CPU offload needs `use_precision_aware_optimizer` (as Megatron-LM
    requires), whose `__post_init__` asks `is_te_min_version("2.1.0")` whether TE's
    FusedAdam can store parameter remainders; without Transformer Engine that comparison
    raises a TypeError (None >= Version). The offload's optimizers need no TE: here the
    answer is then "no", as it would be for an old TE.
    """
    original = optimizer_config.is_te_min_version

    def te_min_version(version: str, check_equality: bool = True) -> bool:
        return get_te_version() is not None and original(version, check_equality)

    optimizer_config.is_te_min_version = te_min_version
    try:
        yield
    finally:
        optimizer_config.is_te_min_version = original


def restore_adam_steps(optimizer: Any, loaded: dict) -> None:
    """Set torch Adam's per-parameter `step` to the checkpoint's, one tensor per parameter.

    With torch's Adam (no TE / apex) megatron-core 0.16.1 gets `step` wrong on load in two
    ways: `DistributedOptimizer.load_state_dict` puts one shared tensor in every parameter's
    state (Adam increments it in place per parameter, so it would advance once per
    parameter per step), and the dp_reshardable loader then copies the *pre-load* local
    step into it. The checkpoint's value is in each optimizer's `param_groups`.
    """
    inner = inner_optimizers(optimizer)
    states = [loaded] if len(inner) == 1 else [v for _, v in sorted(loaded.items())]
    for opt, state in zip(inner, states):
        steps = {g["step"] for g in state["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # TE / apex FusedAdam: the step lives in the param groups
        (step,) = steps
        for param_state in opt.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                old = param_state["step"]
                param_state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device)


@contextlib.contextmanager
def tolerate_missing_adam_step(optimizer: Any) -> Iterator[None]:
    """Let megatron-core 0.16.1 load `fully_reshardable` state into torch's Adam.

    Its `_set_main_param_and_optimizer_states` copies every key of the parameter's Adam
    state from the loaded tensors, but the fully_reshardable loader leaves `step` out of
    them ("handled separately"): a KeyError. For the duration of the load, a missing `step`
    is copied onto itself; `restore_adam_steps` then sets the checkpoint's value.
    """
    patched = []
    for opt in inner_optimizers(optimizer):
        if not isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if setter is None:
            continue

        def set_states(model_param, tensors, _opt=opt, _setter=setter):
            if "step" not in tensors:
                group, order = _opt.model_param_group_index_map[model_param]
                main_param = _opt.optimizer.param_groups[group]["params"][order]
                tensors = {**tensors, "step": _opt.optimizer.state[main_param]["step"]}
            _setter(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


# ---- dist_checkpointing without helper processes ------------------------------------------


class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """The torch_dist save strategy, writing its files from the calling process.

    megatron-core 0.16.1 offers no synchronous writer: even `save(..., async_sharded_save=
    False)` runs `FileSystemWriterAsync.write_preloaded_data_multiproc`, which forks one
    writer process per file and collects results through a spawn-context multiprocessing
    Manager (the reason for the `__main__` guard in DESIGN §5; the Manager also outlives a
    killed rank). This strategy writes the same buckets, in order, and hands the results
    over in a plain queue: same files, no helper processes. Each file is hashed as it is
    written: `files` maps this rank's files (relative names) to their manifest entries.
    """

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)
        self.files: dict[str, integrity.Entry] = {}

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        with _local_results_queue():
            request = self.async_save(sharded_state_dict, Path(checkpoint_dir))
        if request.async_fn is not None:
            transforms, _use_msc = request.async_fn.args
            request = request._replace(async_fn=partial(_write_buckets, transforms, self.files))
        request.execute_sync()  # preload to host, write, barrier, write the index


@contextlib.contextmanager
def _local_results_queue() -> Iterator[None]:
    """Make the writer take a plain queue instead of starting a multiprocessing Manager."""
    saved = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


def _write_buckets(
    transforms: list, files: dict, rank: int, buckets: list, results: queue.Queue
) -> None:
    """`write_preloaded_data_multiproc` without the forks, hashing what it writes.

    Each bucket is one file: its byte objects, then its tensors, written as megatron-core's
    `write_preloaded_data` writes them (torch's `_write_item`), through a hashing stream;
    then fsynced. `files` receives each file's entry; `results` the write results by bucket
    (or the exception), as megatron-core's finalize expects.
    """
    extra = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        extra["serialization_format"] = SerializationFormat.TORCH_SAVE
    written: dict | Exception = {}
    try:
        for index, (path, storage_key, (bytes_data, tensor_data)) in enumerate(buckets):
            with integrity.open_hashed(path) as stream:
                written[index] = [
                    _write_item(*transforms, stream, data, item, storage_key, **extra)
                    for item, data in [*bytes_data, *tensor_data]
                ]
                stream.flush()
                os.fsync(stream.fileno())
            files[storage_key] = stream.entry()
    except Exception as exc:  # handed to megatron-core's finalize, which raises it
        written = exc
    results.put(written)
