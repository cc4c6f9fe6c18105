"""Which vLLM parameters are not kept in the checkpoint format an in-place sync writes.

vLLM runs each layer's `quant_method.process_weights_after_loading` once its weights are
loaded, and some methods replace, reorder or re-dtype the storage there: quantized
weights and their scales, Marlin layouts, experts shuffled for FlashInfer / AITER
kernels, the CPU build's oneDNN packing (which empties `weight` or keeps a private packed
copy beside it). Writing the checkpoint format into such a parameter in place is silently
wrong (NeMo-RL #3659). Such parameters must go through vLLM's layerwise reload, which
re-runs the processing (`target.VllmEngineTarget`), or be refused.

Two signals, either one flags a parameter:

* its layer's quant method is not one of those known to keep the checkpoint format on
  this platform (`_post_processing`), or the method's post-processing was replaced
  on the object (a plugin, a patch): unknown post-processing is taken as repacking. This
  is what catches a same-shape repack (a square weight transposed), which no shape
  comparison can;
* its shape, strides or dtype differ from what vLLM recorded of it before processing
  (`restore_metadata` of vLLM's layerwise reload, 0.26 and 0.32): the storage changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# Unquantized methods whose post-processing leaves the checkpoint format in place, except
# on these platforms (vLLM 0.26 and 0.32 `linear.py`, `vocab_parallel_embedding.py`: the CPU build
# packs for oneDNN, XPU may re-stride).
_IN_PLACE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
_REPACKING_PLATFORMS = ("cpu", "xpu")
# Unquantized experts stay in place on the Triton kernels only; FlashInfer, AITER, CPU
# and XPU backends shuffle or transpose them (`fused_moe/unquantized_fused_moe_method.py`).
_IN_PLACE_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def _post_processing(method: Any, platform: str) -> tuple[str, bool] | None:
    """None if `method` leaves its layer's weights as loaded; else (why, a phrase; whether
    the storage itself leaves the checkpoint format, as opposed to a private packed copy
    kept beside an unchanged weight)."""
    name = type(method).__name__
    if "process_weights_after_loading" in vars(method):
        return f"its {name}'s process_weights_after_loading was replaced", True
    if name in _IN_PLACE_METHODS:
        if platform in _REPACKING_PLATFORMS:
            # Linear layers drop `weight` for the packed one; embeddings keep it beside.
            return f"{name} packs it for the {platform} platform", name != _IN_PLACE_METHODS[1]
        return None
    if name == "UnquantizedFusedMoEMethod":
        if platform in _REPACKING_PLATFORMS:
            return f"{name} packs it for the {platform} platform", True
        # vLLM 0.26 and 0.32 both record the backend they chose (Triton by default on
        # Hopper; FlashInfer first on Blackwell, whose CUTLASS layout swaps w1 and w3 in a
        # tensor of the same shape). A method without one is not known to keep the format.
        backend = getattr(method, "unquantized_backend", None)
        if getattr(backend, "name", None) in _IN_PLACE_MOE_BACKENDS:
            return None
        return f"{name} shuffles it for the {getattr(backend, 'value', backend)} kernels", True
    return f"{name} post-processes it", True


def _recorded(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """vLLM's record of `module`'s parameters before processing (empty where none)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # a vLLM without the layerwise reload
        return {}
    info = LAYERWISE_INFO.get(module)
    return info.restore_metadata[0] if info is not None else {}


@dataclasses.dataclass(frozen=True)
class Repacked:
    name: str  # vLLM parameter
    why: str  # a phrase: what vLLM does to it
    storage: bool  # its own storage left the checkpoint format (else a packed copy beside it)


def repacked_parameters(model: torch.nn.Module, platform: str) -> list[Repacked]:
    """Every parameter of `model` that an in-place write of the checkpoint format would
    leave wrong.

    platform: vLLM's `current_platform.device_type` ("cuda", "cpu", "xpu", ...).
    """
    found = []
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        method = getattr(module, "quant_method", None)
        processed = _post_processing(method, platform) if method is not None else None
        recorded = _recorded(module)
        for leaf, param in params:
            name = f"{module_name}.{leaf}" if module_name else leaf
            was = recorded.get(leaf)
            if was is not None and (
                (was.shape, was.dtype, was.stride()) != (param.shape, param.dtype, param.stride())
            ):
                why = (
                    f"vLLM changed it after loading: {tuple(was.shape)} {was.dtype} became "
                    f"{tuple(param.shape)} {param.dtype}"
                )
                found.append(Repacked(name, processed[0] if processed else why, True))
            elif processed is not None:
                found.append(Repacked(name, *processed))
    return found


def refusal(found: list[Repacked], quantization: str | None) -> str:
    """The one line refusing an in-place sync into an engine with `found` parameters."""
    name, why = found[0].name, found[0].why
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    setting = f", set by quantization={quantization!r}" if quantization else ""
    return (
        f"vLLM parameter {name} is not kept in the checkpoint format after loading ({why}"
        f"{setting}){more}: an in-place weight sync would write it wrongly; use "
        f"weight_reload='layerwise' (vLLM's reload re-runs the processing) or 'auto'"
    )
