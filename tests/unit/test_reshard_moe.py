"""Resharding an MoE actor into vLLM's fused-MoE layout, by a one-process simulation.

For Qwen3-MoE and Mixtral (4 experts, `tests/reshard_refs.py`) and each training layout with
experts — TP1·EP2, TP1·EP4 (expert parallelism over the data-parallel ranks), TP2·EP2 (EP
group = TP group), TP2·EP2·ETP2, TP2·PP2·EP2 (megatron-core needs etp·ep = tp with pp > 1)
— into vLLM at every generation TP dividing the plan block: each training rank's shards are
built from random HF tensors by the checkpoint loader's transform (an expert on the EP rank
holding it, split over its expert-TP group), the plan's moves are applied, and every vLLM
shard is compared with vLLM's layout built straight from the HF tensors
(`moe_vllm_reference`). Tolerance: bit-exact (pure copies; unwritten rows stay NaN), and
every destination element is written exactly once (a count per element).
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.models.hf_config import parse_hf_config
from rl_megatron.resharding import shards
from rl_megatron.resharding.layouts import GenerationLayout, TrainingLayout
from rl_megatron.resharding.plan import Fill, PlanKey, build_plan, plan_block
from rl_megatron.rollout.vllm import specs as vllm_layout
from tests.reshard_refs import (
    MOE_MODELS,
    assert_bit_exact,
    hf_reader,
    moe_vllm_reference,
    random_hf_state,
)

# (tp, pp, dp, ep, etp) on 4 ranks (2 for TP1·EP2: its plan block is 2 ranks).
MOE_LAYOUTS = [(1, 1, 2, 2, 1), (1, 1, 4, 4, 1), (2, 1, 1, 2, 1), (2, 1, 2, 2, 2), (2, 2, 1, 2, 1)]


def _key(info, training, t_g, bucket_bytes=1 << 12):
    return PlanKey(
        info,
        training,
        GenerationLayout(t_g, training.world_size),
        vllm_layout.vllm_specs,
        padded_vocab_size(info.vocab_size, 128, training.tp),
        vllm_layout.vllm_padded_vocab(info.vocab_size, t_g),
        bucket_bytes,
        4,
    )


def _training_shards(plan, state, info):
    """Each local rank's training tensors, by the checkpoint loader's transform."""
    rules = {r.megatron: r for r in hm.rules_for(info, "lm")}
    read = hf_reader(state)
    training = plan.key.training
    out = []
    for local, specs in enumerate(plan.sources):
        tp = (training.tp, training.coordinates(local)["tp"])
        etp = (training.expert_tp, training.expert_coordinates(local)["etp"])
        tensors = {}
        for spec in specs:
            parts = spec.name.split(".")
            layer = int(parts[2]) if parts[:2] == ["decoder", "layers"] else None
            canonical = (
                spec.name if layer is None else spec.name.replace(f".{layer}.", ".{layer}.", 1)
            )
            rule = rules[canonical]
            size, rank = hm.shard_coords(rule, tp, etp)
            tensors[spec.name] = hm.hf_to_megatron_shard(
                rule, layer, read, info, size, rank, plan.key.training_padded_vocab
            )
        out.append(tensors)
    return out


def _view(tensor, spec, dim, offset, rows):
    return shards.rows_view(tensor, dim, offset, rows, spec.slot_rows if spec.stack else 0)


def simulate(plan, state, info):
    """Run the plan for one block in this process: each rank's vLLM shards and, per element,
    how many times it was written."""
    sources = _training_shards(plan, state, info)
    specs = [{s.name: s for s in ranks} for ranks in plan.targets]
    targets = [{s.name: torch.full(s.shape, float("nan")) for s in ranks} for ranks in plan.targets]
    counts = [{s.name: torch.zeros(s.shape, dtype=torch.int32) for s in ranks} for ranks in plan.targets]  # fmt: skip
    by_round: dict[int, dict[int, object]] = {}
    for rank, rounds in enumerate(plan.rounds):
        for rnd in rounds:
            by_round.setdefault(rnd.index, {})[rank] = rnd

    def write(rank, item, src):
        spec = specs[rank][item.dst_param]
        dst = _view(targets[rank][item.dst_param], spec, item.dim, item.dst_offset, item.rows)
        _view(counts[rank][item.dst_param], spec, item.dim, item.dst_offset, item.rows).add_(1)
        dst.zero_() if src is None else dst.copy_(src)

    for index in sorted(by_round):
        parts = by_round[index]
        for rank, rnd in parts.items():
            for w in rnd.writes:
                src = None
                if not isinstance(w, Fill):
                    src = sources[rank][w.src_param].narrow(w.dim, w.src_offset, w.rows)
                write(rank, w, src)
            for peer, moves in rnd.recvs.items():
                assert parts[peer].sends[rank] == moves, "send and receive lists differ"
                for m in moves:
                    write(rank, m, sources[peer][m.src_param].narrow(m.dim, m.src_offset, m.rows))
    return targets, counts


@pytest.mark.parametrize("model", sorted(MOE_MODELS))
def test_moe_layouts_into_vllm_are_bit_exact(model):
    info = parse_hf_config(MOE_MODELS[model])
    state = random_hf_state(info)
    pairs = 0
    for tp, pp, dp, ep, etp in MOE_LAYOUTS:
        training = TrainingLayout(tp, pp, dp, ep=ep, etp=etp)
        block = plan_block(training)
        for t_g in (t for t in (1, 2, 4) if block % t == 0):
            plan = build_plan(_key(info, training, t_g))
            assert plan.replica_size == block
            got, counts = simulate(plan, state, info)
            where = f"{model} tp{tp} pp{pp} ep{ep} etp{etp} t_g={t_g}"
            for rank, tensors in enumerate(got):
                gen_tp = plan.key.generation.coordinates(rank)["gen_tp"]
                want = moe_vllm_reference(
                    state, info, t_g, gen_tp, plan.key.generation_padded_vocab
                )
                assert_bit_exact(tensors, want, f"{where} rank {rank}")
                for name, count in counts[rank].items():
                    assert count.eq(1).all(), f"{where} rank {rank} {name}: written ≠ once"
            pairs += 1
    assert pairs == 13


def test_expert_parallel_block_and_traffic():
    """EP over DP: the plan covers lcm(t·p, etp·ep·p) ranks; at TP1·EP2 into two vLLM
    replicas each rank receives exactly the experts of the other EP rank, nothing else."""
    info = parse_hf_config(MOE_MODELS["qwen3_moe"])
    training = TrainingLayout(1, 1, 2, ep=2, etp=1)
    plan = build_plan(_key(info, training, 1))
    assert plan.replica_size == 2
    h, fe, e_half = info.hidden_size, info.moe_ffn_hidden_size, info.num_experts // 2
    expert_numel = 3 * fe * h  # gate, up, down
    for traffic in plan.traffic:
        assert traffic.received == info.num_layers * e_half * expert_numel
    dense = TrainingLayout(2, 1, 2)
    assert plan_block(dense) == dense.replica_size == 2


def test_stacked_spec_rows_and_views():
    """A stacked spec numbers rows slot-major; a view never crosses a slot."""
    info = parse_hf_config(MOE_MODELS["mixtral"])
    w13, w2 = [
        s for s in vllm_layout.vllm_specs(info, 2, 1, 512) if s.name.startswith("model.layers.0.")
    ][-2:]
    assert w13.name.endswith("block_sparse_moe.experts.routed_experts.w13_weight")
    assert (w13.shape, w13.stack, w13.dim, w13.rows) == ((4, 64, 64), 4, 0, 256)
    assert (w2.shape, w2.dim, w2.slot_rows, w2.row_numel) == ((4, 64, 32), 1, 32, 64)
    # Expert 2's up rows of TP rank 1: HF rows [32, 64) of w3, slot 2's second half.
    span = [
        s for s in w13.spans if s.hf_name == "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    ]
    assert [(s.offset, s.length, s.hf_start) for s in span] == [(2 * 64 + 32, 32, 32)]
    t = torch.arange(4 * 64 * 32).view(4, 64, 32)
    assert torch.equal(shards.rows_view(t, 1, 2 * 32 + 5, 3, 32), t[2, :, 5:8])
    with pytest.raises(AssertionError, match="cross a slot"):
        shards.rows_view(t, 1, 30, 4, 32)
