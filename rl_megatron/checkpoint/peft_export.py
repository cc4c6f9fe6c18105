"""Write a LoRA actor's adapters alone, in the Hugging Face PEFT layout.

    save_peft_adapter(model_chunks, info, out_dir, groups, lora=config.actor.lora,
                      base_model_name_or_path=config.model.hf_path)          # collective

The folder holds `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)` loads
onto the base model (the model's own HF folder, or the HF export of the actor with B zeroed).

Megatron's adapters sit on fused linears; PEFT's on HF's per-projection ones. The update is
the same: the fused `linear_qkv` adapter's ΔW = s·B·A has one A, so q_proj, k_proj and
v_proj each get `lora_A` = A and `lora_B` = the rows of B that build q / k / v. Those rows
are found by the rule that splits the weight (`hf_mapping.megatron_to_hf` on B's TP shards:
QKV de-interleaves per query group, GATE_UP splits fc1's [gate; up] per shard, VOCAB drops
the padding rows of an `output_layer` adapter), so the weight and its adapter can never be
split two ways. Row-parallel adapters (`linear_proj`, `linear_fc2`) map one to one; their A
is split over TP like the weight's columns and merged by the same rule. The scale
alpha/r is PEFT's `lora_alpha / r` (no rsLoRA).

Names are `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r], HF's module being the weight's name in the family table without `.weight`. An
expert's adapters get the table's per-expert names (`mlp.experts.{e}.gate_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w1`): the layout PEFT wrote for transformers 4's per-expert
linears, which PEFT (0.21.2 tested) converts on load into its adapter of transformers 5's
fused expert parameters.

Like `hf_export.save_hf_checkpoint`, every rank of DP replica 0 walks the adapters in HF
order in lockstep: the stage owning one all-gathers its split factor over TP (expert-TP
for an expert), converts it, and sends the PEFT tensors to the writing rank (TP 0, PP 0),
which writes them at their planned offsets. An MoE model at `parallel.ep > 1` is refused
as the HF export refuses it. The folder is written into a hidden sibling, verified
(names, shapes, dtypes) and renamed into place. `checkpoints_tools/megatron_to_hf.py
--adapter-only` writes the same folder from a checkpoint (`adapter_to_peft` on the global
tensors, `finish_peft_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.checkpoint.hf_export import (
    _SAFETENSORS_DTYPE,
    SafetensorsShardWriter,
    ShardPlan,
    _gather_tp,
    _order_key,
    commit_output_dir,
    prepare_output_dir,
)
from rl_megatron.checkpoint.hf_loader import (
    CheckpointError,
    global_expert_fn,
    global_layer_fn,
    read_safetensors_header,
    unwrap,
)
from rl_megatron.models.families import family
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.models.lora import MODES, SUFFIX, LoraAdapter
from rl_megatron.parallel import ParallelGroups

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix before the HF model's names
_HEAD = "output_layer.weight"  # an `output_layer_lora` adapts the LM head: HF `lm_head`


def peft_module(hf_weight: str) -> str:
    """The PEFT key stem of the HF linear whose weight is `hf_weight`, e.g.
    `model.layers.0.self_attn.q_proj.weight` → `base_model.model.model.layers.0.self_attn.q_proj`."""
    if not hf_weight.endswith(".weight"):
        raise ValueError(f"'{hf_weight}' is not a linear's weight")
    return PREFIX + hf_weight.removesuffix(".weight")


def adapter_to_peft(
    rule: hm.Rule,
    layer: int | None,
    mode: str,
    a_shards: list[torch.Tensor],
    b_shards: list[torch.Tensor],
    info: HFModelInfo,
) -> list[tuple[str, torch.Tensor]]:
    """PEFT `(name, tensor)`s of one adapter from its TP shards (rank order).

    Args:
        rule: the adapted weight's row of the family table (`rule.hf`: its HF projections).
        mode: "column" (B split like the weight's rows, A replicated) or "row" (A split
            like the weight's columns, B replicated).
        a_shards: A [r, in/tp] per rank for "row", else `[A]` [r, in].
        b_shards: B [out/tp, r] per rank for "column", else `[B]` [out, r].
    Returns:
        For each HF projection in `rule.hf` order: (`….lora_A.weight`, [r, in]), then
        (`….lora_B.weight`, [out, r]).
    """
    if mode == "column":
        # The weight's rule splits B's rows (q/k/v, gate/up, vocabulary padding); A is shared.
        parts = hm.megatron_to_hf(rule, layer, b_shards, info)
        pairs = [(name, a_shards[0], b) for name, b in parts]
    else:
        # A row-parallel weight maps to one HF projection; its columns merge like A's.
        ((name, a),) = hm.megatron_to_hf(rule, layer, a_shards, info)
        pairs = [(name, a, b_shards[0])]
    out = []
    for name, a, b in pairs:
        stem = peft_module(name)
        out += [(f"{stem}.lora_A.weight", a), (f"{stem}.lora_B.weight", b)]
    return out


def peft_shapes(rule: hm.Rule, layer: int | None, rank: int, info: HFModelInfo) -> list:
    """(PEFT name, shape) of what `adapter_to_peft` returns for `rule`, without tensors."""
    out = []
    for name, shape in rule.hf:
        rows, cols = hm.hf_shape(shape, info)
        stem = peft_module(name.format(layer=layer))
        out += [(f"{stem}.lora_A.weight", (rank, cols)), (f"{stem}.lora_B.weight", (rows, rank))]
    return out


def adapter_config(
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model_name_or_path: str | None,
) -> dict:
    """`adapter_config.json` of a plain LoRA: the fields `peft.LoraConfig` reads to rebuild
    the adapter (scale lora_alpha / r, no rsLoRA / DoRA, no bias, nothing else trained).

    Args:
        target_modules: HF module names (`q_proj`, …), matched by PEFT as name suffixes.
    """
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


# ------------------------------------------------------------------ model chunks → PEFT


@dataclasses.dataclass
class _Entry:
    """One adapter, known to every rank of the exporting DP replica."""

    key: tuple  # HF order (`hf_export._order_key` of the adapted weight)
    stage: int  # the PP stage holding it
    rule: hm.Rule
    layer: int | None
    mode: str
    rank: int
    dtype: str


def _head_rule(info: HFModelInfo) -> hm.Rule:
    """The LM head's untied row: a head adapter is PEFT's `lm_head` even where HF ties the
    head's weight to the embedding."""
    return family(info.model_type).lm_head


def _local_adapters(chunk: torch.nn.Module, rules: list[hm.Rule], info: HFModelInfo):
    """(rule, global layer, adapter) of every adapter in one chunk, via its base weight's name."""
    by_name = {rule.megatron: rule for rule in rules}
    to_layer = global_layer_fn(chunk) if hasattr(chunk, "decoder") else None
    to_expert = global_expert_fn(chunk)
    for path, module in chunk.named_modules():
        if not isinstance(module, LoraAdapter):
            continue
        weight = path.removesuffix(SUFFIX) + ".weight"
        canonical, layer = hm.canonical_param_name(weight, to_layer, to_expert, by_name)
        rule = _head_rule(info) if canonical == _HEAD else by_name.get(canonical)
        if rule is None:
            raise hm.MappingError(f"adapter '{path}' adapts '{weight}', which the table lacks")
        yield rule, layer, module


def _schedule(model_chunks, info: HFModelInfo, groups: ParallelGroups):
    """Every adapter in HF order with its stage, and this stage's adapters by order key
    (collective over the PP group); None outside DP replica 0."""
    layout = groups.layout
    if info.is_moe and layout.ep > 1:
        raise CheckpointError(
            "exporting an MoE model's adapters at parallel.ep > 1 from memory is not "
            "supported yet (the HF export refuses it too)"
        )
    mine = layout.coordinates(dist.get_rank())
    if mine["dp"] != 0 or mine["cp"] != 0:
        return None
    rules = hm.rules_for(info, "lm")
    local: dict[tuple, LoraAdapter] = {}
    described = []
    for chunk in model_chunks:
        for rule, layer, adapter in _local_adapters(unwrap(chunk), rules, info):
            index = rules.index(rule) if rule in rules else len(rules)  # head: last
            key = _order_key(index, layer, rule.megatron)
            local[key] = adapter
            dtype = str(adapter.lora_a.dtype).split(".")[-1]
            described.append((key, rule, layer, adapter.mode, adapter.rank, dtype))
    per_stage: list = [None] * groups.pp.size()
    dist.all_gather_object(per_stage, described, group=groups.pp)
    entries = sorted(
        (
            _Entry(key, stage, *rest)
            for stage, items in enumerate(per_stage)
            for key, *rest in items
        ),
        key=lambda e: e.key,
    )
    return entries, local, mine, dist.get_process_group_ranks(groups.pp)


def iter_peft_tensors(
    model_chunks: list[torch.nn.Module], info: HFModelInfo, groups: ParallelGroups
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(peft_name, cpu_tensor)` of every adapter, in HF order, on the writing rank (TP 0,
    PP 0 of DP replica 0), nothing elsewhere (`rollout/vllm/lora_sync.py` sends them on).
    Collective: every rank iterates it to the end."""
    plan = _schedule(model_chunks, info, groups)
    if plan is not None:
        yield from _iter_scheduled(plan, info, groups)


def _iter_scheduled(
    plan, info: HFModelInfo, groups: ParallelGroups
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(peft_name, cpu_tensor)` of every adapter on the writing rank (TP 0, PP 0), HF
    order, nothing elsewhere; every rank of DP replica 0 walks it to the end."""
    entries, local, mine, pp_ranks = plan
    writer = mine["tp"] == 0 and mine["pp"] == 0
    device = next(iter(local.values())).lora_a.device if local else torch.device("cpu")
    for e in entries:
        if e.stage == mine["pp"]:
            adapter = local[e.key]
            group = groups.etp if e.rule.expert is not None else groups.tp
            a, b = adapter.lora_a.detach(), adapter.lora_b.detach()
            # The split factor is gathered like the weight it adapts (same rule, same dim).
            a_shards = _gather_tp(a, e.rule, group) if e.mode == "row" else [a]
            b_shards = _gather_tp(b, e.rule, group) if e.mode == "column" else [b]
            if mine["tp"] != 0:
                continue
            for name, tensor in adapter_to_peft(e.rule, e.layer, e.mode, a_shards, b_shards, info):
                if writer:
                    yield name, tensor.to("cpu", copy=True).contiguous()
                else:
                    dist.send(tensor.contiguous(), dst=pp_ranks[0])
        elif writer:
            for name, shape in peft_shapes(e.rule, e.layer, e.rank, info):
                buf = torch.empty(shape, dtype=getattr(torch, e.dtype), device=device)
                dist.recv(buf, src=pp_ranks[e.stage])
                yield name, buf.cpu()


def save_peft_adapter(
    model_chunks: list[torch.nn.Module],
    info: HFModelInfo,
    out_dir: str | Path,
    groups: ParallelGroups,
    *,
    lora,
    base_model_name_or_path: str | None,
    dtype: torch.dtype | None = None,
    force: bool = False,
) -> None:
    """Write the actor's adapters as a PEFT LoRA folder (collective; rank 0 writes).

    Args:
        model_chunks: this rank's GPTModel chunks with their adapters.
        info: the model's parsed HF config.
        out_dir: target folder; must be absent or empty unless `force`.
        lora: `actor.lora` (its rank, alpha and dropout go to adapter_config.json).
        base_model_name_or_path: the HF model the adapter applies to (`model.hf_path`).
        dtype: dtype of the written tensors; default the adapters'.
    """
    # `apply_lora` adapts something on every rank or refuses: none here is the caller's slip.
    if not any(isinstance(m, LoraAdapter) for c in model_chunks for m in c.modules()):
        raise CheckpointError(f"{out_dir}: the model has no LoRA adapter to export")
    plan = _schedule(model_chunks, info, groups)
    tmp = writer = problem = None
    if dist.get_rank() == 0:
        planned = [
            (name, shape, dtype or getattr(torch, e.dtype))
            for e in plan[0]
            for name, shape in peft_shapes(e.rule, e.layer, e.rank, info)
        ]
        try:
            if any(e.rank != lora.rank for e in plan[0]):
                raise CheckpointError(f"{out_dir}: the adapters' rank is not actor.lora.rank")
            tmp = prepare_output_dir(out_dir, force)
            writer = SafetensorsShardWriter(tmp, [ShardPlan(ADAPTER_WEIGHTS, tuple(planned))])
        except (CheckpointError, OSError) as exc:
            problem = str(exc)
    _raise_if_any(problem)  # before the walk: no rank is left inside a collective
    try:
        # A failing write stops the writing, not the walk: the other ranks are sending.
        for name, tensor in _iter_scheduled(plan, info, groups) if plan is not None else ():
            if writer is not None and problem is None:
                try:
                    writer.write(name, tensor.to(dtype or tensor.dtype))
                except (CheckpointError, OSError) as exc:
                    problem = str(exc)
        if writer is not None and problem is None:
            try:
                writer.close()
                finish_peft_dir(
                    tmp,
                    planned,
                    alpha=lora.alpha,
                    dropout=lora.dropout,
                    base_model_name_or_path=base_model_name_or_path,
                )
                commit_output_dir(tmp, out_dir)
            except (CheckpointError, OSError) as exc:
                problem = str(exc)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # nothing partial left behind
    _raise_if_any(problem)  # also the barrier that ends the export


def _raise_if_any(problem: str | None) -> None:
    """Rank 0's problem, raised as one CheckpointError line on every rank."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])


def finish_peft_dir(
    directory: Path,
    planned: list,
    *,
    alpha: float,
    dropout: float,
    base_model_name_or_path: str | None,
) -> None:
    """Verify the written `adapter_model.safetensors` against `planned` ((name, shape, dtype)
    in file order), then write `adapter_config.json` (r from the tensors' shapes)."""
    _verify(directory / ADAPTER_WEIGHTS, planned)
    ranks = {shape[0] for name, shape, _ in planned if name.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise CheckpointError(f"{directory}: the adapters' ranks differ ({sorted(ranks)})")
    config = adapter_config(
        rank=ranks.pop(),
        alpha=alpha,
        dropout=dropout,
        # `….q_proj.lora_A.weight` → q_proj: the HF projections with an adapter
        target_modules=[name.split(".")[-3] for name, _, _ in planned],
        base_model_name_or_path=base_model_name_or_path,
    )
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (directory / ADAPTER_CONFIG).write_text(text)


def lora_mode(rule: hm.Rule) -> str:
    """How the adapter of `rule`'s weight splits over TP: its module's `lora.MODES` entry;
    the LM head (`output_layer`) is column parallel."""
    module = rule.megatron.removesuffix(".weight").rpartition(".")[2]
    return "column" if module == "output_layer" else MODES[module]


def _verify(path: Path, planned: list) -> None:
    """The written file holds exactly the planned names, shapes and dtypes."""
    found = {
        name: (tuple(shape), dt) for name, (dt, shape) in read_safetensors_header(path).items()
    }
    want = {name: (tuple(shape), _SAFETENSORS_DTYPE[dt]) for name, shape, dt in planned}
    if found != want:
        wrong = sorted(set(found.items()) ^ set(want.items()))[:2]
        raise CheckpointError(f"{path}: holds other tensors than planned ({wrong})")
