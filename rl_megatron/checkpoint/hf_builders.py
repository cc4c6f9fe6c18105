"""Build the four roles' models from an HF checkpoint: build (`models/builders`) + load.

* actor, reference: causal LM from an HF `*ForCausalLM` checkpoint.
* critic: the trunk with a scalar `ValueHead`, from the actor's checkpoint (head freshly
  initialised) or from a reward model's `*ForSequenceClassification` (`score.weight`).
* reward model: an HF `*ForSequenceClassification` checkpoint, frozen.

Each builder returns one model chunk per virtual pipeline stage of this rank (a list of
length 1 without VPP), built by `models.builders.build_gpt_chunks` without random init and
filled by `hf_loader.load_hf_weights`, at the run's `ParallelLayout` (megatron-core
initialised at it: `distributed.init_megatron`). On a machine without CUDA call
`rl_megatron.cpu_compat.enable_if_no_gpu()` first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.models.gpt import GPTModel

from rl_megatron.checkpoint.hf_loader import load_hf_weights
from rl_megatron.models.builders import ValueHead, build_gpt_chunks, mark_tensor_parallel_weights
from rl_megatron.models.hf_config import HFConfigError, load_hf_config
from rl_megatron.parallel import ParallelLayout


def _build(
    hf_dir: str | Path,
    head: str,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype,
    load: bool,
    head_seed: int = 0,
    **kwargs,
) -> list[GPTModel]:
    info = load_hf_config(hf_dir)
    chunks = build_gpt_chunks(
        info,
        layout,
        dtype=dtype,
        value_head=head != "lm",
        perform_initialization=not load,
        **kwargs,
    )
    for chunk in chunks:
        if isinstance(getattr(chunk, "output_layer", None), ValueHead) and (
            head == "none" or not load
        ):
            chunk.output_layer.reset_parameters(head_seed)
    if load:
        mark_tensor_parallel_weights(chunks)
        load_hf_weights(chunks, hf_dir, info, layout, head=head)
    return chunks


def _freeze(chunks: list[GPTModel]) -> list[GPTModel]:
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def build_actor(
    hf_dir: str | Path,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype = torch.bfloat16,
    load: bool = True,
    **kwargs,
) -> list[GPTModel]:
    """Actor: causal LM from an HF `*ForCausalLM` checkpoint (`load=False`: random init)."""
    return _build(hf_dir, "lm", layout, dtype=dtype, load=load, **kwargs)


def build_reference(
    hf_dir: str | Path,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype = torch.bfloat16,
    **kwargs,
) -> list[GPTModel]:
    """Reference policy: the actor's initial weights, in eval mode, without gradients."""
    return _freeze(_build(hf_dir, "lm", layout, dtype=dtype, load=True, **kwargs))


def build_critic(
    hf_dir: str | Path,
    layout: ParallelLayout,
    *,
    init_from: str = "actor",
    dtype: torch.dtype = torch.bfloat16,
    head_seed: int = 0,
    **kwargs,
) -> list[GPTModel]:
    """Critic: trunk + scalar value head.

    Args:
        hf_dir: the actor's HF checkpoint (`init_from="actor"`: the value head starts fresh,
            seeded by `head_seed`), or a reward model's *ForSequenceClassification
            checkpoint (`init_from="reward"`: its `score.weight` becomes the value head).
    """
    if init_from not in ("actor", "reward"):
        raise HFConfigError(f"critic init_from must be 'actor' or 'reward', got '{init_from}'")
    head = "none" if init_from == "actor" else "value"
    return _build(hf_dir, head, layout, dtype=dtype, load=True, head_seed=head_seed, **kwargs)


def build_reward_model(
    hf_dir: str | Path,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype = torch.bfloat16,
    **kwargs,
) -> list[GPTModel]:
    """Reward model from an HF `*ForSequenceClassification` checkpoint (one label), frozen.

    Its output is `[b, s, 1]`; the sequence's reward is the value at its last real token.
    """
    return _freeze(_build(hf_dir, "value", layout, dtype=dtype, load=True, **kwargs))
