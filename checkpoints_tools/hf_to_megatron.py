"""Convert a Hugging Face checkpoint (Llama / Qwen2 / Mistral) to a Megatron dist checkpoint.

    python checkpoints_tools/hf_to_megatron.py --hf-dir HF --out OUT --tp 2 --pp 2 [--vpp N]
        [--dtype bf16|fp16|fp32] [--force]
    torchrun --nproc_per_node 4 checkpoints_tools/hf_to_megatron.py ... --tp 2 --pp 2

The result is a `dist_checkpointing` checkpoint, resumable at any TP / PP; `--tp` fixes the
vocabulary padding (a multiple of `--make-vocab-size-divisible-by × tp`). Run alone, one
process converts the whole model; under torchrun with `tp × pp` processes each rank builds
and reads only its own shard (each HF tensor slice is read from disk by the rank that needs
it), so host memory per process is about 1/(tp·pp) of the model. A *ForSequenceClassification
checkpoint (reward model) is converted with its scalar head.

Inputs are checked before anything is written: config.json, the parallel layout, the
tokenizer's vocabulary against the embedding, and every safetensors header (names, shapes,
truncation). User errors print one line and exit with code 2; the output is written into a
hidden sibling directory, verified, and renamed only when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# Run as a script (python / torchrun): the shared helper sits next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402
import torch  # noqa: E402

from rl_megatron.checkpoint import hf_mapping as hm  # noqa: E402
from rl_megatron.checkpoint.conversions import padded_vocab_size  # noqa: E402
from rl_megatron.checkpoint.hf_export import (  # noqa: E402
    HF_AUX_FILES,
    check_output_dir,
    commit_output_dir,
    partial_dir,
)
from rl_megatron.checkpoint.hf_loader import CheckpointError, SafetensorsCheckpoint  # noqa: E402
from rl_megatron.models.hf_config import (  # noqa: E402
    check_parallel_layout,
    check_tokenizer_vocab,
    load_hf_config,
)

PROG = "hf_to_megatron"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", type=Path, required=True, help="HF model directory")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p.parse_args(argv)


def preflight(args: argparse.Namespace):
    """Check every input without writing anything; return the parsed HF config."""
    info = load_hf_config(args.hf_dir)
    check_parallel_layout(info, args.tp, args.pp, args.vpp)
    check_tokenizer_vocab(args.hf_dir, info)
    with SafetensorsCheckpoint(args.hf_dir) as ckpt:
        hm.check_hf_tensors(ckpt.shapes(), hm.rules_for(info, info.head), info)
    check_output_dir(args.out, args.force)
    _, size = common.world()
    if size not in (1, args.tp * args.pp):
        raise CheckpointError(f"WORLD_SIZE={size}: run one process or tp*pp={args.tp * args.pp}")
    return info


def convert(args: argparse.Namespace, info) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_loader import load_hf_weights
    from rl_megatron.models.builders import build_gpt_chunks

    start = time.time()
    common.init_distributed()
    rank, size = common.world()
    # One process builds the whole model at TP1·PP1: the stored tensors are global, so only
    # the vocabulary padding depends on the target TP, and it is set explicitly.
    tp, pp, vpp = (args.tp, args.pp, args.vpp) if size > 1 else (1, 1, None)
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    model_parallel_cuda_manual_seed(0)
    dtype = common.DTYPES[args.dtype]
    padded = padded_vocab_size(info.vocab_size, args.make_vocab_size_divisible_by, args.tp)
    chunks = build_gpt_chunks(
        info,
        tp=tp,
        pp=pp,
        vpp=vpp,
        dtype=dtype,
        padded_vocab=padded,
        value_head=info.head == "value",
        perform_initialization=False,
    )
    load_hf_weights(chunks, args.hf_dir, info, head=info.head, progress=rank == 0)

    tmp = partial_dir(args.out)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = (
        {"model": chunks[0].sharded_state_dict()}
        if len(chunks) == 1
        else {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    )
    dist_checkpointing.save(state, str(tmp))
    _verify(state, tmp)
    if rank == 0:
        _write_sidecar(args, info, tmp, dtype, padded)
        commit_output_dir(tmp, args.out)
        print(
            f"{PROG}: wrote {args.out} (tp={args.tp} pp={args.pp} vpp={args.vpp or 1}, "
            f"{args.dtype}, padded vocab {padded}) in {time.time() - start:.1f} s"
        )
    dist.barrier()


def _verify(state: dict, ckpt_dir: Path) -> None:
    """Every tensor this rank saved is in the checkpoint with its global shape and dtype."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    problem = ""
    for sub in state.values():
        for item in sub.values():
            if isinstance(item, ShardedTensorFactory) and item.key not in stored:
                problem = f"'{item.key}' is missing"
            if not isinstance(item, ShardedTensor):
                continue
            got = stored.get(item.key)
            if got is None:
                problem = f"'{item.key}' is missing"
            elif (tuple(got.global_shape), got.dtype) != (tuple(item.global_shape), item.dtype):
                problem = (
                    f"'{item.key}' stored as {tuple(got.global_shape)} {got.dtype}, "
                    f"expected {tuple(item.global_shape)} {item.dtype}"
                )
    bad = torch.tensor([1 if problem else 0])
    dist.all_reduce(bad)
    if problem:
        raise CheckpointError(f"{ckpt_dir}: verification failed: {problem}")
    if bad.item():
        raise CheckpointError(f"{ckpt_dir}: verification failed on another rank")


def _write_sidecar(args, info, tmp: Path, dtype: torch.dtype, padded: int) -> None:
    hf = tmp / common.HF_SUBDIR
    hf.mkdir()
    for name in ("config.json", *HF_AUX_FILES):
        if (args.hf_dir / name).is_file():
            shutil.copy2(args.hf_dir / name, hf / name)
    meta = {
        "format_version": common.FORMAT_VERSION,
        "head": info.head,
        "dtype": str(dtype).split(".")[-1],
        "padded_vocab_size": padded,
        "tp": args.tp,
        "pp": args.pp,
        "vpp": args.vpp,
        "source": str(args.hf_dir.resolve()),
    }
    (tmp / common.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return common.run_cli(
        PROG,
        lambda: preflight(args),
        lambda info: convert(args, info),
        lambda: shutil.rmtree(partial_dir(args.out), ignore_errors=True),
    )


if __name__ == "__main__":  # required: dist_checkpointing's writer spawns a process
    sys.exit(main())
