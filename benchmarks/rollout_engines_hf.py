"""`rollout_bench.py`'s transformers engines: `hf` (eager, dynamic KV cache) and `hf-static`
(static cache; transformers compiles the decode step itself on a GPU)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from bench_utils import free_memory
from rollout_common import KEYS, bench_batches, device, free_gib


def bench_transformers(ckpt: Path, prompt_ids: torch.Tensor, args, result, static: bool):
    from transformers import AutoModelForCausalLM

    name = KEYS["hf-static" if static else "hf"]
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype))
    model = model.to(device())
    model.generation_config.eos_token_id = None
    info: dict[str, Any] = {"startup_s": time.perf_counter() - start}
    kwargs: dict[str, Any] = dict(
        max_new_tokens=args.max_new, min_new_tokens=args.max_new, do_sample=False, pad_token_id=0
    )
    if static:
        from transformers import CompileConfig

        # transformers compiles the decode step itself when the cache is static and the
        # device supports it (GenerationMixin._valid_auto_compile_criteria).
        compile_config = CompileConfig(mode="reduce-overhead")
        kwargs.update(cache_implementation="static", compile_config=compile_config)
        info["compile_config"] = compile_config.to_dict()
        torch._dynamo.utils.counters.clear()

    def run(b: int) -> list[list[int]]:
        ids = prompt_ids[:b].to(device())
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[:, ids.shape[1] :].tolist()

    try:
        tokens = bench_batches(name, run, args, result)
    finally:
        if static:
            # Set by PreTrainedModel.get_compiled_call when generate compiled the step.
            info["compiled"] = hasattr(model, "_compiled_call")
            info["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
            torch._dynamo.reset()
        model = None  # the closure holds the name; this drops the weights
        free_memory()
    info["free_gib_after"] = free_gib()
    result[name] = info
    return tokens
