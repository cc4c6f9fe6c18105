"""Convert a Megatron dist checkpoint (from hf_to_megatron.py) back to a Hugging Face model.

Mixtures of experts included: experts are stored stacked per layer (`[layers, E, ...]`) and
read one expert at a time, like a layer.

    python checkpoints_tools/megatron_to_hf.py --ckpt CKPT --out HF [--dtype bf16|fp16|fp32]
        [--force] [--max-shard-gb 2] [--no-verify] [--adapter-only]
    torchrun --nproc_per_node N checkpoints_tools/megatron_to_hf.py ...   # N writers

Streaming: no model is built. The safetensors shards are planned from the name table and
the checkpoint's index (names, shapes, dtypes; at most `--max-shard-gb` each) and written
header first; then the checkpoint is read one layer at a time (`dist_checkpointing.load` of
that layer's tensors only), converted to HF tensors and written at their planned offsets.
Host memory stays near one layer's tensors, whatever the model and shard sizes. Under
torchrun the shards are shared out among the processes, each writing its own files.

A LoRA actor's checkpoint (adapters `<linear>_lora.lora_a/b` beside the frozen weights,
their scale in the sidecar's `lora` field) is exported merged, W + (alpha/r)·B·A per tensor
as `checkpoint.save_hf` writes it; `--adapter-only` writes the adapters alone in the HF
PEFT layout instead (`adapter_config.json`, `adapter_model.safetensors`:
`rl_megatron/checkpoint/peft_export.py`), rank 0 writing. Every adapter in the index must
sit beside a weight the table exports, or the tool refuses. A trainer's LoRA step folder
holds the adapters only: the weights are read from the run's base copy its sidecar's
`lora_base` names (`../lora_base/actor`), verified like the folder; an HF base is refused.

Before anything is read, the checkpoint is checked against its manifest.json (every file
there, none extra, sizes, then each file's CRC-32, the bytes shared out among the
processes); `--no-verify` skips that (and accepts a checkpoint saved without a manifest).
Its pickled index is read restricted either way (`rl_megatron/checkpoint/safe_metadata.py`),
and common.pt weights-only, before any output exists.

The result (shards + index, config.json, generation_config.json, tokenizer files) loads with
`AutoModelForCausalLM.from_pretrained` (or *ForSequenceClassification for a reward model) and
with vLLM. It is written into a hidden sibling directory, verified (tensor count, shapes,
dtypes) and renamed only when complete; user errors print one line and exit with code 2.
Any failure after it was created removes the hidden directory (an internal one keeps its
traceback).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

# Run as a script (python / torchrun): the shared helper sits next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from types import SimpleNamespace  # noqa: E402

import _common as common  # noqa: E402
import torch  # noqa: E402

from rl_megatron.checkpoint import hf_mapping as hm  # noqa: E402
from rl_megatron.checkpoint import integrity, safe_metadata  # noqa: E402
from rl_megatron.checkpoint.hf_export import (  # noqa: E402
    ShardPlan,
    check_output_dir,
    export_order,
    partial_dir,
)
from rl_megatron.checkpoint.hf_loader import CheckpointError  # noqa: E402
from rl_megatron.models.hf_config import load_hf_config  # noqa: E402
from rl_megatron.models.lora import merged_weight  # noqa: E402

PROG = "megatron_to_hf"
COMMON_FILE = "common.pt"  # megatron-core's name for it (dist_checkpointing COMMON_STATE_FNAME)


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
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the checksums of manifest.json (e.g. a checkpoint saved without one)",
    )
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA actor's checkpoint: write its adapters alone in the HF PEFT layout "
        "(adapter_config.json + adapter_model.safetensors) instead of the merged model",
    )
    return p.parse_args(argv)


class _Param:
    """One exported Megatron parameter and where it lies in the checkpoint."""

    def __init__(self, rule: hm.Rule, layer: int | None, key: str, index: tuple, stored):
        self.rule, self.layer = rule, layer
        self.key = key  # dist_checkpointing key
        # position on the stacked axes: (layer,), (layer, expert) or () when not stacked
        self.index = index
        self.shape, self.dtype = stored  # global shape and dtype in the checkpoint

    def sharded_tensor(self):
        """An empty ShardedTensor selecting this parameter (one layer of a stacked key).

        A layer is selected as a `[1, ...]` slice of the stacked tensor, not through
        megatron's `prepend_axis_num`: that path assumes the other layers are loaded by
        other ranks, and here no rank loads them.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        n = len(self.index)
        data = torch.empty((1,) * n + tuple(self.shape[n:]), dtype=self.dtype)
        offsets = [(axis, i, self.shape[axis]) for axis, i in enumerate(self.index)]
        return ShardedTensor.from_rank_offsets(self.key, data, *offsets)

    def unstack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(tensor.shape[len(self.index) :])


def preflight(args: argparse.Namespace):
    """Check the checkpoint's listing, sidecar and index against the name table; write
    nothing. Returns what `convert` takes, with the manifest's files (None: --no-verify)."""
    check_output_dir(args.out, args.force, src=args.ckpt)
    common.check_out_parent(args.out)
    if not 0 < args.max_shard_gb < float("inf"):  # NaN too
        raise CheckpointError(f"--max-shard-gb: {args.max_shard_gb} is not a size > 0 (GB)")
    common.meta_path(args.ckpt)  # is it a checkpoint of ours at all?
    files = None
    if args.verify:
        files = integrity.read_manifest(args.ckpt)
        integrity.check_listing(args.ckpt, files)
        # The sidecar, the index and common.pt are read next: their bytes first (small files).
        read_next = (common.META_FILE, ".metadata", COMMON_FILE)
        small = {rel: files[rel] for rel in read_next if rel in files}
        problem = integrity.verify_share(args.ckpt, small)
        if problem:
            raise CheckpointError(problem)
    meta = common.read_meta(args.ckpt)
    info = load_hf_config(args.ckpt / common.HF_SUBDIR)
    if not (args.ckpt / "metadata.json").is_file():
        raise CheckpointError(f"{args.ckpt}: no dist_checkpointing metadata.json")
    index = safe_metadata.read_metadata(args.ckpt)  # restricted: no code runs from it
    safe_metadata.check_index_files(args.ckpt, index)  # missing / truncated .distcp files
    check_common_file(args.ckpt)
    base = lora_base_copy(args.ckpt, meta, args.verify)
    base_index = index
    if base.dir != args.ckpt:  # an adapters-only step folder: the weights are in its base
        base_index = safe_metadata.read_metadata(base.dir)
        safe_metadata.check_index_files(base.dir, base_index)
        check_common_file(base.dir)
    params = _params(base.dir, info, meta, base_index)
    adapters = _adapters(args.ckpt, meta, index, params)
    if args.adapter_only and not adapters:
        raise CheckpointError(f"{args.ckpt}: holds no LoRA adapters (--adapter-only)")
    return meta, info, params, files, adapters, base


def lora_base_copy(ckpt: Path, meta: dict, verify: bool) -> SimpleNamespace:
    """Where the exported weights are: `ckpt` itself, or, for a LoRA step folder saved
    adapters-only (its sidecar's `lora_base`: `rl_megatron/checkpoint/lora_base.py`), the
    run's base copy it names (`dir`; `files`: its manifest's table to checksum, or None).
    An HF base is refused in one line (reading its weights here is not built)."""
    base = meta.get("lora_base")
    if not base:
        return SimpleNamespace(dir=ckpt, files=None)
    if base.get("kind") != "copy":
        raise CheckpointError(
            f"{ckpt}: a LoRA step folder whose base is the HF folder {base.get('path')}: this "
            f"tool does not read HF weights; a run exports with checkpoint.save_hf=true "
            f"(merged) or checkpoint.save_hf_adapter=true (PEFT)"
        )
    where = (ckpt.parent / base["path"]).resolve()  # relative to the step folder
    if not (where / "metadata.json").is_file():
        raise CheckpointError(
            f"{where}: missing: {ckpt} holds LoRA adapters only, and this is the base copy "
            f"they were trained on (`checkpoints/lora_base/` of the run)"
        )
    files = None
    if verify:
        files = integrity.read_manifest(where)  # one line if it is missing or unreadable
        if integrity.hash_file(where / integrity.MANIFEST_FILE) != base.get("manifest"):
            raise CheckpointError(
                f"{where / integrity.MANIFEST_FILE}: not the base copy {ckpt} was saved with"
            )
        integrity.check_listing(where, files)
    return SimpleNamespace(dir=where, files=files)


def check_common_file(ckpt: Path) -> None:
    """common.pt (megatron-core's unsharded state, read by every load) loads weights-only.

    Read here, before any output exists: inside the collective loads its failure would be
    each rank's traceback and a half-written export (`--no-verify` has no checksum for it).
    """
    path = ckpt / COMMON_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every dist_checkpointing save writes it)")
    try:
        with safe_metadata.restricted_loading():  # weights-only, as the loads below read it
            torch.load(path, map_location="cpu")
    except Exception as exc:  # garbage bytes, truncation, a refused global: many types
        raise CheckpointError(
            f"{path}: cannot be read as a weights-only torch file ({_load_failure(exc)})"
        ) from None


def _load_failure(exc: Exception) -> str:
    """The reason in torch.load's failure, one sentence: the weights-only unpickler's own
    (its message wraps it in paragraphs of advice), else the exception's first sentence."""
    text = str(exc).strip()
    if text.startswith("Weights only load failed"):
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        reasons = [p for p in paragraphs[1:] if not p.startswith("Check the documentation")]
        return " ".join((reasons or ["refused"])[0].split())[:200]
    first = " ".join(text.split(". ")[0].split())[:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _stored_tensors(index) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key → (global shape, dtype) of every tensor in a torch_dist checkpoint's index."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in index.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _params(ckpt: Path, info, meta: dict, index) -> list[_Param]:
    """Each exported parameter in HF order, found in the checkpoint with the right shape."""
    stored = _stored_tensors(index)
    params = []
    for rule, layer in export_order(hm.rules_for(info, meta["head"]), info):
        shape = _megatron_shape(rule, info, meta["padded_vocab_size"])
        key, index = rule.megatron, ()
        if layer is not None:
            # Layers are stored stacked (`decoder.layers.<name>`, layer = first axis; an
            # expert's row: experts on the second) unless the model was saved with
            # `non_homogeneous_layers`.
            key = rule.megatron.format(layer=layer)
            if key not in stored:
                key, index = hm.stored_layer_key(rule), (layer,)
                shape = (info.num_layers, *shape)
                if rule.expert is not None:
                    index, shape = (layer, rule.expert), (shape[0], info.num_experts, *shape[1:])
        if key not in stored:
            raise CheckpointError(f"{ckpt}: checkpoint lacks '{key}'")
        if stored[key][0] != shape:
            raise CheckpointError(
                f"{ckpt}: '{key}' has shape {list(stored[key][0])}, config.json and "
                f"{common.META_FILE} imply {list(shape)}"
            )
        params.append(_Param(rule, layer, key, index, stored[key]))
    return params


LORA_KEY = ".lora_"  # an adapter's stored keys: `<weight's module>_lora.lora_a` / `.lora_b`


def _adapters(ckpt: Path, meta: dict, index, params: list[_Param]) -> dict[int, tuple]:
    """Parameter index → its adapter's (A, B) `_Param`s, from the keys beside its weight
    (`linear_qkv.weight` → `linear_qkv_lora.lora_a`, stacked on the same axes)."""
    stored = _stored_tensors(index)
    found = {key for key in stored if LORA_KEY in key}
    if not found:
        return {}
    lora = meta.get("lora")
    if not isinstance(lora, dict) or not all(
        isinstance(lora.get(k), (int, float)) and lora[k] > 0 for k in ("rank", "alpha")
    ):
        raise CheckpointError(
            f"{common.meta_path(ckpt)}: the checkpoint holds LoRA adapters but no valid "
            f"'lora' field (rank and alpha > 0; found {lora!r})"
        )
    out, used = {}, set()
    for i, p in enumerate(params):
        if not p.key.endswith(".weight"):
            continue
        keys = [p.key.removesuffix(".weight") + f"_lora.lora_{leaf}" for leaf in "ab"]
        if not any(key in stored for key in keys):
            continue
        parts = []
        for key in keys:
            if key not in stored:
                raise CheckpointError(f"{ckpt}: checkpoint lacks '{key}' beside its pair")
            parts.append(_Param(p.rule, p.layer, key, p.index, stored[key]))
        used.update(keys)
        out[i] = tuple(parts)
    if found - used:
        raise CheckpointError(
            f"{ckpt}: adapter '{sorted(found - used)[0]}' sits beside no exported weight"
        )
    return out


def _megatron_shape(rule: hm.Rule, info, padded_vocab: int) -> tuple[int, ...]:
    """Global (TP=1) shape of a Megatron parameter, from its HF tensors' shapes."""
    shapes = [hm.hf_shape(shape, info) for _, shape in rule.hf]
    if rule.transform == hm.VOCAB:
        return (padded_vocab, *shapes[0][1:])
    return (sum(s[0] for s in shapes), *shapes[0][1:])  # QKV, GATE_UP rows; COPY: one tensor


def convert(
    args: argparse.Namespace,
    meta: dict,
    info,
    params: list[_Param],
    files: dict | None,
    adapters: dict[int, tuple],
    base: SimpleNamespace,
) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint.hf_export import (
        SafetensorsShardWriter,
        commit_output_dir,
        finish_hf_dir,
        plan_shards,
        prepare_output_dir,
    )

    start = time.time()
    common.init_distributed()
    rank, size = common.world()
    if files is not None:  # every file's checksum, each process a share of the bytes
        common.raise_if_any(integrity.verify_share(args.ckpt, files, rank, size))
    if base.files is not None:  # an adapters-only step folder's base copy, likewise
        common.raise_if_any(integrity.verify_share(base.dir, base.files, rank, size))
    if args.adapter_only:
        return convert_adapters(args, meta, info, params, adapters, start)
    scale = meta["lora"]["alpha"] / meta["lora"]["rank"] if adapters else None
    out_dtype = common.DTYPES[args.dtype] if args.dtype else None
    groups = [
        [
            (name.format(layer=p.layer), hm.hf_shape(shape, info), out_dtype or p.dtype)
            for name, shape in p.rule.hf
        ]
        for p in params
    ]
    shards = plan_shards(groups, int(args.max_shard_gb * 1024**3))
    owners = _share_out(shards, size)
    batches = [_batches(params, groups, shards, owners, r) for r in range(size)]

    tmp = partial_dir(args.out)
    if rank == 0:
        prepare_output_dir(args.out, args.force, src=args.ckpt)
    dist.barrier()
    writer = SafetensorsShardWriter(tmp, [s for s, r in zip(shards, owners) if r == rank])
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(groups[g]) for b in batches[0] for g in b), unit="tensor")
        bar.set_description("export" if size == 1 else f"export (rank 0 of {size})")
    problem = None
    # Every rank loads in lockstep (each load is collective); an idle rank loads nothing.
    for step in range(max(map(len, batches))):
        todo = batches[rank][step] if step < len(batches[rank]) else []
        batch = [params[g] for g in todo]
        extra = [part for g in todo for part in adapters.get(g, ())]
        try:
            if base.dir == args.ckpt:
                tensors = _load(args.ckpt, batch + extra)
            else:  # adapters-only: the weights from the base copy (both loads collective)
                tensors = _load(base.dir, batch) + _load(args.ckpt, extra)
        except CheckpointError as exc:  # raised on every rank alike: the load is collective
            problem = str(exc)
            break
        tensors, factors = tensors[: len(batch)], iter(tensors[len(batch) :])
        for j, g in enumerate(todo):
            if g in adapters:  # W + (alpha/r)·B·A, as the in-memory HF export merges it
                a, b = next(factors), next(factors)
                lora = SimpleNamespace(lora_a=a, lora_b=b, scale=scale)
                tensors[j] = merged_weight(tensors[j], lora)
        for p, tensor in zip(batch, tensors):
            for name, hf_tensor in hm.megatron_to_hf(p.rule, p.layer, [tensor], info):
                try:
                    writer.write(name, hf_tensor.to(out_dtype or hf_tensor.dtype))
                except CheckpointError as exc:
                    problem = problem or str(exc)
                if bar is not None:
                    bar.update(1)
    try:
        writer.close()
    except CheckpointError as exc:
        problem = problem or str(exc)
    if bar is not None:
        bar.close()
    common.raise_if_any(problem)
    if rank == 0:
        head, hf_dir = meta["head"], args.ckpt / common.HF_SUBDIR
        expected = hm.expected_hf_tensors([r for r in hm.rules_for(info, head) if r.export], info)
        finish_hf_dir(tmp, shards, expected=expected, src_dir=hf_dir, info=info, head=head)
        commit_output_dir(tmp, args.out)
        dtype = args.dtype or meta["dtype"]
        took = time.time() - start
        print(f"{PROG}: wrote {args.out} ({dtype}, {len(shards)} shards) in {took:.1f} s")
    dist.barrier()


def convert_adapters(args, meta: dict, info, params, adapters: dict[int, tuple], start) -> None:
    """`--adapter-only`: every rank loads the adapters (small; the loads are collective),
    one layer at a time; rank 0 writes the PEFT folder."""

    from rl_megatron.checkpoint.hf_export import (
        SafetensorsShardWriter,
        commit_output_dir,
        prepare_output_dir,
    )
    from rl_megatron.checkpoint.peft_export import (
        ADAPTER_WEIGHTS,
        adapter_to_peft,
        finish_peft_dir,
        lora_mode,
        peft_shapes,
    )

    rank, _ = common.world()
    out_dtype = common.DTYPES[args.dtype] if args.dtype else None
    lora = meta["lora"]
    chosen = sorted(adapters)  # HF order, as `params`
    planned = [
        (name, shape, out_dtype or adapters[g][0].dtype)
        for g in chosen
        for name, shape in peft_shapes(params[g].rule, params[g].layer, lora["rank"], info)
    ]
    tmp = partial_dir(args.out)
    writer = None
    if rank == 0:
        prepare_output_dir(args.out, args.force, src=args.ckpt)
        writer = SafetensorsShardWriter(tmp, [ShardPlan(ADAPTER_WEIGHTS, tuple(planned))])
    units: dict = {}  # one load per layer (per expert), as the merged export batches
    for g in chosen:
        p = params[g]
        units.setdefault((p.layer, p.rule.expert) if p.layer is not None else g, []).append(g)
    problem = None
    for todo in units.values():
        try:
            loaded = iter(_load(args.ckpt, [part for g in todo for part in adapters[g]]))
        except CheckpointError as exc:  # raised on every rank alike: the load is collective
            problem = str(exc)
            break
        for g in todo:
            a, b = next(loaded), next(loaded)
            if writer is None or problem is not None:
                continue  # a failed write stops the writing, not the lockstep loads
            p = params[g]
            try:
                for name, tensor in adapter_to_peft(
                    p.rule, p.layer, lora_mode(p.rule), [a], [b], info
                ):
                    writer.write(name, tensor.to(out_dtype or tensor.dtype))
            except CheckpointError as exc:
                problem = str(exc)
    if writer is not None and problem is None:
        try:
            writer.close()
            finish_peft_dir(
                tmp,
                planned,
                alpha=lora["alpha"],
                dropout=lora.get("dropout", 0.0),
                base_model_name_or_path=meta.get("source"),
            )
            commit_output_dir(tmp, args.out)
        except CheckpointError as exc:
            problem = str(exc)
    common.raise_if_any(problem)  # collective: every rank leaves together
    if rank == 0:
        took = time.time() - start
        print(f"{PROG}: wrote the LoRA adapters of {args.ckpt} to {args.out} in {took:.1f} s")


def _share_out(shards: list[ShardPlan], size: int) -> list[int]:
    """The rank writing each shard: consecutive shards, about equal bytes per rank."""
    total = max(1, sum(s.nbytes for s in shards))
    owners, done = [], 0
    for shard in shards:
        owners.append(min(size - 1, done * size // total))
        done += shard.nbytes
    return owners


def _batches(params, groups, shards, owners, rank: int) -> list[list[int]]:
    """Indices of the parameters rank `rank` exports, batched one layer (or one non-layer
    parameter) per checkpoint load."""
    shard_of = {name: i for i, s in enumerate(shards) for name, _, _ in s.tensors}
    batches: list[list[int]] = []
    last = object()
    for g, p in enumerate(params):
        if owners[shard_of[groups[g][0][0]]] != rank:
            continue
        # One layer per load; an expert's rows one expert per load (memory independent of E).
        unit = ("layer", p.layer, p.rule.expert) if p.layer is not None else ("param", g)
        if unit != last:
            batches.append([])
            last = unit
        batches[-1].append(g)
    return batches


def _load(ckpt: Path, params: list[_Param]) -> list[torch.Tensor]:
    """The global tensors of `params` from the checkpoint (collective; may be empty)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException

    state = {str(i): p.sharded_tensor() for i, p in enumerate(params)}
    try:
        with safe_metadata.restricted_loading():  # no code runs from the checkpoint's pickles
            # Loading part of each key is the point: the whole-key coverage check does not apply.
            loaded = dist_checkpointing.load(state, str(ckpt), validate_access_integrity=False)
    except CheckpointException as exc:  # torch's, a BaseException: raised on every rank
        raise CheckpointError(safe_metadata.describe_failure(ckpt, exc)) from None
    return [p.unstack(loaded[str(i)]) for i, p in enumerate(params)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return common.run_cli(
        PROG,
        lambda: preflight(args),
        lambda plan: convert(args, *plan),
        lambda: shutil.rmtree(partial_dir(args.out), ignore_errors=True),
    )


if __name__ == "__main__":  # keeps spawned helper processes from re-running the tool
    sys.exit(main())
