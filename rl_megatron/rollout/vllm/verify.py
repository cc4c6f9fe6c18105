"""Reading the vLLM engine's parameters back for `rollout.verify_sync` (`resharding/verify.py`).

The engine's own parameters, fetched through its worker's model runner on every read
(`collective_rpc`, the in-process model object), never through the sync target's table or
the copy program's kept views: what generation will compute with, whatever the sync
believes it wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from rl_megatron.resharding.fp8 import FP8_DTYPE, block_scale_shape, quantize_blockwise_
from rl_megatron.resharding.verify import StoredForm, SyncVerifier, VerifyMode
from rl_megatron.rollout.vllm.repacked import repacked_parameters
from rl_megatron.rollout.vllm.target import _plain_tensor_reads, _rpc_model, fp8_weights


def _rpc_parameters(worker: Any, names: Sequence[str] | None) -> dict[str, torch.Tensor]:
    # `.data`: vLLM's parameter subclasses as plain tensors of the same storage. A name is
    # looked up in the live module tree each time (`get_parameter`), never kept.
    model = worker.model_runner.model
    if names is None:
        return {name: p.data for name, p in model.named_parameters()}
    return {name: model.get_parameter(name).data for name in names}


def engine_parameters(
    engine: Any, leave_out: frozenset[str] = frozenset(), names: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's vLLM parameters `names` (None: all), name → tensor, as its model runner
    holds them now (less `leave_out`)."""
    wanted = None if names is None else [n for n in names if n not in leave_out]
    params = engine.llm.collective_rpc(_rpc_parameters, args=(wanted,))[0]
    return {n: t for n, t in params.items() if n not in leave_out}


def _model_and_fp8(engine: Any) -> tuple[torch.nn.Module, dict[str, str]]:
    """vLLM's model on this rank and its FP8 weights (weight name -> its scales' name)."""
    model = engine.llm.collective_rpc(_rpc_model)[0]
    with _plain_tensor_reads():
        fp8, _ = fp8_weights(dict(model.named_parameters()))
    return model, fp8


def _repacked(model: torch.nn.Module, fp8: dict[str, str]) -> frozenset[str]:
    from vllm.platforms import current_platform

    written_here = set(fp8) | set(fp8.values())  # quantized by the target: `fp8_forms`
    found = repacked_parameters(model, current_platform.device_type)
    return frozenset(r.name for r in found if r.storage and r.name not in written_here)


def repacked_storage(engine: Any) -> frozenset[str]:
    """Parameters whose own storage vLLM repacked after loading (`repacked.py`): what they
    hold is the processed form of what was sent, not comparable bitwise, so the verifier
    leaves them out (counted `unreadable`). On the CPU build: every linear weight and the
    experts; on a GPU with unquantized weights on the Triton kernels: none. FP8 weights
    are not among them: the target quantizes them, and so does the check (`fp8_forms`)."""
    return _repacked(*_model_and_fp8(engine))


def fp8_forms(fp8: dict[str, str], sent_dtype: torch.dtype) -> dict[str, StoredForm]:
    """vLLM's FP8 weights (`fp8`: weight -> scales) as the target writes them: the sent
    weight quantized per block (`resharding/fp8.py`) into the weight and its
    `weight_scale_inv`, compared bit for bit (the quantizer is deterministic: the same bf16
    rows give the same bytes)."""

    def quantized(name: str, scale_name: str, sent: torch.Tensor) -> dict[str, torch.Tensor]:
        out = torch.empty(sent.shape, dtype=FP8_DTYPE, device=sent.device)
        scale = torch.empty(block_scale_shape(tuple(sent.shape)), device=sent.device)
        quantize_blockwise_(sent, out, scale, name)
        return {name: out, scale_name: scale}

    return {
        name: StoredForm(
            sent_dtype, functools.partial(quantized, name, scale_name), (name, scale_name)
        )
        for name, scale_name in fp8.items()
    }


def verifier_for(engine: Any, mode: VerifyMode, interval: int) -> SyncVerifier | None:
    """The engine's sync verifier for `rollout.verify_sync` (None when `off`: no reads)."""
    if mode == "off":
        return None
    model, fp8 = _model_and_fp8(engine)  # read once, at build
    sent_dtype = engine.llm.llm_engine.model_config.dtype  # the trainer's, as the target's
    return SyncVerifier(
        mode,
        interval=interval,
        read_engine=functools.partial(engine_parameters, engine, _repacked(model, fp8)),
        forms=fp8_forms(fp8, sent_dtype),
    )
