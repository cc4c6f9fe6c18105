"""Each rank's random-number streams, saved and restored exactly (no pickle).

torch's CPU and CUDA generators and Megatron's model-parallel RNG tracker are byte tensors
(safetensors); python's `random` and numpy's legacy state go to JSON. The rank's layout
coordinates are stored too, so a file is never restored into a rank at another place.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from safetensors.torch import load_file, save

from rl_megatron.checkpoint import integrity


def save_rng(rng_dir: Path, rank: int, coordinates: dict) -> dict[str, integrity.Entry]:
    """This rank's RNG streams: tensors to safetensors, python / numpy states to JSON.

    Returns the two files' manifest entries (name in `rng_dir` → size, checksum).
    """
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    tracker = get_cuda_rng_tracker().get_states()
    for name, state in tracker.items():
        state = state.get_state() if isinstance(state, torch.Generator) else state
        tensors[f"tracker/{name}"] = state.detach().cpu().clone()
    version, mt, gauss = random.getstate()
    meta: dict[str, Any] = {
        "coordinates": coordinates,
        "tracker_names": sorted(tracker),
        "python_random": [version, list(mt), gauss],
        "numpy_random": _numpy_state(),
    }
    base = rng_dir / f"rank_{rank:05d}"
    # Serialised in memory (a few KB) so the bytes are hashed as they are written.
    blobs = {".safetensors": save(tensors), ".json": (json.dumps(meta) + "\n").encode()}
    return {
        base.name + suffix: integrity.write_bytes(base.with_suffix(suffix), blob)
        for suffix, blob in blobs.items()
    }


def read_rng(rng_dir: Path, rank: int, coordinates: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's saved RNG states; refuses files of a rank at other coordinates."""
    base = rng_dir / f"rank_{rank:05d}"
    try:
        meta = json.loads(base.with_suffix(".json").read_text())
        tensors = load_file(str(base.with_suffix(".safetensors")))
    except Exception as exc:  # OSError, JSONDecodeError, safetensors' SafetensorError
        raise ValueError(f"{base}.json/.safetensors: unreadable RNG state ({exc})") from None
    if meta.get("coordinates") != coordinates:
        raise ValueError(
            f"{base}.json: saved by a rank at {meta.get('coordinates')}, this rank is at "
            f"{coordinates} (different rank order?)"
        )
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Set every stream `save_rng` recorded (the tracker's generators kept in place)."""
    torch.set_rng_state(tensors["torch_cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    states = {}
    for name in meta["tracker_names"]:
        saved = tensors[f"tracker/{name}"]
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(saved)
            states[name] = current[name]
        else:
            states[name] = saved
    tracker.set_states(states)
    version, mt, gauss = meta["python_random"]
    random.setstate((version, tuple(mt), gauss))
    if meta["numpy_random"] is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = meta["numpy_random"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _numpy_state() -> list | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
