"""Workarounds for megatron-core 0.16.1's checkpointing of the distributed optimizer.

Each is scoped to the call that needs it and says what it works around:
* with torch's Adam (no TE / apex) a fresh optimizer can neither be saved nor loaded into
  (`ensure_adam_state`), and Adam's `step` is aliased or lost on load
  (`restore_adam_steps`, `tolerate_missing_adam_step`);
* its checkpoint writer forks helper processes even for synchronous saves
  (`InProcessSaveStrategy`, which also hashes the files it writes for the manifest).
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
from torch.distributed.checkpoint.filesystem import _write_item

from rl_megatron.checkpoint import integrity

# ---- torch Adam state ---------------------------------------------------------------------


def inner_optimizers(optimizer: Any) -> list:
    """The `MegatronOptimizer`s inside a `ChainedOptimizer` (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def ensure_adam_state(optimizer: Any) -> None:
    """Give torch.optim.Adam its state before the first step.

    torch's Adam creates its state lazily, and megatron-core 0.16.1's
    `DistributedOptimizer.state_dict()` (without TE / apex) asserts that the state holds
    exactly one `step`: a fresh optimizer can neither be saved nor loaded into. Zero moments
    and step 0 are exactly what Adam's first step would create.
    """
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
