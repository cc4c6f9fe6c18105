"""Reading the vLLM engine's parameters back for `rollout.verify_sync` (`resharding/verify.py`).

The engine's own parameters, fetched through its worker's model runner on every read
(`collective_rpc`, the in-process model object), never through the sync target's table or
the copy program's kept views: what generation will compute with, whatever the sync
believes it wrote.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rl_megatron.resharding.verify import SyncVerifier, VerifyMode
from rl_megatron.rollout.vllm.repacked import repacked_parameters
from rl_megatron.rollout.vllm.target import _plain_tensor_reads, _rpc_model, fp8_weights


def _rpc_parameters(worker: Any) -> dict[str, torch.Tensor]:
    # `.data`: vLLM's parameter subclasses as plain tensors of the same storage.
    return {name: p.data for name, p in worker.model_runner.model.named_parameters()}


def engine_parameters(
    engine: Any, leave_out: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """This rank's vLLM parameters, name → tensor, as its model runner holds them now
    (less `leave_out`)."""
    params = engine.llm.collective_rpc(_rpc_parameters)[0]
    return {n: t for n, t in params.items() if n not in leave_out}


def repacked_storage(engine: Any) -> frozenset[str]:
    """Parameters whose own storage vLLM repacked after loading (`repacked.py`): what they
    hold is the processed form of what was sent, not comparable bitwise, so the verifier
    leaves them out (counted `unreadable`). On the CPU build: every linear weight and the
    experts; on a GPU with unquantized weights on the Triton kernels: none; with
    `rollout.quantization: fp8`, the fp8 weights and scales."""
    from vllm.platforms import current_platform

    model = engine.llm.collective_rpc(_rpc_model)[0]
    found = repacked_parameters(model, current_platform.device_type)
    # FP8 weights and their scales hold the quantized form of what was sent: left out
    # too, until the verifier quantizes what it recomputes (not built yet).
    with _plain_tensor_reads():
        fp8, _ = fp8_weights(dict(model.named_parameters()))
    return frozenset([r.name for r in found if r.storage] + [*fp8, *fp8.values()])


def verifier_for(engine: Any, mode: VerifyMode, interval: int) -> SyncVerifier | None:
    """The engine's sync verifier for `rollout.verify_sync` (None when `off`: no reads)."""
    if mode == "off":
        return None
    repacked = repacked_storage(engine)
    return SyncVerifier(
        mode, interval=interval, read_engine=functools.partial(engine_parameters, engine, repacked)
    )
