"""Resharding plans, run by a one-process simulation of every rank (no torch.distributed).

For each layout pair the simulation fills each training rank's shards from random HF
tensors with the checkpoint loader's `hf_to_megatron_shard`, applies the plan's moves and
fills round by round (a receive reads the peer's rows, after checking the peer sends the
same message), and compares every generation shard with the engine's layout built straight
from the HF tensors (`tests/reshard_refs.py`). Tolerance: bit-exact (pure copies).

Also checked on every plan: the per-rank send + receive staging of each round is at most
one bucket; each rank receives exactly the rows of its generation shard it does not hold
(computed here from row sets); the HybridFlow layout meets (d_g − 1)/(t·p)·M.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.resharding import shards
from rl_megatron.resharding.layouts import (
    GenerationLayout,
    TrainingLayout,
    generation_layout_for,
    hybridflow_generation_layout,
)
from rl_megatron.resharding.plan import Fill, PlanKey, build_plan
from rl_megatron.rollout.vllm import specs as vllm_layout
from tests.reshard_refs import (
    LAYOUTS,
    MODELS,
    ROLLOUT_TPS,
    assert_bit_exact,
    hf_reader,
    megatron_reference,
    model_info,
    random_hf_state,
    vllm_reference,
)

# The parameter layouts a plan can target, by the name the cases use.
TARGET_SPECS = {"vllm": vllm_layout.vllm_specs, "megatron": shards.megatron_generation_specs}


def _key(info, training, generation, target, bucket_bytes=1 << 12, elem=4):
    t_g = generation.tp
    gen_vocab = (
        vllm_layout.vllm_padded_vocab(info.vocab_size, t_g)
        if target == "vllm"
        else padded_vocab_size(info.vocab_size, 128, t_g)
    )
    return PlanKey(
        info,
        training,
        generation,
        TARGET_SPECS[target],
        padded_vocab_size(info.vocab_size, 128, training.tp),
        gen_vocab,
        bucket_bytes,
        elem,
    )


def _training_shards(plan, state, info):
    """Each local rank's training tensors, built by the checkpoint loader's transform."""
    rules = {r.megatron: r for r in hm.rules_for(info, "lm")}
    read = hf_reader(state)
    training = plan.key.training
    out = []
    for local, specs in enumerate(plan.sources):
        tp_rank = training.coordinates(local)["tp"]
        tensors = {}
        for spec in specs:
            parts = spec.name.split(".")
            layer = int(parts[2]) if parts[:2] == ["decoder", "layers"] else None
            canonical = (
                spec.name if layer is None else ".".join([*parts[:2], "{layer}", *parts[3:]])
            )
            tensors[spec.name] = hm.hf_to_megatron_shard(
                rules[canonical],
                layer,
                read,
                info,
                training.tp,
                tp_rank,
                plan.key.training_padded_vocab,
            )
        out.append(tensors)
    return out


def simulate(plan, state, info):
    """Run the plan for one replica in this process; returns each rank's generation shards."""
    sources = _training_shards(plan, state, info)
    targets = [{s.name: torch.full(s.shape, float("nan")) for s in specs} for specs in plan.targets]
    bucket = plan.key.bucket_bytes // plan.key.elem_size
    by_round: dict[int, dict[int, object]] = {}
    for rank, rounds in enumerate(plan.rounds):
        for rnd in rounds:
            by_round.setdefault(rnd.index, {})[rank] = rnd
    for index in sorted(by_round):
        parts = by_round[index]
        for rank, rnd in parts.items():
            assert rnd.staging_numel() <= bucket, f"round {index} rank {rank} over the bucket"
            for w in rnd.writes:
                dst = targets[rank][w.dst_param].narrow(w.dim, w.dst_offset, w.rows)
                if isinstance(w, Fill):
                    dst.zero_()
                else:
                    dst.copy_(sources[rank][w.src_param].narrow(w.dim, w.src_offset, w.rows))
            for peer, moves in rnd.recvs.items():
                assert parts[peer].sends[rank] == moves, "send and receive lists differ"
                for m in moves:
                    src = sources[peer][m.src_param].narrow(m.dim, m.src_offset, m.rows)
                    targets[rank][m.dst_param].narrow(m.dim, m.dst_offset, m.rows).copy_(src)
    return targets


def _rows_held(specs):
    """{(hf_name, row)} a rank's shards hold (padding excluded)."""
    return {
        (s.hf_name, s.hf_start + i)
        for spec in specs
        for s in spec.spans
        if s.hf_name
        for i in range(s.length)
    }


def _check_traffic(plan):
    for rank in range(plan.replica_size):
        have = _rows_held(plan.sources[rank])
        row_numel = {}
        for spec in plan.targets[rank]:
            for s in spec.spans:
                if s.hf_name:
                    row_numel[s.hf_name] = spec.row_numel
        need = [
            (s.hf_name, s.hf_start + i)
            for spec in plan.targets[rank]
            for s in spec.spans
            if s.hf_name
            for i in range(s.length)
        ]
        missing = sum(row_numel[name] for name, row in need if (name, row) not in have)
        assert plan.traffic[rank].received == missing, f"rank {rank} receives redundant rows"
    assert sum(t.sent for t in plan.traffic) == sum(t.received for t in plan.traffic)


def _reference(target, state, info, t_g, gen_tp, padded):
    if target == "vllm":
        return vllm_reference(state, info, t_g, gen_tp, padded)
    return megatron_reference(state, info, t_g, gen_tp, padded)


def _valid_pairs():
    for (t, p, d), t_g in itertools.product(LAYOUTS, ROLLOUT_TPS):
        if (t * p) % t_g == 0:
            yield t, p, d, t_g


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("target", ["vllm", "megatron"])
def test_every_layout_pair_is_bit_exact(model, target):
    info = model_info(model)
    state = random_hf_state(info)
    for t, p, d, t_g in _valid_pairs():
        training = TrainingLayout(t, p, d)
        for gen in {
            generation_layout_for(training, t_g),
            hybridflow_generation_layout(training, t_g),
        }:
            plan = build_plan(_key(info, training, gen, target))
            got = simulate(plan, state, info)
            for rank, tensors in enumerate(got):
                gen_tp = gen.coordinates(rank)["gen_tp"]
                want = _reference(
                    target, state, info, t_g, gen_tp, plan.key.generation_padded_vocab
                )
                assert_bit_exact(
                    tensors, want, f"{model} {target} t,p,d={t, p, d} t_g={t_g} rank {rank}"
                )
            _check_traffic(plan)


def test_vpp_and_eight_ranks():
    """Interleaved chunks renumber layers; bigger grids and bf16 elements plan the same way."""
    info = model_info("qwen2_tied")
    state = random_hf_state(info)
    cases = [
        (1, 2, 1, 2, 1),
        (2, 2, 2, 2, 2),
        (2, 2, 1, 2, 4),
        (4, 2, 1, None, 4),
        (2, 4, 1, None, 2),
    ]
    for t, p, d, vpp, t_g in cases:
        training = TrainingLayout(t, p, d, vpp=vpp)
        for target in ("vllm", "megatron"):
            plan = build_plan(
                _key(info, training, generation_layout_for(training, t_g), target, elem=2)
            )
            for rank, tensors in enumerate(simulate(plan, state, info)):
                want = _reference(
                    target, state, info, t_g, rank % t_g, plan.key.generation_padded_vocab
                )
                assert_bit_exact(tensors, want, f"vpp={vpp} t,p={t, p} t_g={t_g} rank {rank}")


def test_vllm_replicates_kv_heads_beyond_tp():
    """t_g = 8 > 4 KV heads: vLLM gives each pair of ranks the same KV head."""
    info = model_info("llama_gqa")
    state = random_hf_state(info)
    training = TrainingLayout(2, 4, 1)
    plan = build_plan(_key(info, training, generation_layout_for(training, 8), "vllm"))
    for rank, tensors in enumerate(simulate(plan, state, info)):
        assert_bit_exact(tensors, vllm_reference(state, info, 8, rank, 512), f"rank {rank}")


def test_layer_placement_with_vpp():
    assert list(shards.chunk_layers(8, 2, 2, pp_rank=0, vp_stage=0)) == [0, 1]
    assert list(shards.chunk_layers(8, 2, 2, pp_rank=1, vp_stage=0)) == [2, 3]
    assert list(shards.chunk_layers(8, 2, 2, pp_rank=0, vp_stage=1)) == [4, 5]
    assert list(shards.chunk_layers(8, 2, None, pp_rank=1, vp_stage=0)) == [4, 5, 6, 7]


def test_zero_traffic_when_layouts_coincide():
    """t_g == t and p == 1: every row is local (vocabularies split alike at V = 512)."""
    info = model_info("llama_gqa")
    for t, d in ((1, 4), (2, 2), (4, 1)):
        training = TrainingLayout(t, 1, d)
        for target in ("vllm", "megatron"):
            plan = build_plan(_key(info, training, generation_layout_for(training, t), target))
            assert all(x.sent == x.received == 0 for x in plan.traffic)
            assert all(not r.sends and not r.recvs for rr in plan.rounds for r in rr)


def test_hybridflow_formula():
    """Strided generation groups receive no redundant byte: each rank gets its generation
    shard (1/t_g of the TP-split tensors, all norms) minus what it holds. Where its
    training shard is 1/(t·p) of the split tensors (stages of equal size: pp ≤ 2 here,
    embedding and head being equal), that is HybridFlow's (d_g − 1)/(t·p) · M."""
    info = model_info("llama_gqa")
    split = repl = 0
    for shape in hm.expected_hf_tensors(hm.rules_for(info, "lm"), info).values():
        if len(shape) == 1:  # norms: replicated over TP
            repl += torch.Size(shape).numel()
        else:
            split += torch.Size(shape).numel()
    balanced = 0
    for (t, p, d), t_g in itertools.product(LAYOUTS, ROLLOUT_TPS):
        if (t * p) % t_g or t % t_g:
            continue
        training = TrainingLayout(t, p, d)
        plan = build_plan(_key(info, training, hybridflow_generation_layout(training, t_g), "vllm"))
        d_g = t * p // t_g
        for rank, traffic in enumerate(plan.traffic):
            repl_held = sum(s.numel for s in plan.sources[rank] if len(s.shape) == 1)
            split_held = sum(s.numel for s in plan.sources[rank] if len(s.shape) == 2)
            assert traffic.received == split // t_g - split_held + repl - repl_held
            if split_held * t * p == split:
                balanced += 1
                formula = (d_g - 1) * split // (t * p)
                assert traffic.received - (repl - repl_held) == formula, (t, p, d, t_g)
    assert balanced >= 20


def test_consecutive_groups_cost_more_when_one_lt_tg_lt_t():
    """vLLM's consecutive TP groups at t=4, t_g=2: ranks 1 and 2 hold a quarter that is not
    in their generation half, so they receive twice HybridFlow's (d_g−1)/(t·p)·M."""
    info = model_info("llama_gqa")
    training = TrainingLayout(4, 1, 1)
    plain = build_plan(_key(info, training, generation_layout_for(training, 2), "vllm"))
    strided = build_plan(_key(info, training, hybridflow_generation_layout(training, 2), "vllm"))
    quarter = strided.traffic[0].received
    assert [x.received for x in strided.traffic] == [quarter] * 4
    assert [x.received for x in plain.traffic] == [quarter, 2 * quarter, 2 * quarter, quarter]


def test_rounds_respect_the_bucket_and_split_big_moves():
    info = model_info("llama_gqa")
    training = TrainingLayout(1, 2, 2)
    gen = generation_layout_for(training, 1)
    row = info.hidden_size * 4
    for bucket in (row, 3 * row, 1 << 20):
        plan = build_plan(_key(info, training, gen, "vllm", bucket_bytes=bucket))
        peaks = [plan.peak_staging_bytes(r) for r in range(2)]
        assert max(peaks) <= bucket
        assert sum(plan.traffic[0].received for _ in [0]) > 0
    small = build_plan(_key(info, training, gen, "vllm", bucket_bytes=row))
    big = build_plan(_key(info, training, gen, "vllm", bucket_bytes=1 << 20))
    assert small.num_rounds > big.num_rounds == 1
    with pytest.raises(ValueError, match="smaller than one row"):
        build_plan(_key(info, training, gen, "vllm", bucket_bytes=row - 4))


def test_plans_are_pure_functions_of_their_key():
    """No cache here: a weight sync keeps the plan it runs (tests/unit/test_reshard_caches.py)."""
    info = model_info("llama_gqa")
    training = TrainingLayout(2, 2, 1)
    key = _key(info, training, generation_layout_for(training, 2), "vllm")
    assert build_plan(key) == build_plan(key)
    other = _key(info, training, generation_layout_for(training, 4), "vllm")
    assert build_plan(other) != build_plan(key)


def test_invalid_pairs_are_refused():
    info = model_info("llama_gqa")
    training = TrainingLayout(2, 1, 2)
    specs = vllm_layout.vllm_specs
    bad = PlanKey(info, training, GenerationLayout(4, 4), specs, 512, 512, 1 << 20, 4)
    with pytest.raises(ValueError, match="does not divide"):
        build_plan(bad)


def test_generation_layouts():
    """vLLM's consecutive TP groups, and HybridFlow's strided ones inside a training TP
    group (each rank's training quarter lies in its generation half)."""
    training = TrainingLayout(4, 1, 2)
    plain = generation_layout_for(training, 2)
    assert [plain.coordinates(r)["gen_tp"] for r in range(8)] == [0, 1] * 4
    assert plain.tp_group(2) == [2, 3]
    strided = hybridflow_generation_layout(training, 2)
    assert strided.tp_stride == 2
    assert [strided.coordinates(r)["gen_tp"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [strided.coordinates(r)["gen_dp"] for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert strided.tp_group(1) == [1, 3] and strided.tp_group(6) == [4, 6]
    for r in range(8):
        quarter = training.coordinates(r)["tp"]
        assert quarter // 2 == strided.coordinates(r)["gen_tp"]
    # t_g not dividing t: no strided layout holds a training shard inside a generation one.
    assert hybridflow_generation_layout(TrainingLayout(1, 4, 1), 2).tp_stride == 1


def test_coalesced_copies_equal_one_copy_per_block():
    """The copy program's strided runs write exactly what block-by-block copies would."""
    from rl_megatron.resharding.copy_program import (
        ARENA,
        DST,
        SRC,
        Block,
        Tensors,
        Zero,
        coalesce,
        even_runs,
        run_ops,
    )

    assert list(even_runs([(0, 0), (10, 4), (20, 8), (25, 30)], 3)) == [
        ((0, 0), 3, 10, 4),
        ((25, 30), 1, 3, 3),
    ]
    # Overlapping destinations (step < numel) are never merged.
    assert [n for _, n, _, _ in even_runs([(0, 0), (2, 5), (4, 10)], 3)] == [1, 1, 1]

    gen = torch.Generator().manual_seed(0)
    # Megatron-style interleaved QKV (per group: 4 q rows, 2 k, 2 v) → [Q | K | V].
    groups, q, kv, hidden = 3, 4, 2, 5
    src = torch.randn(groups * (q + 2 * kv), hidden, generator=gen)
    expected, got = torch.zeros_like(src), torch.zeros_like(src)
    blocks = []
    for g in range(groups):
        base = g * (q + 2 * kv)
        for dst_row, src_row, rows in [
            (g * q, base, q),
            (groups * q + g * kv, base + q, kv),
            (groups * (q + kv) + g * kv, base + q + kv, kv),
        ]:
            expected[dst_row : dst_row + rows] = src[src_row : src_row + rows]
            blocks.append(
                ((DST, "w"), dst_row * hidden, (SRC, "w"), src_row * hidden, rows * hidden)
            )
    runs = coalesce(blocks)
    assert sorted(r.count for r in runs) == [3, 3, 3]  # one strided copy each for q, k, v
    # A flat range into the arena, a block along dim 1 and a zero fill beside them.
    arena = torch.zeros(40)
    col, ones = torch.zeros(6, 4), torch.ones(6, 4)
    ops = runs + coalesce([((ARENA, ""), 7, (SRC, "w"), 11, 5)])
    ops += [Block((DST, "col"), 1, (SRC, "ones"), 0, dim=1, rows=2), Zero((DST, "w2"), 0, 1, 2)]
    w2 = torch.ones(4, 3)
    dsts = {"w": got, "col": col, "w2": w2}
    run_ops(ops, Tensors({"w": src, "ones": ones}, dsts.__getitem__, arena))
    assert torch.equal(got, expected)
    assert torch.equal(arena[7:12], src.view(-1)[11:16]) and arena[:7].eq(0).all()
    assert col[:, 1:3].eq(1).all() and col[:, [0, 3]].eq(0).all()
    assert w2[1:3].eq(0).all() and w2[[0, 3]].eq(1).all()


def test_blocks_end_to_end_in_one_destination_become_one_concatenation():
    """Single blocks from different tensors that meet end to end in one destination (a
    stacked tensor's experts) are one `Concat`, in destination order whatever order the
    plan lists them in; a block after a gap stays a copy of its own. Either way the
    elements land where block-by-block copies would put them."""
    from rl_megatron.resharding.copy_program import (
        DST,
        SRC,
        Concat,
        Run,
        Tensors,
        coalesce,
        run_ops,
    )

    gen = torch.Generator().manual_seed(1)
    srcs = {f"e{i}": torch.randn(8, generator=gen) for i in range(4)}
    # (dst start, source, source start, numel): [0, 6) ← e0[0:6], [6, 10) ← e1[2:6],
    # [10, 16) ← e2[1:7], a gap, [18, 24) ← e3[0:6]; listed out of order.
    pieces = [(10, "e2", 1, 6), (18, "e3", 0, 6), (0, "e0", 0, 6), (6, "e1", 2, 4)]
    ops = coalesce([((DST, "w"), d0, (SRC, name), s0, n) for d0, name, s0, n in pieces])
    (concat,) = [op for op in ops if isinstance(op, Concat)]
    assert concat.dst_start == 0 and concat.numel == 16
    assert concat.pieces == (((SRC, "e0"), 0, 6), ((SRC, "e1"), 2, 4), ((SRC, "e2"), 1, 6))
    assert [op for op in ops if not isinstance(op, Concat)] == [
        Run((DST, "w"), 18, 6, (SRC, "e3"), 0, 6, 1, 6)
    ]
    got = torch.full((24,), float("nan"))
    run_ops(ops, Tensors(srcs, {"w": got}.__getitem__, None))
    expected = torch.full((24,), float("nan"))
    for d0, name, s0, n in pieces:
        expected[d0 : d0 + n] = srcs[name][s0 : s0 + n]
    assert torch.equal(got[:16], expected[:16]) and torch.equal(got[18:], expected[18:])
    assert got[16:18].isnan().all()
