"""How long a response one GRPO training step fits, and its tokens/s (issue 22).

The actor's two passes of a GRPO step — old log-probs (`forward_only`, with entropy) and
one optimizer step (`train_step`, PPO clip loss, token-mean) — on `--rows` sequences of a
`--prompt-len` prompt and an L-token response, one sequence per micro-batch, for growing L
until the device runs out of memory. Settings compared (each its own actor, built afresh):

* `full_logits`: `model.logprob_chunk_tokens=0` — the output layer makes `[s, V/tp]`
  logits for every position of the micro-batch (the path before issue 22);
* `chunked`: log-probs and entropy from the final hidden states, `--chunk` tokens at a time
  (`models/chunked_logprobs.py`), only at response positions;
* `recompute`: full logits, `actor.recompute.granularity=full` (every layer keeps its input);
* `chunked+recompute`: both.

Per (setting, L): peak allocated memory of each pass (`max_memory_allocated`), seconds, and
tokens/s over both passes (prompt + response tokens, no padding). A pass that raises
`torch.cuda.OutOfMemoryError` ends that setting's sweep. Generation is not part of it: at
these lengths the training forward, not the engine, decides what fits (vLLM's KV cache is
a config setting, `rollout.gpu_memory_utilization`).

GPU (one H200, ~1.5B Qwen2.5 shape: 28 layers, hidden 1536, 12/2 heads, FFN 8960, vocab
151936, tied embeddings, bf16):

    python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
        benchmarks/long_response_bench.py --lengths 4096,8192,16384,32768,49152,65536 \
        --out-json $OUT/long_response_h200_1.5b.json

CPU smoke test (a tiny shape, seconds): add `--tiny --lengths 64,128`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
from pathlib import Path

import torch

SETTINGS = {
    "full_logits": ["model.logprob_chunk_tokens=0"],
    "chunked": [],
    "recompute": ["model.logprob_chunk_tokens=0", "actor.recompute.granularity=full"],
    "chunked+recompute": ["actor.recompute.granularity=full"],
}
SHAPE_1P5B = [
    "model.num_layers=28",
    "model.hidden_size=1536",
    "model.num_attention_heads=12",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=8960",
    "model.vocab_size=151936",
    "model.tie_word_embeddings=true",
    "model.dtype=bf16",
]
SHAPE_TINY = ["model.dtype=fp32"]  # tiny_cpu.yaml's shape


def _batch(rows: int, prompt: int, response: int, vocab: int, device) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (rows, prompt), generator=gen)
    responses = torch.randint(1, vocab, (rows, response), generator=gen)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    return {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1),
        "response_mask": torch.ones(rows, response, dtype=torch.long),
        "advantages": torch.randn(rows, response, generator=gen),
    }


def _loss(out, mb, totals):
    from rl_megatron.algorithms.losses import policy_loss

    return policy_loss(
        out["log_prob"], mb["old_log_prob"], mb["advantages"], mb["response_mask"],
        0.2, 0.2, 3.0, "token-mean", totals=totals,
    )  # fmt: skip


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return out, time.perf_counter() - start, peak


def sweep(name: str, overrides: list[str], args, run) -> list[dict]:
    from rl_megatron.config import load_config
    from rl_megatron.trainer.build import build_roles, model_info

    longest = max(args.lengths)
    config = load_config(
        "yaml_configs/tiny_cpu.yaml",
        [
            "parallel.tp=1", "rollout.tp=1", "rollout.engine=megatron",
            f"model.max_position_embeddings={args.prompt_len + longest}",
            f"rollout.max_prompt_length={args.prompt_len}",
            f"rollout.max_response_length={longest}",
            f"model.logprob_chunk_tokens={args.chunk}",
            f"actor.mini_batch_size={args.rows}", "actor.micro_batch_size=1",
            "data.train_batch_size=1", f"rollout.n={args.rows}",
            *(SHAPE_TINY if args.tiny else SHAPE_1P5B), *overrides,
        ],
    )  # fmt: skip
    info = model_info(config)
    rows = []
    actor = build_roles(config, info, 10, run.groups).actor
    try:
        for length in args.lengths:
            row = {
                "setting": name,
                "response_len": length,
                "tokens": args.rows * (args.prompt_len + length),
            }
            batch = _batch(args.rows, args.prompt_len, length, info.vocab_size, run.device)
            try:
                out, row["old_log_probs_s"], row["old_log_probs_peak_gib"] = _timed(
                    lambda b=batch: actor.forward_only(b, with_entropy=True)
                )
                batch["old_log_prob"] = out["log_prob"].cpu()
                _, row["train_step_s"], row["train_step_peak_gib"] = _timed(
                    lambda b=batch: actor.train_step(b, _loss, with_entropy=True)
                )
                row["tokens_per_s"] = row["tokens"] / (row["old_log_probs_s"] + row["train_step_s"])
            except torch.cuda.OutOfMemoryError as exc:
                row["oom"] = str(exc).splitlines()[0][:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
            batch = None  # free it before the next length's
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if "oom" in row:
                break
    finally:
        actor = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=2, help="sequences (one per micro-batch)")
    parser.add_argument("--chunk", type=int, default=4096, help="logprob_chunk_tokens when on")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]

    from rl_megatron.distributed import distributed_run
    from rl_megatron.parallel import ParallelLayout

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "out_json"},
        "rows": [],
    }
    with distributed_run(ParallelLayout(tp=1, pp=1, dp=1), seed=0) as run:
        for name in args.settings.split(","):
            result["rows"] += sweep(name, SETTINGS[name], args, run)
    longest = {}
    for row in result["rows"]:
        if "oom" not in row:
            longest[row["setting"]] = max(longest.get(row["setting"], 0), row["response_len"])
    result["longest_fitting_response"] = longest
    print("longest response that fits:", longest)
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
