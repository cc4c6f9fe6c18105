"""What a PPO checkpoint holds besides the roles, and where a run resumes from.

    checkpointing.save(manager, step, roles, sampler, kl_ctrl, total_steps, config, info)
    step = checkpointing.resume(manager, config, roles, sampler, kl_ctrl, log)

The roles' weights, optimizers and RNGs are `checkpoint/training_state.py`'s job; here is
the loop's own state (step, data position, KL coefficient) and the per-role sidecars that
let `megatron_to_hf.py` export a checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rl_megatron.algorithms.kl import AdaptiveKLController, FixedKLController
from rl_megatron.checkpoint.training_state import CheckpointManager
from rl_megatron.config import Config
from rl_megatron.data.sampler import PromptSampler
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.trainer.build import Roles

KLController = FixedKLController | AdaptiveKLController


def save(
    manager: CheckpointManager,
    step: int,
    roles: Roles,
    sampler: PromptSampler,
    kl_ctrl: KLController,
    total_steps: int,
    config: Config,
    info: HFModelInfo,
) -> None:
    """Write checkpoint `step`: the trainable roles, the trainer state, the sidecars.

    Collective. `step` is the number of optimizer steps taken (the next step's index).
    """
    # The manager reloads an offloaded role for its part of the save, one at a time,
    # and logs where the checkpoint went.
    manager.save(
        step,
        roles.trainable(),
        trainer_state(step, sampler, kl_ctrl, total_steps),
        sidecar=sidecars(config, info, roles),
    )


def resume(
    manager: CheckpointManager,
    config: Config,
    roles: Roles,
    sampler: PromptSampler,
    kl_ctrl: KLController,
    logger: logging.Logger,
) -> int | None:
    """Continue from `checkpoint.resume_from`, or the run's newest checkpoint (auto).

    Collective. Restores the trainable roles and RNGs (through `manager`, which verifies
    the files' checksums when `checkpoint.verify` and accepts another parallel layout when
    `checkpoint.allow_reshard`), the sampler's data position and the KL coefficient;
    returns the checkpoint's step, or None when there is nothing to resume from.
    """
    c = config.checkpoint
    path = None
    if c.resume_from is not None:
        path = Path(c.resume_from)
    elif c.resume == "auto":
        path = manager.latest()
    if path is None:
        return None
    step, state = manager.load(
        path, roles.trainable(), allow_reshard=c.allow_reshard, verify=c.verify
    )
    sampler.load_state_dict(state["sampler"])
    kl_ctrl.load_state_dict(state["kl_ctrl"])
    logger.info("resumed from %s at step %d", path, step)
    return step


def trainer_state(
    step: int, sampler: PromptSampler, kl_ctrl: KLController, total_steps: int
) -> dict:
    """The loop's own state, stored in `trainer_state.json` (JSON-serialisable)."""
    return {
        "step": step,
        "sampler": sampler.state_dict(),
        "kl_ctrl": kl_ctrl.state_dict(),
        "total_steps": total_steps,
    }


def sidecars(config: Config, info: HFModelInfo, roles: Roles) -> dict[str, dict]:
    """`rl_megatron.json` per role, so `megatron_to_hf.py` can export the checkpoint."""
    from rl_megatron.checkpoint.conversions import padded_vocab_size

    p, m = config.parallel, config.model
    common = {
        "format_version": 1,
        "dtype": m.dtype,  # the manager writes torch's name, as checkpoints_tools do
        "padded_vocab_size": padded_vocab_size(
            info.vocab_size, m.make_vocab_size_divisible_by, p.tp
        ),
        "tp": p.tp,
        "pp": p.pp,
        "vpp": p.vpp,
        "source": m.hf_path,
    }
    out = {"actor": {**common, "head": "lm"}}
    if roles.critic is not None:
        out["critic"] = {**common, "head": "value"}
    return out
