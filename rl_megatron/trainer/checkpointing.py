"""A run's checkpoints: what each owner registered, saved and restored together.

    checkpoints = RunCheckpoints(CheckpointManager(run_dir / "checkpoints"), config.checkpoint)
    checkpoints.register_role("actor", roles.actor, sidecar=...)    # sharded: weights, optimizer
    checkpoints.register("sampler", sampler)                        # JSON: state_dict()
    checkpoints.save(step)                                          # collective
    step = checkpoints.resume(log)                                  # None: nothing to resume

Whoever owns state that a resumed run needs registers it once, by name: the roles (their
weights, optimizer state and LR-schedule position, through `checkpoint/training_state.py`,
with the sidecars that let `megatron_to_hf.py` export them) and any object with
`state_dict()` / `load_state_dict()` whose state is small and JSON-serialisable (the
sampler's data position, the KL controller). Nothing is passed positionally; adding state
to a checkpoint is one `register` call where the state is made.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from rl_megatron.checkpoint.hf_loader import CheckpointError
from rl_megatron.checkpoint.training_state import CheckpointManager
from rl_megatron.config import CheckpointConfig, Config
from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.parallel import ParallelLayout


class Checkpointable(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RunCheckpoints:
    """The run's checkpoint directory and the state registered to go into it.

    Args:
        manager: writes and reads the step directories (`CheckpointManager`).
        config: `checkpoint.*` (resume policy, verification, resharding).
    """

    def __init__(self, manager: CheckpointManager, config: CheckpointConfig) -> None:
        self.manager, self.config = manager, config
        self._roles: dict[str, Any] = {}
        self._sidecars: dict[str, dict] = {}
        self._hf_bases: dict[str, str] = {}
        self._states: dict[str, Checkpointable] = {}

    def register_role(
        self, name: str, role, sidecar: dict | None = None, hf_base: str | None = None
    ) -> None:
        """A trainable role: weights, optimizer state and step count, sharded; `sidecar`
        is its `rl_megatron.json` (`sidecars`). `hf_base`: for a role with LoRA adapters,
        the HF folder its frozen base was built from (`model.hf_path`), which its
        checkpoints reference; without one they reference a copy written once per run
        (`checkpoint/lora_base.py`)."""
        self._check_new(name)
        self._roles[name] = role
        if sidecar is not None:
            self._sidecars[name] = sidecar
        if hf_base is not None:
            self._hf_bases[name] = hf_base

    def register(self, name: str, owner: Checkpointable) -> None:
        """An object whose `state_dict()` (JSON-serialisable, the same on every rank) is
        saved under `name` and given back to its `load_state_dict` on resume."""
        self._check_new(name)
        self._states[name] = owner

    def _check_new(self, name: str) -> None:
        if name in self._roles or name in self._states:
            raise ValueError(f"checkpoint state {name!r} is registered twice")

    def save(self, step: int) -> Path:
        """Write checkpoint `step` (optimizer steps taken = the next step's index); collective.

        The manager reloads an offloaded role for its part of the save, one at a time, and
        logs where the checkpoint went.
        """
        states = {name: owner.state_dict() for name, owner in self._states.items()}
        return self.manager.save(
            step, self._roles, states, sidecar=self._sidecars, hf_bases=self._hf_bases
        )

    def resume(self, logger: logging.Logger) -> int | None:
        """Continue from `checkpoint.resume_from`, or the run's newest checkpoint (auto).

        Collective. Restores the roles and RNGs (through the manager, which verifies the
        files' checksums when `checkpoint.verify` and accepts another parallel layout when
        `checkpoint.allow_reshard`) and every registered state; returns the checkpoint's
        step, or None when there is nothing to resume from.
        """
        c = self.config
        path = None
        if c.resume_from is not None:
            path = Path(c.resume_from)
        elif c.resume == "auto":
            path = self.manager.latest()
        if path is None:
            return None
        step, states = self.manager.load(
            path,
            self._roles,
            allow_reshard=c.allow_reshard,
            verify=c.verify,
            hf_bases=self._hf_bases,
        )
        missing = sorted(set(self._states) - set(states))
        if missing:
            raise CheckpointError(f"{path}: holds no state for {', '.join(missing)}")
        for name, owner in self._states.items():
            owner.load_state_dict(states[name])
        logger.info("resumed from %s at step %d", path, step)
        return step


def remove_leftovers(run_dir: Path, logger: logging.Logger) -> None:
    """Delete what interrupted saves and HF exports of an earlier run left in `run_dir`
    (rank 0, under the run-directory lock, before anything else is written there): a run
    that died of a full disk gets its space back, and the last complete checkpoint stays."""
    from rl_megatron.checkpoint.step_dirs import remove_leftovers as remove

    for change in remove(run_dir / "checkpoints", run_dir / "hf", run_dir / "hf_adapter"):
        logger.info("start-up: %s (left by an interrupted save)", change)


def sidecar(config: Config, info: HFModelInfo, head: str, layout: ParallelLayout) -> dict:
    """A role's `rl_megatron.json`, so `megatron_to_hf.py` can export its checkpoint.

    head: "lm" (actor) or "value" (critic). layout: the run's; its record (every degree,
    as trainer_state.json's `layout`) says what the role was trained at, though
    megatron_to_hf.py reads none of them: the stored tensors are global.
    """
    m = config.model
    return {
        "format_version": 1,
        "head": head,
        "dtype": m.dtype,  # the manager writes torch's name, as checkpoints_tools do
        "padded_vocab_size": padded_vocab_size(
            info.vocab_size, m.make_vocab_size_divisible_by, layout.tp
        ),
        **layout.record(),
        "source": m.hf_path,
        # The actor's adapters' scale and dropout: megatron_to_hf.py merges the adapters
        # (W + alpha/rank·B·A) or, with --adapter-only, writes them as a PEFT folder.
        **({"lora": _lora_record(config)} if head == "lm" and config.actor.lora.rank else {}),
    }


def _lora_record(config: Config) -> dict:
    lora = config.actor.lora
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout}
