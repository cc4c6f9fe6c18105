"""Load HF safetensors straight into Megatron model chunks at any TP / PP / VPP layout.

Each rank reads only the tensors of its own layers and, within them, only its TP slice
(`safe_open(...).get_slice`): a rank's peak extra memory is about one HF tensor's slice, never
the model. Each read opens its file afresh, so pages already read do not stay mapped (and
resident) after the tensors made from them are gone. Before reading, every rank
checks the headers: the checkpoint must hold exactly the tensors the name table consumes,
with the shapes `config.json` implies, and no file may be truncated.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.models.lora import adapter_param_ids
from rl_megatron.parallel import ParallelLayout

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A missing, truncated or inconsistent checkpoint file; the message is one line."""


def read_safetensors_header(path: str | Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name → (dtype, shape) from a .safetensors header; refuses truncated files.

    Reads only the header, so it costs the same for a 10 GB shard as for a tiny one.
    """
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated (header runs past the end of the file)")
            header = json.loads(f.read(n))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not a valid safetensors file") from None
    header.pop("__metadata__", None)
    data_end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + data_end > size:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes, the header needs {8 + n + data_end})"
        )
    return {name: (v["dtype"], v["shape"]) for name, v in header.items()}


class SafetensorsCheckpoint:
    """The tensors of an HF model directory (one file, or shards with an index), read lazily.

    Usable as a context manager (kept for callers; no file stays open between reads).
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise CheckpointError(f"{index}: not a valid safetensors index") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{self.dir}: no *.safetensors files (only safetensors checkpoints are read)"
                )
            weight_map = None
        self.file_of: dict[str, str] = {}
        self.meta: dict[str, tuple[str, list[int]]] = {}
        for fname in files:
            if not (self.dir / fname).is_file():
                raise CheckpointError(f"{self.dir / fname}: listed in {INDEX_FILE} but missing")
            for name, meta in read_safetensors_header(self.dir / fname).items():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue  # a stray tensor the index does not point at
                self.file_of[name] = fname
                self.meta[name] = meta
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.file_of:
                    raise CheckpointError(f"{self.dir / fname}: lacks tensor '{name}' of the index")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(meta[1]) for name, meta in self.meta.items()}

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int = 0) -> torch.Tensor:
        """Tensor `name`, or its rows/columns `[start, end)` along `dim` (0 or 1) only."""
        from safetensors import safe_open

        # Opened per read: a handle kept open keeps its memory map, and with it every page
        # read so far, in this process's resident memory (the whole model by the end of a
        # load). The tensors returned may be backed by the (copy-on-write) map itself: their
        # pages stay mapped while they live, and are read only when used.
        with safe_open(str(self.dir / self.file_of[name]), framework="pt", device="cpu") as handle:
            if dim is None:
                return handle.get_tensor(name)
            sl = handle.get_slice(name)
            return sl[start:end] if dim == 0 else sl[:, start:end]

    def close(self) -> None:
        pass

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def global_layer_fn(chunk: torch.nn.Module) -> Callable[[int], int]:
    """Local layer index of a model chunk → global layer index (any PP / VPP layout)."""
    layers = chunk.decoder.layers
    # TransformerLayer.layer_number is global and 1-based (megatron adds the stage offset).
    return lambda i: layers[i].layer_number - 1


def global_expert_fn(chunk: torch.nn.Module) -> Callable[[int], int] | None:
    """Local expert index on this expert-parallel rank → global expert index; None without
    experts. Read off megatron-core's expert module (`SequentialMLP` / `TEGroupedMLP`): rank r
    of the EP group holds experts [r·n, (r+1)·n), n = its `num_local_experts`."""
    for module in chunk.modules():
        if hasattr(module, "num_local_experts") and hasattr(module, "ep_group"):
            offset = module.ep_group.rank() * module.num_local_experts
            return lambda i: offset + i
    return None


def iter_rule_params(
    chunk: torch.nn.Module, rules: list[hm.Rule], skip: frozenset[str] = frozenset()
) -> Iterator[tuple[hm.Rule, int | None, torch.nn.Parameter]]:
    """Yield (rule, global layer or None, parameter) for each parameter of a model chunk.

    Parameters whose rule name is in `skip` are left out, and so are LoRA adapters (no HF
    weight of their own: `models/lora.py`); any other parameter no rule covers raises a
    one-line MappingError.
    """
    by_name = {rule.megatron: rule for rule in rules}
    to_global = global_layer_fn(chunk) if hasattr(chunk, "decoder") else None
    to_expert = global_expert_fn(chunk)
    adapters = adapter_param_ids(chunk)
    for name, param in chunk.named_parameters():
        if id(param) in adapters:
            continue
        canonical, layer = hm.canonical_param_name(name, to_global, to_expert, by_name)
        if canonical in skip:
            continue
        rule = by_name.get(canonical)
        if rule is None:
            raise hm.MappingError(f"model parameter '{name}' has no HF counterpart in the table")
        yield rule, layer, param


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


@torch.no_grad()
def load_hf_weights(
    model_chunks: list[torch.nn.Module],
    hf_dir: str | Path,
    info: HFModelInfo,
    layout: ParallelLayout,
    *,
    head: str = "lm",
    progress: bool = False,
) -> int:
    """Copy an HF checkpoint's weights into this rank's model chunks, in place.

    Args:
        model_chunks: this rank's GPTModel chunks (one per virtual stage; wrappers allowed).
        hf_dir: directory with config.json and *.safetensors (sharded with an index, or not).
        info: the parsed config of `hf_dir`.
        head: "lm" (causal LM), "value" (load `score.weight` of *ForSequenceClassification
            into the scalar head) or "none" (leave the head as initialised: fresh critic).
        layout: the run's parallel layout: this rank's tensor-parallel coordinates split
            a dense weight's rows, its expert-TP coordinates an expert's.
        progress: show a bar of this rank's parameters loaded / total.
    Returns:
        The number of parameters loaded on this rank.
    """
    rank = dist.get_rank()
    tp_size, tp_rank = layout.tp, layout.coordinates(rank)["tp"]
    etp = (layout.expert_tp, layout.expert_coordinates(rank)["etp"]) if info.is_moe else (1, 0)
    rules = hm.rules_for(info, head)
    heads = {"lm_head.weight", "score.weight"}
    with SafetensorsCheckpoint(hf_dir) as ckpt:
        hm.check_hf_tensors(
            ckpt.shapes(), rules, info, ignore=lambda n: head == "none" and n in heads
        )
        # A fresh critic head has no source tensor: it keeps its initialisation.
        skip = frozenset({"output_layer.weight"} if head == "none" else ())
        params = [
            item for chunk in model_chunks for item in iter_rule_params(unwrap(chunk), rules, skip)
        ]
        if progress:
            from tqdm import tqdm

            params = tqdm(params, desc="load", unit="tensor")
        loaded = 0
        for rule, layer, param in params:
            padded = param.shape[0] * tp_size if rule.transform == hm.VOCAB else 0
            size, rank = hm.shard_coords(rule, (tp_size, tp_rank), etp)
            shard = hm.hf_to_megatron_shard(rule, layer, ckpt.read, info, size, rank, padded)
            if tuple(shard.shape) != tuple(param.shape):
                name = rule.megatron.format(layer=layer)
                raise hm.MappingError(
                    f"'{name}' shard has shape {list(shard.shape)} from the checkpoint, "
                    f"the model expects {list(param.shape)}"
                )
            param.copy_(shard)
            loaded += 1
    return loaded
