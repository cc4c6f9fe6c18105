"""A random Hugging Face checkpoint of a shape, for GPU steps that need `model.hf_path`.

Most benchmarks run a random init (vLLM starts from dummy weights and the first sync puts
the actor's in). `rollout.lora_sync: adapter` cannot: vLLM must load the frozen base
itself (rollout/vllm/lora_sync.py), so its steps first write one with this script
(`rollout_bench.make_checkpoint`: initialised on the GPU when there is one, saved in
`--dtype`), then run the trainer with `model.hf_path` pointing at it.

    python3 benchmarks/random_checkpoint.py --out /tmp/llama8b_random --layers 32 \\
        --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 \\
        --dtype bfloat16 --prompt-len 512 --max-new 1024

`--prompt-len` + `--max-new` (+ 16) set `max_position_embeddings`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_bench import make_checkpoint, parse_args  # noqa: E402


def main() -> None:
    args = parse_args([("--out", {"type": Path, "required": True})])
    start = time.perf_counter()
    make_checkpoint(args.out, args)
    config = json.loads((args.out / "config.json").read_text())
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(
        f"{args.out}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{size / 2**30:.1f} GiB of weights in {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
