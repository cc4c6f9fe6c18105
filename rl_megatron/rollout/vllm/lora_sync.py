"""`rollout.lora_sync: adapter`: vLLM generates with its own LoRA support; a sync sends A and B.

    adapter_sync = AdapterSync(engine, info=info, groups=groups, lora=config.actor.lora,
                               base_model=config.model.hf_path, run_dir=config.run_dir)
    stats = adapter_sync.sync(actor_chunks, version)          # every rank, every step

The `merged` sync (`resharding/lora_merge.py`) sends every adapted weight, W + (alpha/r)·B·A,
at every step. Here the engine keeps the frozen base and runs the adapter beside it
(vLLM's `enable_lora`, punica kernels); a sync moves only the adapters:

1. The base is what vLLM loaded from `model.hf_path` (the actor's frozen base is that
   checkpoint): never sent. With `enable_lora` vLLM wraps its linears and embedding
   (`<module>.base_layer.weight`), which its own `load_weights` and the in-place sync do
   not address, so a random init (dummy weights to be synced) is refused, and so is
   `rollout.sleep_level: 2`, which discards the weights while the roles train
   (`config_checks.py`). An engine that lost its weights anyway (a failed update) refuses
   the adapter (`VllmEngine.load_adapter`).
2. The adapters in Hugging Face PEFT's layout (`checkpoint/peft_export.py`:
   `iter_peft_tensors` gathers each over TP / PP to one rank, in PEFT's per-projection
   names). That rank broadcasts them to every rank (vLLM's TP workers run in-process on
   every rank of their group, and each loads the adapter itself); one rank per node writes
   them as a PEFT folder under node-local scratch (`/dev/shm` where there is one), and
   every rank's engine loads it in place of the last version (`LoRARequest(...,
   load_inplace=True)`, one adapter id for the run). The folder of the previous version is
   removed. The KV blocks cached under the adapter were computed with its old weights: the
   prefix cache is reset, as after a full sync.
3. Requests carry the adapter (`CoreLoop.lora_request`), so every generation, multi-turn
   turns included, runs base + adapter.

The bytes moved per sync are the adapters' (two rank-r factors per adapted weight) rather
than the adapted weights; generation pays vLLM's LoRA kernels on every token. At the 8B
shape on an H100 merged wins both (a sync 0.05–0.07 s against 0.23–0.26 s here: this
folder's write and vLLM's load outweigh the bytes saved; generation 1.3–1.5× faster;
benchmarks/RESULTS.md), so `merged` is the default.
Numerically the two differ by the order of operations: W·x + s·B(A·x) here against
(W + s·B·A)·x merged (bounded in `tests/vllm/test_vllm_lora_adapter_sync.py`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from rl_megatron.checkpoint.peft_export import adapter_config, iter_peft_tensors
from rl_megatron.distributed import launch_env
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.parallel import ParallelGroups
from rl_megatron.resharding.executor import SyncStats

ADAPTER_ID = 1  # one adapter for the run, replaced in place at every version
ADAPTER_NAME = "actor"


def scratch_root(run_dir: Path) -> Path:
    """Node-local folder for the adapter versions of the run at `run_dir`: the same path on
    every node (a digest of the run folder), in memory where the platform has `/dev/shm`."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return base / f"rl_megatron_lora_{digest}"


def hf_target_modules(names: Sequence[str]) -> list[str]:
    """PEFT's `target_modules` for tensors named `....<module>.lora_A.weight`."""
    return sorted({name.rsplit(".", 3)[-3] for name in names})


class AdapterSync:
    """The adapter-only sync into one vLLM engine (module docstring). Built on every rank.

    Args:
        engine: the rank's `VllmEngine`, built with `enable_lora` (`build.py`).
        info: the model's HF facts; groups: the run's process groups.
        lora: `actor.lora` (rank, alpha, dropout go to `adapter_config.json`).
        base_model: `model.hf_path` (recorded in the adapter config; None for a random init).
        run_dir: the run's folder (names the node-local scratch folder).
    """

    def __init__(
        self,
        engine,
        *,
        info: HFModelInfo,
        groups: ParallelGroups,
        lora,
        base_model: str | None,
        run_dir: Path,
    ) -> None:
        self.engine, self.info, self.groups = engine, info, groups
        self.lora, self.base_model = lora, base_model
        self.root = scratch_root(run_dir)
        self.writes_folder = launch_env().local_rank == 0  # one writer per node
        self._current: Path | None = None  # the folder the engine holds

    def sync(self, model_chunks: Sequence[torch.nn.Module], version: int) -> SyncStats:
        """Put the actor's adapters into the engine as training step `version`
        (collective); the engine keeps the base it loaded."""
        t1 = time.perf_counter()
        stats = SyncStats(rank=dist.get_rank())
        tensors = self._gathered(model_chunks)
        folder = self.root / f"v{version}"
        if self.writes_folder:
            self._write(folder, tensors)
        dist.barrier()  # every node's folder is complete before any engine reads it
        t2 = time.perf_counter()
        self.engine.load_adapter(folder, version, ADAPTER_NAME, ADAPTER_ID)
        if self.writes_folder and self._current is not None and self._current != folder:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = folder
        adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        stats.bytes_received += adapter_bytes
        stats.wall_s += t2 - t1
        stats.finish_s += time.perf_counter() - t2
        return stats

    def _gathered(self, model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
        """Every adapter tensor in PEFT's names, on every rank (CPU)."""
        local = dict(iter_peft_tensors(list(model_chunks), self.info, self.groups))
        # The rank that gathered them (TP 0, PP 0 of DP replica 0: global rank 0, whose
        # coordinates are all 0 in any rank order) sends them to all.
        box = [local]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _write(self, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
        """The PEFT folder, complete or absent: written beside, then renamed."""
        from safetensors.torch import save_file

        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)  # a resumed run's leftover of this version
        partial.mkdir(parents=True)
        config = adapter_config(
            rank=self.lora.rank,
            alpha=self.lora.alpha,
            dropout=0.0,  # generation: no dropout
            target_modules=hf_target_modules(list(tensors)),
            base_model_name_or_path=self.base_model,
        )
        (partial / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, partial / "adapter_model.safetensors"
        )
        partial.rename(folder)

    def close(self) -> None:
        """Remove this node's scratch folder (the run's end)."""
        if self.writes_folder:
            shutil.rmtree(self.root, ignore_errors=True)
