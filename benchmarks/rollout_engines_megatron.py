"""`rollout_bench.py`'s Megatron engines: the actor built as the trainer builds it, and
`MegatronEngine` generating from its modules, with and without CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from rollout_common import KEYS, batch_tokens, bench_batches, greedy, max_model_len

from rl_megatron.parallel import ParallelLayout


def build_megatron_actor(ckpt: Path, args) -> list[torch.nn.Module]:
    """The actor as the trainer builds it from an HF checkpoint (TP = world, PP = 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron import cpu_compat
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.resharding.layouts import MEGATRON_RANK_ORDER

    cpu_compat.enable_if_no_gpu()
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(world, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    chunks = build_actor(
        str(ckpt), ParallelLayout.from_megatron(), dtype=getattr(torch, args.dtype)
    )
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    return chunks


def bench_megatron(
    chunks, info, prompts, args, result, graphs: bool = True
) -> dict[int, list[list[int]]]:
    from rl_megatron.rollout.megatron.engine import MegatronEngine

    engine = MegatronEngine(
        chunks,
        info,
        max_model_len=max_model_len(args),
        max_batch_size=max(args.batches),
        use_cuda_graphs=graphs,
    )
    sampling = greedy(args)
    return bench_batches(
        KEYS["megatron" if graphs else "megatron-eager"],
        lambda b: batch_tokens(engine.generate(prompts[:b], sampling)),
        args,
        result,
    )
