"""Convert a Megatron dist checkpoint (from hf_to_megatron.py) back to a Hugging Face model.

    python checkpoints_tools/megatron_to_hf.py --ckpt CKPT --out HF [--dtype bf16|fp16|fp32]
        [--force] [--max-shard-gb 2]
    torchrun --nproc_per_node N checkpoints_tools/megatron_to_hf.py ...   # PP = N

The checkpoint is loaded at TP1 with its layers split over the processes (pipeline
stages), so each process holds 1/N of the model; stage by stage, tensors are converted and
sent to rank 0, which writes safetensors shards of at most `--max-shard-gb` as it goes.
The result (shards + index, config.json, generation_config.json, tokenizer files) loads with
`AutoModelForCausalLM.from_pretrained` (or *ForSequenceClassification for a reward model) and
with vLLM. It is written into a hidden sibling directory, verified (tensor count, shapes,
dtypes) and renamed only when complete; user errors print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

# Run as a script (python / torchrun): the shared helper sits next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402
import torch  # noqa: E402

from rl_megatron.checkpoint.hf_export import check_output_dir, partial_dir  # noqa: E402
from rl_megatron.checkpoint.hf_loader import CheckpointError  # noqa: E402
from rl_megatron.models.hf_config import load_hf_config  # noqa: E402

PROG = "megatron_to_hf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="Megatron checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="output HF directory")
    p.add_argument(
        "--dtype",
        choices=sorted(common.DTYPES),
        default=None,
        help="dtype of the written tensors (default: the checkpoint's)",
    )
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p.parse_args(argv)


def preflight(args: argparse.Namespace):
    meta = common.read_meta(args.ckpt)
    info = load_hf_config(args.ckpt / common.HF_SUBDIR)
    if not (args.ckpt / "metadata.json").is_file():
        raise CheckpointError(f"{args.ckpt}: no dist_checkpointing metadata.json")
    _, size = common.world()
    if info.num_layers % size:
        raise CheckpointError(
            f"num_hidden_layers={info.num_layers} is not divisible by the "
            f"{size} processes (pipeline stages)"
        )
    check_output_dir(args.out, args.force)
    return meta, info


def convert(args: argparse.Namespace, meta: dict, info) -> None:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.models.builders import build_gpt_chunks

    start = time.time()
    common.init_distributed()
    rank, size = common.world()
    parallel_state.initialize_model_parallel(1, size)
    model_parallel_cuda_manual_seed(0)
    ckpt_dtype = getattr(torch, meta["dtype"])
    chunks = build_gpt_chunks(
        info,
        tp=1,
        pp=size,
        dtype=ckpt_dtype,
        padded_vocab=meta["padded_vocab_size"],
        value_head=meta["head"] == "value",
        perform_initialization=False,
    )
    model = chunks[0]
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(args.ckpt))
    result = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{args.ckpt}: checkpoint lacks '{missing[0]}'")
    dtype = common.DTYPES[args.dtype] if args.dtype else ckpt_dtype
    save_hf_checkpoint(
        chunks,
        info,
        args.out,
        src_dir=args.ckpt / common.HF_SUBDIR,
        head=meta["head"],
        dtype=dtype,
        force=args.force,
        max_shard_bytes=int(args.max_shard_gb * 1024**3),
        progress=rank == 0,
    )
    if rank == 0:
        print(
            f"{PROG}: wrote {args.out} ({str(dtype).split('.')[-1]}) in {time.time() - start:.1f} s"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return common.run_cli(
        PROG,
        lambda: preflight(args),
        lambda plan: convert(args, *plan),
        lambda: shutil.rmtree(partial_dir(args.out), ignore_errors=True),
    )


if __name__ == "__main__":  # required: dist_checkpointing spawns a process
    sys.exit(main())
