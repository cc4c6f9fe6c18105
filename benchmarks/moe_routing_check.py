"""Does the rollout engine record the experts it routed to? vLLM's routing against HF's.

Issue 19 (routing replay, R3): with `actor.router_replay: true` the trainer replays the
experts vLLM chose for every token (`RolloutBatch.routed_experts`, from vLLM's
`enable_return_routed_experts`). The replay itself is tested on CPU
(`tests/multirank/test_router_replay.py`); vLLM's CPU build records no routing, so what it
records is checked here, on a GPU: the trainer's `VllmEngine` generates greedily from a
random Qwen3-MoE checkpoint, and `transformers` runs each whole row (prompt + response)
once with `output_router_logits`; per (token, layer), the top-k set of HF's router logits
is compared with the set vLLM recorded. Both compute in bf16 with different kernels, so a
near-tie may flip: the report is the fraction of (token, layer) pairs whose sets agree,
and the fraction of pairs whose HF top-k margin (k-th minus (k+1)-th logit) is below
1e-2, where flips are expected. Layer order, token alignment (the last sampled token has
no routing) or expert numbering gone wrong would give agreement near chance (k/E).

GPU (vLLM 0.26):

    torchrun --standalone --nproc_per_node 1 benchmarks/moe_routing_check.py \\
        --out-json $OUT/moe_routing_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def make_checkpoint(path: Path, args) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    # A wider router init than HF's 0.02: logits that separate the experts clearly, so
    # that bf16 kernel differences flip few sets.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def hf_top_k(path: Path, rows: list[list[int]], k: int) -> tuple[list[torch.Tensor], list]:
    """Per row: `[tokens, layers, k]` HF top-k experts, and `[tokens, layers]` margins."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    sets, margins = [], []
    with torch.no_grad():
        for row in rows:
            out = model(torch.tensor([row], device=device), output_router_logits=True)
            logits = torch.stack([r.float() for r in out.router_logits], dim=1)  # [T, L, E]
            top = logits.topk(k + 1, dim=-1)
            sets.append(top.indices[..., :k].cpu())
            margins.append((top.values[..., k - 1] - top.values[..., k]).cpu())
    return sets, margins


def agreement(batch, rows, hf_sets, hf_margins) -> tuple[int, int, int]:
    """(pairs whose sets agree, pairs, near-tie pairs) over every recorded (token, layer)."""
    routed = batch.routed_experts  # [B, P+R, L, k], aligned with the left-padded rows
    p_width = batch.prompts.shape[1]
    agree = total = near_tie = 0
    for i, row in enumerate(rows):
        start = p_width - int(batch.prompt_lengths[i])
        n = len(row) - 1  # vLLM never forwards the last sampled token
        vllm_sets = routed[i, start : start + n].long()
        same = (vllm_sets.sort(-1).values == hf_sets[i][:n].sort(-1).values).all(-1)  # [n, L]
        agree += int(same.sum())
        total += same.numel()
        near_tie += int((hf_margins[i][:n] < 1e-2).sum())
    return agree, total, near_tie


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--out-json", type=Path, default=None)
    args = p.parse_args()

    from rl_megatron.rollout.sampling import SamplingParams
    from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    result: dict = {"benchmark": "moe_routing_check", "args": vars(args) | {"out_json": None}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        make_checkpoint(ckpt, args)
        engine = VllmEngine(
            VllmEngineArgs(
                model=str(ckpt),
                dtype="bfloat16",
                max_model_len=args.prompt_len + args.max_new,
                gpu_memory_utilization=0.2,
                enable_sleep_mode=False,
                enforce_eager=True,
                calculate_log_probs=False,
                return_routed_experts=True,
            )
        )
        sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new, ignore_eos=True)
        batch = engine.generate(prompts, sampling)
        routed = batch.routed_experts  # [B, P+R, L, k], -1 where none was recorded
        rows = [sum(batch.row_tokens(i), []) for i in range(len(batch))]
        if routed is None:
            raise RuntimeError("the engine returned no routing (RolloutBatch.routed_experts)")
        hf_sets, hf_margins = hf_top_k(ckpt, rows, args.topk)
    agree, total, near_tie = agreement(batch, rows, hf_sets, hf_margins)
    result.update(
        pairs=total,
        agree_frac=agree / total,
        near_tie_frac=near_tie / total,
        chance_frac=1.0 / math.comb(args.experts, args.topk),  # a random set's agreement
        routed_shape=list(routed.shape),
    )
    print(json.dumps(result, indent=1), flush=True)
    if args.out_json:
        args.out_json.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
