"""Convert a Hugging Face checkpoint (Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE / Mixtral)
to Megatron dist format.

    python checkpoints_tools/hf_to_megatron.py --hf-dir HF --out OUT --tp 2 --pp 2 [--vpp N]
        [--ep N --etp N] [--dtype bf16|fp16|fp32] [--force]
    torchrun --nproc_per_node 4 checkpoints_tools/hf_to_megatron.py ... --tp 2 --pp 2
    torchrun --nproc_per_node 2 checkpoints_tools/hf_to_megatron.py ... --ep 2   # MoE

The result is a `dist_checkpointing` checkpoint, resumable at any TP / PP; `--tp` fixes the
vocabulary padding (a multiple of `--make-vocab-size-divisible-by × tp`). Run alone, one
process converts the whole model; under torchrun with `tp × pp` processes each rank writes
its own shard (with experts split wider than tp, `--ep`·`--etp` > tp, the expert-parallel
ranks span data-parallel ranks as in training: ep·etp·pp processes; each expert is written
by the rank holding it). A *ForSequenceClassification checkpoint (reward model) is converted with its
scalar head.

Streaming: the Megatron model is built on the meta device, only for its sharded state dict
(the exact keys, shapes and shardings the trainer will load). The checkpoint writer asks for
one tensor at a time; each is then read from safetensors (only this rank's slice), converted
(QKV interleave, gate/up fuse, vocabulary padding), written and dropped. Host memory stays
near one Megatron parameter (plus its HF slices), whatever the size of the model.

Inputs are checked before anything is written: config.json, the parallel layout, the
tokenizer's vocabulary against the embedding, and every safetensors header (names, shapes,
truncation); `--out` may not be, contain or lie inside `--hf-dir`. User errors print one
line and exit with code 2; the output is written into a hidden sibling directory, verified,
and renamed only when complete. Every file is hashed (CRC-32) as it is written; rank 0
gathers the entries into `manifest.json`, which megatron_to_hf.py and the trainer check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

# Run as a script (python / torchrun): the shared helper sits next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from rl_megatron.checkpoint import hf_mapping as hm  # noqa: E402
from rl_megatron.checkpoint import integrity, safe_metadata  # noqa: E402
from rl_megatron.checkpoint.hf_export import (  # noqa: E402
    HF_AUX_FILES,
    check_output_dir,
    commit_output_dir,
    partial_dir,
)
from rl_megatron.checkpoint.hf_loader import (  # noqa: E402
    CheckpointError,
    SafetensorsCheckpoint,
    iter_rule_params,
    unwrap,
)
from rl_megatron.models.conversions import padded_vocab_size  # noqa: E402
from rl_megatron.models.hf_config import (  # noqa: E402
    check_parallel_layout,
    check_tokenizer_vocab,
    load_hf_config,
)
from rl_megatron.parallel import ParallelGroups, ParallelLayout  # noqa: E402
from rl_megatron.utils.disk_space import DiskFullError, is_disk_full, no_space_line

PROG = "hf_to_megatron"
# Seconds a collective of the conversion may wait (megatron-core's default, 30 minutes).
INIT_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", type=Path, required=True, help="HF model directory")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=1, help="expert-tensor-parallel size (MoE)")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p.parse_args(argv)


def preflight(args: argparse.Namespace):
    """Check every input without writing anything; return the parsed HF config."""
    check_output_dir(args.out, args.force, src=args.hf_dir)
    info = load_hf_config(args.hf_dir)
    check_parallel_layout(info, args.tp, args.pp, args.vpp, args.ep, args.etp)
    check_tokenizer_vocab(args.hf_dir, info)
    with SafetensorsCheckpoint(args.hf_dir) as ckpt:
        hm.check_hf_tensors(ckpt.shapes(), hm.rules_for(info, info.head), info)
    if args.pp > 1 and info.is_moe and args.ep * args.etp != args.tp:
        raise CheckpointError(
            f"--ep {args.ep} --etp {args.etp} with --pp {args.pp}: megatron-core needs "
            f"ep*etp = tp={args.tp} when pipelining (rank order tp-cp-ep-pp-dp)"
        )
    _, size = common.world()
    if size != 1 and size != _world_needed(args):
        raise CheckpointError(
            f"WORLD_SIZE={size}: run one process or {_world_needed(args)} (tp*pp, times "
            f"what ep*etp={args.ep * args.etp} needs beyond tp)"
        )
    return info


def _world_needed(args: argparse.Namespace) -> int:
    """Processes of a parallel conversion: tp·pp, or more when the experts are split wider
    than tp (expert parallelism then spans data-parallel ranks, as in training)."""
    base = args.tp * args.pp
    expert = args.ep * args.etp * args.pp
    return base * expert // math.gcd(base, expert)


def convert(args: argparse.Namespace, info) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.distributed import init_megatron

    start = time.time()
    common.init_distributed()
    rank, size = common.world()
    layout = _layout(args, info, size)
    init_megatron(layout, INIT_TIMEOUT_S)
    ParallelGroups.from_megatron(layout)  # checks the layout's rank arithmetic: tp, etp ranks
    model_parallel_cuda_manual_seed(0)
    dtype = common.DTYPES[args.dtype]
    padded = padded_vocab_size(info.vocab_size, args.make_vocab_size_divisible_by, args.tp)
    chunks, state = _meta_template(info, layout, dtype=dtype, padded=padded)

    try:
        tmp = partial_dir(args.out)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        ckpt = SafetensorsCheckpoint(args.hf_dir)
        source = _Source(chunks, state, ckpt, info, padded, layout)
        strategy = _streaming_save(source, rank == 0)
        dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy)
        _verify(state, tmp)
        per_rank: list = [None] * size  # each rank's files, hashed as they were written
        dist.all_gather_object(per_rank, strategy.files)
        if rank == 0:
            written = {rel: entry for files in per_rank for rel, entry in files.items()}
            written.update(_write_sidecar(args, info, tmp, dtype, padded))
            integrity.write_manifest(tmp, integrity.complete_entries(tmp, written))
            commit_output_dir(tmp, args.out)
            print(
                f"{PROG}: wrote {args.out} (tp={args.tp} pp={args.pp} vpp={args.vpp or 1}, "
                f"{args.dtype}, padded vocab {padded}) in {time.time() - start:.1f} s"
            )
        dist.barrier()
    except OSError as exc:  # a full disk: one line (run_cli removes the partial output)
        if not is_disk_full(exc):
            raise
        raise DiskFullError(no_space_line(args.out, _state_bytes(state))) from None


def _layout(args: argparse.Namespace, info, size: int) -> ParallelLayout:
    """The layout this conversion runs at. One process writes the whole model at TP1·PP1:
    the stored tensors are global, so only the vocabulary padding depends on the target
    TP, and it is set explicitly. More processes: the target's tp·pp, data parallelism
    over the rest (what ep·etp needs beyond tp: `_world_needed`)."""
    if size == 1:
        return ParallelLayout(tp=1, pp=1, dp=1, etp=1 if info.is_moe else None)
    return ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        dp=size // (args.tp * args.pp),
        vpp=args.vpp,
        ep=args.ep,
        etp=args.etp if info.is_moe else None,
    )


def _state_bytes(state: dict) -> int:
    """What the checkpoint's tensors take: each key's global shape at its dtype, once."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sizes = {
        t.key: math.prod(t.global_shape) * t.dtype.itemsize
        for t in nested_values(state)
        if isinstance(t, ShardedTensor)
    }
    return sum(sizes.values())


# ---------------------------------------------------------------- the model, on meta


class _AllOnMeta(TorchFunctionMode):
    """Every tensor a model builder creates goes to the meta device (no memory, no data).

    `torch.device("meta")` alone only covers factory calls without a `device`; megatron-core
    passes one explicitly (the CPU or the current GPU) and moves modules with `.cuda()`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = "meta"
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to:  # keep a dtype change, drop a device move
            args = tuple(a for a in args if not isinstance(a, (str, torch.device, int)))
            kwargs.pop("device", None)
        return func(*args, **kwargs)


def _meta_template(info, layout: ParallelLayout, *, dtype: torch.dtype, padded: int):
    """This rank's model chunks on the meta device, and their sharded state dict.

    The state dict is exactly what the trainer saves and loads (`model`, or `model0`,
    `model1`, ... with VPP), with meta tensors in place of data.
    """
    from rl_megatron.models.builders import build_gpt_chunks

    with torch.device("meta"), _AllOnMeta():
        chunks = build_gpt_chunks(
            info,
            layout,
            dtype=dtype,
            padded_vocab=padded,
            value_head=info.head == "value",
            perform_initialization=False,
        )
    if len(chunks) == 1:
        return chunks, {"model": chunks[0].sharded_state_dict()}
    return chunks, {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


class _Source:
    """Builds, on request, each tensor this rank stores, from the HF checkpoint.

    Expands the state dict's factories (e.g. `linear_fc1`'s gate/up split) in place into
    plain ShardedTensors, and remembers for each one that this rank writes (main replicas)
    the model parameter it comes from: `produce` then reads that parameter's TP shard
    (`hf_to_megatron_shard`), rebuilds the factory on it if there was one, and returns the
    requested piece. Only the last parameter is cached (gate and up are written in a row).
    """

    def __init__(
        self,
        chunks,
        state: dict,
        ckpt: SafetensorsCheckpoint,
        info,
        padded: int,
        layout: ParallelLayout,
    ):
        from megatron.core.dist_checkpointing.dict_utils import (
            dict_list_map_inplace,
            nested_values,
        )
        from megatron.core.dist_checkpointing.mapping import (
            ShardedTensor,
            ShardedTensorFactory,
            is_main_replica,
        )

        self.ckpt, self.info, self.padded = ckpt, info, padded
        import torch.distributed as dist

        rank = dist.get_rank()
        self.tp, self.tp_rank = layout.tp, layout.coordinates(rank)["tp"]
        self.etp = (layout.expert_tp, layout.expert_coordinates(rank)["etp"])
        rules = hm.rules_for(info, info.head)
        of_param = {
            id(param): (rule, layer)
            for chunk in chunks
            for rule, layer, param in iter_rule_params(unwrap(chunk), rules)
        }
        # (key, global offset) → (write order, rule, layer, factory or None, ShardedTensor)
        self.origins: dict[tuple[str, tuple[int, ...]], tuple] = {}

        def remember(leaf, factory) -> None:
            if not isinstance(leaf, ShardedTensor) or not is_main_replica(leaf.replica_id):
                return
            origin = of_param.get(id(factory.data if factory else leaf.data))
            if origin is None:
                raise hm.MappingError(f"checkpoint tensor '{leaf.key}' has no HF source")
            offset = tuple(leaf.global_offset)
            self.origins[(leaf.key, offset)] = (len(self.origins), *origin, factory, leaf)

        def expand(x):
            if isinstance(x, ShardedTensorFactory):
                built = x.build()
                for leaf in nested_values(built) if isinstance(built, (list, dict)) else [built]:
                    remember(leaf, x)
                return built
            remember(x, None)
            return x

        dict_list_map_inplace(expand, state)
        self._cached: tuple = (None, None)

    def order(self, fqn: str, offset: tuple[int, ...]) -> int:
        return self.origins[(fqn, offset)][0]

    def produce(self, fqn: str, offset: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The data of stored chunk (`fqn`, `offset`), shaped `sizes` (prepended axes incl.)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        _, rule, layer, factory, leaf = self.origins[(fqn, offset)]
        if self._cached[0] != (rule.megatron, layer):
            self._cached = (None, None)  # drop the previous parameter before reading this one
            size, rank = hm.shard_coords(rule, (self.tp, self.tp_rank), self.etp)
            shard = hm.hf_to_megatron_shard(
                rule, layer, self.ckpt.read, self.info, size, rank, self.padded
            )
            self._cached = ((rule.megatron, layer), shard.to(leaf.dtype))
        data = self._cached[1]
        if factory is not None:
            built = factory.build_fn(factory.key, data, factory.replica_id, factory.flattened_range)
            built = nested_values(built) if isinstance(built, (list, dict)) else [built]
            data = next(t.data for t in built if (t.key, tuple(t.global_offset)) == (fqn, offset))
        if tuple(data.shape) != tuple(leaf.local_shape):
            raise hm.MappingError(
                f"'{fqn}' at {list(offset)}: {list(data.shape)} from the checkpoint, the "
                f"model expects {list(leaf.local_shape)}"
            )
        data = data.reshape(sizes)
        # torch.save writes a view's whole storage: give the chunk a storage of its own.
        if not data.is_contiguous() or data.untyped_storage().nbytes() != data.nbytes:
            data = data.clone(memory_format=torch.contiguous_format)
        return data


# ------------------------------------------------- torch_dist save, one tensor at a time


def _streaming_save(source: _Source, progress: bool):
    """A torch_dist save strategy that asks `source` for each tensor as it writes it.

    The classes are defined here because their megatron-core bases import slowly: input
    errors are reported before that import.
    """
    import inspect

    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.api import _wrap_exception
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    class Planner(MCoreSavePlanner):
        """megatron-core's planner, asking `source` for each tensor's data when it is written."""

        def __init__(self, source: _Source) -> None:
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
            self.source = source

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            index = write_item.index
            sizes = tuple(write_item.tensor_data.chunk.sizes)
            return self.source.produce(index.fqn, tuple(index.offset), sizes)

    class Writer(FileSystemWriterAsync):
        """megatron-core's torch_dist writer without its preloading step.

        `FileSystemWriterAsync.prepare_write_data` resolves (holds) every tensor of the rank
        before writing; here each tensor is resolved, written and dropped in turn, in the
        model's order, into one file per rank, by this process (no writer processes),
        hashed as it is written (`files`: the manifest entries of this rank's files).
        """

        def prepare_write_data(self, plan, planner) -> None:
            self.write_buckets = []  # megatron's bookkeeping; unused here
            self.items, self.prefix = plan.items, plan.storage_data.prefix

        def write_all(self, planner: Planner, progress: bool):
            extra = {}
            if "serialization_format" in inspect.signature(_write_item).parameters:
                from torch.distributed.checkpoint.filesystem import SerializationFormat

                extra["serialization_format"] = SerializationFormat.TORCH_SAVE
            transforms = [self.transforms] if hasattr(self, "transforms") else []
            objects = [it for it in self.items if it.type == WriteItemType.BYTE_IO]
            tensors = sorted(  # model order: gate and up of one parameter in a row
                (it for it in self.items if it.type != WriteItemType.BYTE_IO),
                key=lambda it: planner.source.order(it.index.fqn, tuple(it.index.offset)),
            )
            self.results, self.files = [], {}
            if not self.items:
                return
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(tensors), desc="convert", unit="tensor")
            name = f"{self.prefix}0{DEFAULT_SUFFIX}"
            try:
                with integrity.open_hashed(os.path.join(self.checkpoint_dir, name)) as stream:
                    for item in objects + tensors:
                        data = planner.resolve_data(item)
                        result = _write_item(*transforms, stream, data, item, name, **extra)
                        self.results.append(result)
                        del data
                        if bar is not None and item.type != WriteItemType.BYTE_IO:
                            bar.update(1)
                    stream.flush()
                    os.fsync(stream.fileno())
            except BaseException:
                if bar is not None:  # its line cleared: the error line stands alone
                    bar.leave = False
                    bar.close()
                raise
            self.files[name] = stream.entry()
            if bar is not None:
                bar.close()

        def retrieve_write_results(self):
            return self.results

    class Strategy(TorchDistSaveShardedStrategy):
        """The torch_dist save (same files and metadata), producing tensors as it writes."""

        def __init__(self, source: _Source, progress: bool) -> None:
            super().__init__("torch_dist", 1, thread_count=1)
            self.source, self.progress = source, progress
            self.files: dict = {}  # this rank's files → manifest entries, once saved

        def save(self, sharded_state_dict: dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, keep_only_main_replica=True
            )
            writer = Writer(checkpoint_dir, thread_count=1)
            planner = Planner(self.source)
            plan_result, *_ = save_state_dict_async_plan(
                mcore_to_pyt_state_dict(flat, False), writer, None, 0, planner=planner
            )
            error = None
            try:
                writer.write_all(planner, self.progress)
                self.files = writer.files
            except common.USER_ERRORS as exc:
                error, writer.results = exc, _wrap_exception(exc)
            except OSError as exc:  # a full disk on this rank: agreed like a user error
                if not is_disk_full(exc):
                    raise
                error, writer.results = exc, _wrap_exception(exc)  # convert's line
            try:  # gathers every rank's results; rank 0 writes the .metadata index
                save_state_dict_async_finalize(*plan_result)
            except CheckpointException:
                if error is not None:
                    raise error from None
                msg = f"{checkpoint_dir}: writing failed on another rank"
                raise CheckpointError(msg) from None

    return Strategy(source, progress)


# ---------------------------------------------------------------- verification, sidecar


def _verify(state: dict, ckpt_dir: Path) -> None:
    """Every chunk this rank saved is indexed, with its key's global shape and dtype, and
    lies inside a file of the checkpoint."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    problem = None
    try:
        metadata = safe_metadata.read_metadata(ckpt_dir)
    except Exception as exc:  # an unreadable index: report it, do not hang the other ranks
        problem = f"index unreadable ({type(exc).__name__}: {exc})"
    sizes: dict[str, int] = {}
    for item in nested_values(state) if problem is None else ():
        if isinstance(item, ShardedObject):
            if item.unique_key not in metadata.state_dict_metadata:
                problem = f"'{item.unique_key}' is missing"
            continue
        if not isinstance(item, ShardedTensor) or not is_main_replica(item.replica_id):
            continue
        got = metadata.state_dict_metadata.get(item.key)
        index = MetadataIndex(item.key, torch.Size(item.global_offset))
        stored = metadata.storage_data.get(index)
        if not isinstance(got, TensorStorageMetadata) or stored is None:
            problem = f"'{item.key}' at {list(item.global_offset)} is missing"
        elif (tuple(got.size), got.properties.dtype) != (tuple(item.global_shape), item.dtype):
            problem = (
                f"'{item.key}' stored as {tuple(got.size)} {got.properties.dtype}, "
                f"expected {tuple(item.global_shape)} {item.dtype}"
            )
        else:
            path = ckpt_dir / stored.relative_path
            size = sizes.setdefault(stored.relative_path, path.stat().st_size)
            if stored.offset + stored.length > size:
                problem = f"{stored.relative_path} is truncated"
        if problem:
            break
    common.raise_if_any(f"{ckpt_dir}: verification failed: {problem}" if problem else None)


def _write_sidecar(args, info, tmp: Path, dtype: torch.dtype, padded: int) -> dict:
    """`hf/` and rl_megatron.json; their manifest entries (hashed as written)."""
    hf = tmp / common.HF_SUBDIR
    hf.mkdir()
    files = {}
    for name in ("config.json", *HF_AUX_FILES):
        if (args.hf_dir / name).is_file():
            rel = f"{common.HF_SUBDIR}/{name}"
            files[rel] = integrity.copy_file(args.hf_dir / name, tmp / rel)
    meta = {
        "format_version": common.FORMAT_VERSION,
        "head": info.head,
        "dtype": str(dtype).split(".")[-1],
        "padded_vocab_size": padded,
        "tp": args.tp,
        "ep": args.ep,
        "etp": args.etp,
        "pp": args.pp,
        "vpp": args.vpp,
        "source": str(args.hf_dir.resolve()),
    }
    blob = (json.dumps(meta, indent=2) + "\n").encode()
    files[common.META_FILE] = integrity.write_bytes(tmp / common.META_FILE, blob)
    return files


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return common.run_cli(
        PROG,
        lambda: preflight(args),
        lambda info: convert(args, info),
        lambda: shutil.rmtree(partial_dir(args.out), ignore_errors=True),
    )


if __name__ == "__main__":  # keeps spawned helper processes from re-running the tool
    sys.exit(main())
