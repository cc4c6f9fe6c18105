"""Write HF safetensors checkpoints tensor by tensor; export Megatron model chunks as one.

Shards are planned before any tensor exists (names, shapes and dtypes follow from the name
table), so each safetensors file is written header first and then filled tensor by tensor
at its planned offset (`SafetensorsShardWriter`): the writer holds no tensor, whatever the
shard size. `checkpoints_tools/megatron_to_hf.py` uses the same planner and writer.

Exporting model chunks (`save_hf_checkpoint`, any TP / PP / VPP): every rank walks the
model's parameters in HF order in lockstep. The pipeline stage that owns a parameter
all-gathers its TP shards, converts them to HF tensors (`hf_mapping`) and, unless it is the
writing rank, sends them point-to-point to it. The writing rank (TP 0, PP 0, DP 0) holds one
parameter's HF tensors at a time; other DP replicas take no part.

The directory is written atomically: shards, index, config.json and the tokenizer /
generation files go to a hidden sibling directory, are verified (tensor count, shapes,
dtypes), and only then renamed to `out_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.checkpoint.hf_loader import (
    INDEX_FILE,
    CheckpointError,
    iter_rule_params,
    read_safetensors_header,
    unwrap,
)
from rl_megatron.models.families import family
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.models.lora import LoraAdapter, adapters_by_weight, merged_weight
from rl_megatron.parallel import ParallelGroups
from rl_megatron.utils.disk_space import DiskFullError, disk_full_cause, no_space_line

# Files next to the weights that a user expects to find in an HF model directory.
HF_AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

HFTensor = tuple[str, tuple[int, ...], torch.dtype]  # (HF name, shape, dtype)


def _order_key(rule_index: int, layer: int | None, megatron_name: str) -> tuple:
    """Sort key giving HF's natural order (embedding, layers 0..L-1, final norm, head); its
    last two items are the rule index and the layer."""
    if layer is not None:
        return (1, layer, rule_index, layer)
    group = 0 if megatron_name.startswith("embedding") else 2
    return (group, 0, rule_index, None)


def export_order(rules: list[hm.Rule], info: HFModelInfo) -> list[tuple[hm.Rule, int | None]]:
    """Every exported (rule, global layer or None) of a model, in HF's natural order."""
    keys = [
        _order_key(i, layer, rule.megatron)
        for i, rule in enumerate(rules)
        if rule.export
        for layer in (range(info.num_layers) if "{layer}" in rule.megatron else [None])
    ]
    return [(rules[key[-2]], key[-1]) for key in sorted(keys)]


# ------------------------------------------------------------------ planned shards


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One safetensors file of an HF checkpoint: its name and tensors, in file order."""

    file: str
    tensors: tuple[HFTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(shape, dtype) for _, shape, dtype in self.tensors)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_shards(groups: list[list[HFTensor]], max_bytes: int) -> list[ShardPlan]:
    """Pack groups of tensors, in order, into shards of at most `max_bytes` each.

    A group (the HF tensors of one Megatron parameter) never straddles two shards, so one
    process can write all of it; a group larger than `max_bytes` gets a shard of its own.
    Files get HF's names: `model.safetensors`, or `model-0000i-of-0000n.safetensors`.
    """
    packed: list[list[HFTensor]] = []
    size = 0
    for group in groups:
        nbytes = sum(_nbytes(shape, dtype) for _, shape, dtype in group)
        if not packed or (size and size + nbytes > max_bytes):
            packed.append([])
            size = 0
        packed[-1].extend(group)
        size += nbytes
    n = len(packed)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    return [ShardPlan(name, tuple(tensors)) for name, tensors in zip(names, packed)]


class _SafetensorsFile:
    """One planned safetensors file: the header is written first, each tensor at its offset."""

    def __init__(self, path: Path, plan: ShardPlan) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        self.spans: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, shape, dtype in plan.tensors:
            end = offset + _nbytes(shape, dtype)
            header[name] = {
                "dtype": _SAFETENSORS_DTYPE[dtype],
                "shape": list(shape),
                "data_offsets": [offset, end],
            }
            self.spans[name] = (offset, shape, dtype)
            offset = end
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
        self.path, self.size = path, 8 + len(blob) + offset
        self.pending = set(self.spans)
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._data_start = 8 + len(blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        begin, shape, dtype = self.spans[name]
        if name not in self.pending:
            raise CheckpointError(f"{self.path}: '{name}' written twice")
        if (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
            raise CheckpointError(
                f"{self.path}: '{name}' is {list(tensor.shape)} {tensor.dtype}, "
                f"planned {list(shape)} {dtype}"
            )
        self.pending.discard(name)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._data_start + begin)
        self._file.write(data.numpy())

    def close(self) -> None:
        self._file.seek(0, os.SEEK_END)
        size = self._file.tell()
        self._file.close()
        if self.pending or size != self.size:
            missing = sorted(self.pending)[:3]
            raise CheckpointError(
                f"{self.path}: incomplete ({size} of {self.size} bytes; missing {missing})"
            )


class SafetensorsShardWriter:
    """Writes planned shards tensor by tensor; each file is closed once it is complete.

    Args:
        directory: where the files go.
        shards: the shards this process writes (any subset of one plan).
    """

    def __init__(self, directory: Path, shards: list[ShardPlan]) -> None:
        self.dir = Path(directory)
        self._plan = {name: shard for shard in shards for name, _, _ in shard.tensors}
        self._open: dict[str, _SafetensorsFile] = {}
        self._done: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._plan.get(name)
        if shard is None or shard.file in self._done:
            raise CheckpointError(f"{self.dir}: '{name}' is not planned here or written twice")
        f = self._open.get(shard.file)
        if f is None:
            f = self._open[shard.file] = _SafetensorsFile(self.dir / shard.file, shard)
        f.write(name, tensor)
        if not f.pending:
            del self._open[shard.file]
            self._done.add(shard.file)
            f.close()

    def close(self) -> None:
        """Close every file; raise if a planned tensor was never written."""
        files, self._open = list(self._open.values()), {}
        for f in files:
            f.close()
        planned = {shard.file for shard in self._plan.values()}
        if planned - self._done:
            raise CheckpointError(f"{self.dir}: {sorted(planned - self._done)[0]} not written")


def finish_hf_dir(
    directory: Path,
    shards: list[ShardPlan],
    *,
    expected: dict[str, tuple[int, ...]],
    src_dir: Path,
    info: HFModelInfo,
    head: str,
) -> None:
    """Verify the written shards, then add the index, config.json and tokenizer files.

    Args:
        shards: the whole plan (every process's files).
        expected: HF name → shape the name table implies (`hm.expected_hf_tensors`).
    """
    planned = {name: (shape, dtype) for s in shards for name, shape, dtype in s.tensors}
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for shard in shards:
        found.update(
            (name, (tuple(shape), dt))
            for name, (dt, shape) in read_safetensors_header(directory / shard.file).items()
        )
    if found.keys() != expected.keys():
        missing = sorted(expected.keys() - found.keys())[:3]
        extra = sorted(found.keys() - expected.keys())[:3]
        raise CheckpointError(
            f"{directory}: wrote {len(found)} tensors, expected {len(expected)} "
            f"(missing {missing}, unexpected {extra})"
        )
    for name, shape in expected.items():
        want = (shape, _SAFETENSORS_DTYPE[planned[name][1]])
        if found[name] != want or planned[name][0] != shape:
            raise CheckpointError(
                f"{directory}: '{name}' is {found[name]} on disk, expected {want}"
            )
    if len(shards) > 1:
        weight_map = {name: s.file for s in shards for name, _, _ in s.tensors}
        total = sum(s.nbytes for s in shards)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    dtypes = [dtype for _, dtype in planned.values()]
    main_dtype = max(set(dtypes), key=dtypes.count)  # config.json names a single dtype
    cfg = _hf_config_dict(src_dir, head, info, main_dtype)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for fname in HF_AUX_FILES:
        if (src_dir / fname).is_file():
            shutil.copy2(src_dir / fname, directory / fname)


def _hf_config_dict(src_dir: Path, head: str, info: HFModelInfo, dtype: torch.dtype) -> dict:
    cfg = json.loads((src_dir / "config.json").read_text())
    dtype_name = str(dtype).split(".")[-1]
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = dtype_name
    if "dtype" not in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = dtype_name
    if head == "value":
        cfg["architectures"] = [f"{family(info.model_type).architecture}ForSequenceClassification"]
        cfg["num_labels"] = 1
        cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return cfg


# ------------------------------------------------------------------ model chunks → HF


@dataclasses.dataclass
class _Schedule:
    """Who owns which parameter, known to every rank of the exporting DP replica."""

    rules: list[hm.Rule]
    local: dict[tuple, torch.nn.Parameter]  # this stage's parameters by order key
    adapters: dict[tuple, LoraAdapter]  # LoRA adapters of some of them, merged on export
    order: list[tuple[tuple, int, str]]  # (order key, owning stage, dtype name), HF order
    tp_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup | None  # an expert's rows are split over it (MoE)
    pp_ranks: list[int]
    tp_rank: int
    pp_rank: int


def _schedule(
    model_chunks: list[torch.nn.Module],
    info: HFModelInfo,
    head: str,
    groups: ParallelGroups,
):
    """The export schedule (collective over the PP group); None outside DP replica 0."""
    layout = groups.layout
    if info.is_moe and layout.ep > 1:
        # The experts of replica 0 live on other DP replicas' ranks too; this exporter
        # walks one replica. The tools convert such a model's Megatron checkpoint.
        raise CheckpointError(
            "exporting an MoE model at parallel.ep > 1 from memory is not supported yet; "
            "save a Megatron checkpoint and run checkpoints_tools/megatron_to_hf.py"
        )
    mine = layout.coordinates(dist.get_rank())
    if mine["dp"] != 0 or mine["cp"] != 0:
        return None  # another DP (or CP) replica writes
    pp_group = groups.pp
    rules = hm.rules_for(info, head)
    local: dict[tuple, torch.nn.Parameter] = {}
    adapters: dict[tuple, LoraAdapter] = {}
    for chunk in model_chunks:
        by_weight = adapters_by_weight(unwrap(chunk))
        for rule, layer, param in iter_rule_params(unwrap(chunk), rules):
            if rule.export:
                key = _order_key(rules.index(rule), layer, rule.megatron)
                local[key] = param
                if id(param) in by_weight:
                    adapters[key] = by_weight[id(param)]
    # Which stage owns which parameter (any PP / VPP split) and its dtype (a model may keep
    # e.g. fp32 norms beside bf16 weights), known to every rank of the PP group.
    per_stage: list = [None] * pp_group.size()
    owned = sorted((key, str(p.dtype).split(".")[-1]) for key, p in local.items())
    dist.all_gather_object(per_stage, owned, group=pp_group)
    order = sorted(
        (key, stage, dtype) for stage, items in enumerate(per_stage) for key, dtype in items
    )
    return _Schedule(
        rules,
        local,
        adapters,
        order,
        groups.tp,
        groups.etp if info.is_moe else None,
        dist.get_process_group_ranks(pp_group),
        mine["tp"],
        mine["pp"],
    )


def iter_hf_tensors(
    model_chunks: list[torch.nn.Module],
    info: HFModelInfo,
    groups: ParallelGroups,
    *,
    head: str = "lm",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, cpu_tensor)` for the whole model on the writing rank, nothing elsewhere.

    Collective: every rank of the job must iterate it to the end.

    Args:
        model_chunks: this rank's GPTModel chunks (wrappers allowed).
        groups: the run's process groups, with its layout (`DistributedRun.groups`).
        head: "lm" or "value" (scalar head exported as `score.weight`).
    """
    plan = _schedule(model_chunks, info, head, groups)
    if plan is not None:
        yield from _iter_scheduled(plan, info)


def _iter_scheduled(plan: _Schedule, info: HFModelInfo) -> Iterator[tuple[str, torch.Tensor]]:
    is_writer = plan.tp_rank == 0 and plan.pp_rank == 0
    device = next(iter(plan.local.values())).device
    for key, stage, dtype in plan.order:
        rule, layer = plan.rules[key[-2]], key[-1]
        if stage == plan.pp_rank:
            group = plan.etp_group if rule.expert is not None else plan.tp_group
            param = plan.local[key]
            if key in plan.adapters:
                # W + (alpha/r)·B·A of this shard: one temporary at a time, never a model copy.
                param = merged_weight(param, plan.adapters[key])
            shards = _gather_tp(param, rule, group)
            if plan.tp_rank != 0:
                continue
            for hf_name, tensor in hm.megatron_to_hf(rule, layer, shards, info):
                if is_writer:
                    yield hf_name, tensor.to("cpu", copy=True)
                else:
                    dist.send(tensor.contiguous(), dst=plan.pp_ranks[0])
        elif is_writer:
            for name, shape in rule.hf:
                buf = torch.empty(
                    hm.hf_shape(shape, info), dtype=getattr(torch, dtype), device=device
                )
                dist.recv(buf, src=plan.pp_ranks[stage])
                yield name.format(layer=layer), buf.cpu()


def _gather_tp(param: torch.Tensor, rule: hm.Rule, tp_group) -> list[torch.Tensor]:
    """All TP shards of a parameter, rank order (the parameter itself when replicated)."""
    data = param.detach()
    if tp_group.size() == 1 or rule.tp_dim is None:
        return [data]
    shards = [torch.empty_like(data) for _ in range(tp_group.size())]
    dist.all_gather(shards, data.contiguous(), group=tp_group)
    return shards


def check_output_dir(out_dir: str | Path, force: bool, src: str | Path | None = None) -> None:
    """Refuse an existing non-empty `out_dir` unless `force` (one-line CheckpointError).

    `out_dir` may never be the input `src`, contain it (`--force` would delete it before the
    rename) or lie inside it (the result would become part of the input).
    """
    out_dir = Path(out_dir)
    if src is not None:
        out, inp = out_dir.resolve(), Path(src).resolve()
        if out == inp or out in inp.parents:
            raise CheckpointError(
                f"{out_dir}: is or contains the input {src}, which writing there would delete "
                f"(--force or not); choose another output directory"
            )
        if inp in out.parents:
            raise CheckpointError(
                f"{out_dir}: lies inside the input {src}; choose an output directory outside it"
            )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise CheckpointError(f"{out_dir}: exists and is not empty (pass --force to overwrite)")


def partial_dir(out_dir: str | Path) -> Path:
    """The hidden sibling a result is written into before it is renamed to `out_dir`."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.partial"


def prepare_output_dir(out_dir: str | Path, force: bool, src: str | Path | None = None) -> Path:
    """Check `out_dir` (against the input `src` too), then create (afresh) and return its
    partial sibling."""
    check_output_dir(out_dir, force, src)
    tmp = partial_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_output_dir(tmp: Path, out_dir: str | Path) -> None:
    """Replace `out_dir` by the finished `tmp`: the old one is renamed aside, the new one
    into place, then the old one deleted, so a kill at any moment leaves one complete
    folder (the next run's start-up cleanup, `step_dirs.remove_leftovers`, puts an aside
    copy back when a kill came between the two renames)."""
    out_dir = Path(out_dir)
    aside = None
    if out_dir.exists() or out_dir.is_symlink():
        aside = out_dir.parent / f".{out_dir.name}.aside-{uuid.uuid4().hex[:12]}"
        os.rename(out_dir, aside)
    os.replace(tmp, out_dir)
    if aside is not None:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside)
        else:
            aside.unlink()


def save_hf_checkpoint(
    model_chunks: list[torch.nn.Module],
    info: HFModelInfo,
    out_dir: str | Path,
    groups: ParallelGroups,
    *,
    src_dir: str | Path,
    head: str = "lm",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    force: bool = False,
    progress: bool = False,
) -> None:
    """Write the model as an HF checkpoint that `from_pretrained` and vLLM load (collective).

    Args:
        model_chunks: this rank's GPTModel chunks.
        info: the model's parsed HF config.
        out_dir: target directory; must be absent or empty unless `force`, and never
            `src_dir`, above it or inside it.
        groups: the run's process groups, with its layout (`DistributedRun.groups`).
        src_dir: the HF directory the model came from: its config.json (dtype updated) and
            tokenizer / generation files are copied.
        head: "lm" → *ForCausalLM, "value" → *ForSequenceClassification (`score.weight`).
        dtype: dtype of the written tensors; default the model's.
        max_shard_bytes: size at which a new safetensors shard is started.
        progress: show a tensors-done bar on the writing rank.
    """
    plan = _schedule(model_chunks, info, head, groups)
    writer = bar = tmp = full = None
    if dist.get_rank() == 0:
        groups = [
            [
                (name.format(layer=key[-1]), hm.hf_shape(shape, info), dtype or getattr(torch, dt))
                for name, shape in plan.rules[key[-2]].hf
            ]
            for key, _, dt in plan.order
        ]
        shards = plan_shards(groups, max_shard_bytes)
        try:
            tmp = prepare_output_dir(out_dir, force, src=src_dir)
        except OSError as exc:
            if disk_full_cause(exc) is None:
                raise
            full = exc
        else:
            writer = SafetensorsShardWriter(tmp, shards)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(g) for g in groups), desc="export", unit="tensor")
    # A full disk on the writing rank must not leave the others in a collective: it stops
    # writing but walks the schedule to its end, and then tells every rank.
    try:
        for name, tensor in _iter_scheduled(plan, info) if plan is not None else ():
            if writer is not None and full is None:
                try:
                    writer.write(name, tensor.to(dtype or tensor.dtype))
                except OSError as exc:
                    if disk_full_cause(exc) is None:
                        raise
                    full = exc
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        if writer is not None and full is None:
            try:
                writer.close()
                expected = hm.expected_hf_tensors([r for r in plan.rules if r.export], info)
                finish_hf_dir(
                    tmp, shards, expected=expected, src_dir=Path(src_dir), info=info, head=head
                )
                commit_output_dir(tmp, out_dir)
            except OSError as exc:
                if disk_full_cause(exc) is None:
                    raise
                full = exc
        problem = None
        if full is not None:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # the space back before the line is made
            problem = no_space_line(out_dir, sum(s.nbytes for s in shards))
        box = [problem]
        dist.broadcast_object_list(box, src=0)  # also the barrier that ends the export
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing partial left behind
        raise
    if box[0] is not None:
        raise DiskFullError(box[0])
