"""Export Megatron model chunks (any TP / PP / VPP) as an HF safetensors checkpoint.

Every rank walks the model's parameters in HF order in lockstep. The pipeline stage that
owns a parameter all-gathers its TP shards, converts them to HF tensors (`hf_mapping`) and,
unless it is the writing rank, sends them point-to-point to it. The writing rank (TP 0,
PP 0, DP 0) holds at most one output shard (`max_shard_bytes`) plus one tensor; other DP
replicas take no part.

The directory is written atomically: shards, index, config.json and the tokenizer /
generation files go to a hidden sibling directory, are verified (tensor count, shapes,
dtypes), and only then renamed to `out_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
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
from rl_megatron.models.hf_config import HFModelInfo

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
_UMASK = os.umask(0)
os.umask(_UMASK)
_ARCH_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


def _order_key(rule_index: int, layer: int | None, megatron_name: str) -> tuple:
    """Sort key giving HF's natural order (embedding, layers 0..L-1, final norm, head); its
    last two items are the rule index and the layer."""
    if layer is not None:
        return (1, layer, rule_index, layer)
    group = 0 if megatron_name.startswith("embedding") else 2
    return (group, 0, rule_index, None)


def iter_hf_tensors(
    model_chunks: list[torch.nn.Module], info: HFModelInfo, *, head: str = "lm"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, cpu_tensor)` for the whole model on the writing rank, nothing elsewhere.

    Collective: every rank of the job must iterate it to the end.

    Args:
        model_chunks: this rank's GPTModel chunks (wrappers allowed).
        head: "lm" or "value" (scalar head exported as `score.weight`).
    """
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank(with_context_parallel=True) != 0:
        return  # another DP replica writes
    tp_group, pp_group = (
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
    )
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    is_writer = tp_rank == 0 and pp_rank == 0
    rules = hm.rules_for(info, head)

    local: dict[tuple, torch.nn.Parameter] = {}
    for chunk in model_chunks:
        for rule, layer, param in iter_rule_params(unwrap(chunk), rules):
            if rule.export:
                local[_order_key(rules.index(rule), layer, rule.megatron)] = param
    # Which stage owns which parameter (any PP / VPP split) and its dtype (a model may keep
    # e.g. fp32 norms beside bf16 weights), known to every rank of the PP group.
    per_stage: list = [None] * len(pp_ranks)
    owned = sorted((key, str(p.dtype).split(".")[-1]) for key, p in local.items())
    dist.all_gather_object(per_stage, owned, group=pp_group)
    schedule = sorted(
        (key, stage, dtype) for stage, items in enumerate(per_stage) for key, dtype in items
    )
    device = next(iter(local.values())).device

    for key, stage, dtype in schedule:
        rule, layer = rules[key[-2]], key[-1]
        if stage == pp_rank:
            shards = _gather_tp(local[key], rule, tp_group)
            if tp_rank != 0:
                continue
            for hf_name, tensor in hm.megatron_to_hf(rule, layer, shards, info):
                if is_writer:
                    yield hf_name, tensor.to("cpu", copy=True)
                else:
                    dist.send(tensor.contiguous(), dst=pp_ranks[0])
        elif is_writer:
            for name, shape in rule.hf:
                buf = torch.empty(
                    hm.hf_shape(shape, info), dtype=getattr(torch, dtype), device=device
                )
                dist.recv(buf, src=pp_ranks[stage])
                yield name.format(layer=layer), buf.cpu()


def _gather_tp(param: torch.Tensor, rule: hm.Rule, tp_group) -> list[torch.Tensor]:
    """All TP shards of a parameter, rank order (the parameter itself when replicated)."""
    data = param.detach()
    if tp_group.size() == 1 or rule.tp_dim is None:
        return [data]
    shards = [torch.empty_like(data) for _ in range(tp_group.size())]
    dist.all_gather(shards, data.contiguous(), group=tp_group)
    return shards


def _hf_config_dict(src_dir: Path, head: str, info: HFModelInfo, dtype: torch.dtype) -> dict:
    cfg = json.loads((src_dir / "config.json").read_text())
    dtype_name = str(dtype).split(".")[-1]
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = dtype_name
    if "dtype" not in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = dtype_name
    if head == "value":
        cfg["architectures"] = [f"{_ARCH_PREFIX[info.model_type]}ForSequenceClassification"]
        cfg["num_labels"] = 1
        cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return cfg


class _ShardWriter:
    """Streams tensors into safetensors shards of at most `max_bytes` (one shard in memory)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.dir, self.max_bytes = directory, max_bytes
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.written: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, dtype)
        self.total = 0
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        # A private contiguous copy: safetensors refuses tensors that share storage.
        tensor = tensor.to("cpu", copy=True).contiguous()
        if self._buffered and self._buffered + tensor.nbytes > self.max_bytes:
            self._flush()
        self._buffer[name] = tensor
        self._buffered += tensor.nbytes
        self.total += tensor.nbytes
        self.written[name] = (tuple(tensor.shape), _SAFETENSORS_DTYPE[tensor.dtype])

    def _flush(self) -> None:
        from safetensors.torch import save_file

        fname = f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self._buffer, str(self.dir / fname), metadata={"format": "pt"})
        # safetensors creates files owner-only; HF dirs are usually shared with a group.
        os.chmod(self.dir / fname, 0o666 & ~_UMASK)
        self.files.append(fname)
        self.weight_map.update(dict.fromkeys(self._buffer, fname))
        self._buffer, self._buffered = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give the shards HF's names (and an index); return them."""
        if self._buffer or not self.files:
            self._flush()
        n = len(self.files)
        final = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        rename = dict(zip(self.files, final))
        for old, new in rename.items():
            os.replace(self.dir / old, self.dir / new)
        if n > 1:
            weight_map = {k: rename[v] for k, v in sorted(self.weight_map.items())}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return final


def _verify(
    directory: Path, files: list[str], expected: dict[str, tuple[int, ...]], written: dict
) -> None:
    """Re-read the written headers: the table's tensors, each with its shape and dtype."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in files:
        for name, (dt, shape) in read_safetensors_header(directory / fname).items():
            found[name] = (tuple(shape), dt)
    if found.keys() != expected.keys():
        missing = sorted(expected.keys() - found.keys())[:3]
        extra = sorted(found.keys() - expected.keys())[:3]
        raise CheckpointError(
            f"{directory}: wrote {len(found)} tensors, expected {len(expected)} "
            f"(missing {missing}, unexpected {extra})"
        )
    for name, shape in expected.items():
        if found[name] != (shape, written[name][1]):
            raise CheckpointError(
                f"{directory}: '{name}' is {found[name]} on disk, expected "
                f"{(shape, written[name][1])}"
            )


def check_output_dir(out_dir: str | Path, force: bool) -> None:
    """Refuse an existing non-empty `out_dir` unless `force` (one-line CheckpointError)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise CheckpointError(f"{out_dir}: exists and is not empty (pass --force to overwrite)")


def partial_dir(out_dir: str | Path) -> Path:
    """The hidden sibling a result is written into before it is renamed to `out_dir`."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.partial"


def prepare_output_dir(out_dir: str | Path, force: bool) -> Path:
    """Check `out_dir`, then create (afresh) and return its partial sibling."""
    check_output_dir(out_dir, force)
    tmp = partial_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_output_dir(tmp: Path, out_dir: str | Path) -> None:
    """Replace `out_dir` by the finished `tmp` (the rename is atomic; the old dir goes first)."""
    out_dir = Path(out_dir)
    if out_dir.is_dir():
        shutil.rmtree(out_dir)
    elif out_dir.exists():
        out_dir.unlink()
    os.replace(tmp, out_dir)


def save_hf_checkpoint(
    model_chunks: list[torch.nn.Module],
    info: HFModelInfo,
    out_dir: str | Path,
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
        out_dir: target directory; must be absent or empty unless `force`.
        src_dir: the HF directory the model came from: its config.json (dtype updated) and
            tokenizer / generation files are copied.
        head: "lm" → *ForCausalLM, "value" → *ForSequenceClassification (`score.weight`).
        dtype: dtype of the written tensors; default the model's.
        max_shard_bytes: size at which a new safetensors shard is started.
        progress: show a tensors-done bar on the writing rank.
    """
    src_dir = Path(src_dir)
    expected = hm.expected_hf_tensors([r for r in hm.rules_for(info, head) if r.export], info)
    writer = None
    if dist.get_rank() == 0:
        writer = _ShardWriter(prepare_output_dir(out_dir, force), max_shard_bytes)
    bar = None
    if writer is not None and progress:
        from tqdm import tqdm

        bar = tqdm(total=len(expected), desc="export", unit="tensor")
    try:
        for name, tensor in iter_hf_tensors(model_chunks, info, head=head):
            writer.add(name, tensor.to(dtype or tensor.dtype))
            if bar is not None:
                bar.update(1)
        if writer is not None:
            if bar is not None:
                bar.close()
            files = writer.close()
            _verify(writer.dir, files, expected, writer.written)
            model_dtype = dtype or _main_dtype(writer.written)
            cfg = _hf_config_dict(src_dir, head, info, model_dtype)
            (writer.dir / "config.json").write_text(
                json.dumps(cfg, indent=2, sort_keys=True) + "\n"
            )
            for fname in HF_AUX_FILES:
                if (src_dir / fname).is_file():
                    shutil.copy2(src_dir / fname, writer.dir / fname)
            commit_output_dir(writer.dir, out_dir)
    except BaseException:
        if writer is not None:
            shutil.rmtree(writer.dir, ignore_errors=True)  # nothing partial left behind
        raise
    dist.barrier()


def _main_dtype(written: dict[str, tuple[tuple[int, ...], str]]) -> torch.dtype:
    """The dtype most tensors were written in (config.json names a single dtype)."""
    inverse = {v: k for k, v in _SAFETENSORS_DTYPE.items()}
    names = [dt for _, dt in written.values()]
    return inverse[max(set(names), key=names.count)]
