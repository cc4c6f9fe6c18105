"""Reading the vLLM engine's parameters back for `rollout.verify_sync` (`resharding/verify.py`).

The engine's own parameters, fetched through its worker's model runner on every read
(`collective_rpc`, the in-process model object), never through the sync target's table or
the copy program's kept views: what generation will compute with, whatever the sync
believes it wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_megatron.resharding.verify import SyncVerifier, VerifyMode


def _rpc_parameters(worker: Any) -> dict[str, torch.Tensor]:
    # `.data`: vLLM's parameter subclasses as plain tensors of the same storage.
    return {name: p.data for name, p in worker.model_runner.model.named_parameters()}


def engine_parameters(engine: Any) -> Mapping[str, torch.Tensor]:
    """This rank's vLLM parameters, name → tensor, as its model runner holds them now."""
    return engine.llm.collective_rpc(_rpc_parameters)[0]


def verifier_for(engine: Any, mode: VerifyMode, interval: int) -> SyncVerifier | None:
    """The engine's sync verifier for `rollout.verify_sync` (None when `off`: no reads)."""
    if mode == "off":
        return None
    return SyncVerifier(mode, interval=interval, read_engine=lambda: engine_parameters(engine))
