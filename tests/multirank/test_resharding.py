"""3D resharding on 4 gloo ranks: real Megatron actors → generation layouts, bit-exact.

One spawn runs every case (megatron import dominates start-up): for each training layout
(t, p, d) ∈ {(1,1,4), (2,1,2), (4,1,1), (2,2,1), (1,2,2), (1,4,1)}, plus (1,2,2) with two
virtual stages, the three tiny models (Llama-GQA; Qwen2 with QKV bias and tied embeddings;
Qwen3 with QK-norm, head_dim ≠ hidden/heads, tied embeddings and a vocabulary of 100 that
Megatron and vLLM pad differently) are built as actors from HF
checkpoints by the trainer's own builder, and for each t_g ∈ {1, 2, 4} dividing t·p:

* vLLM's layout (plain tensors, `TensorStoreTarget`) is synced by a `WeightSync` and
  compared with the checkpoint sliced straight into vLLM's shards (`tests/reshard_refs.py`);
* a `MegatronEngine` at TP t_g (parallel state rebuilt, weights left uninitialised) is
  synced; its parameters are compared with what the checkpoint loader puts there at t_g,
  and its greedy generation with `transformers`' (computed in this process).

Tolerance: parameters bit-exact (pure copies; unwritten rows start as NaN). Greedy tokens
exact; the reference's smallest top-1 lead is checked to exceed 1e-4 (fp32 noise between
Megatron and transformers is ~1e-6).

Each rank writes its bytes sent / received, staging peak and wall time per case to JSON;
the tests below check traffic, memory and safety on those numbers.

In cuda mode (tests/spawn.py) the actors and engines live on the ranks' GPUs, still in
fp32 (TF32 off), with the same tolerances: copies are bit-exact in any dtype. The world is
min(4, GPUs): on 2 GPUs every 2-rank layout — (1,1,2), (2,1,1), (1,2,1), and (1,2,1) with
two virtual stages — against t_g ∈ {1, 2}. The memory case's peak is then the CUDA
allocator's (`device_peak_extra_bytes`) instead of the CPU profiler's.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.reshard_refs import MODELS, ROLLOUT_TPS, layouts_for
from tests.spawn import ON_GPU, max_ranks, run_on_ranks, test_device

pytestmark = pytest.mark.slow

WORLD = min(4, max_ranks())
LAYOUTS = layouts_for(WORLD)
GEN_TPS = tuple(t_g for t_g in ROLLOUT_TPS if t_g <= WORLD)
BUCKET_MB = 1 / 64  # 16 KiB: the tiny models then need many rounds
MEMORY_BUCKET_MB = 1 / 256  # 4 KiB for the profiled case
# Allocations besides the transfer arena that may be live during a sync (the agreement
# all-reduces' few int64 tensors, the profiler's own): measured 0–16 B; allowed 1 KiB, which
# on a GPU is two of the CUDA caching allocator's 512-byte blocks.
MEMORY_SLACK_BYTES = 1024
PROMPTS = [[5, 17, 33, 2, 9], [70, 7]]
MAX_NEW, MIN_GAP = 6, 1e-4
VPP_LAYOUT = (1, 2, WORLD // 2, 2)
MEMORY_LAYOUT = (2, 2, 1) if WORLD == 4 else (1, 2, 1)  # the profiled sync's layout


def _pairs(t: int, p: int):
    return [t_g for t_g in GEN_TPS if (t * p) % t_g == 0]


def _mismatches(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    for name, w in want.items():
        g = got.get(name)
        if g is not None and (
            g.shape != w.shape or not torch.equal(g.detach().cpu(), w.detach().cpu())
        ):
            bad.append(name)
    return bad


def _profiled_peak(fn) -> tuple[object, int]:
    """Run `fn` (a sync) under torch.profiler; peak bytes of CPU tensors allocated inside it.

    On a GPU the sync's buffers are CUDA tensors, which the sync measures itself with the
    CUDA allocator's peak (`device_peak_extra_bytes`): that is returned instead."""
    if ON_GPU:
        stats = fn()
        return stats, stats.device_peak_extra_bytes
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = []
    for e in prof.events():
        # Ops report what they allocated themselves; frees arrive as "[memory]" events.
        n = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if n:
            events.append((e.time_range.start, n))
    live = peak = 0
    for _, n in sorted(events):
        live += n
        peak = max(peak, live)
    return out, peak


def _body(rank: int, world_size: int, spec: dict) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.resharding.layouts import MEGATRON_RANK_ORDER, TrainingLayout
    from rl_megatron.resharding.layouts import generation_layout_for as gen_for
    from rl_megatron.resharding.plan import build_plan
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.megatron.engine import MegatronEngine
    from rl_megatron.rollout.megatron.target import MegatronEngineTarget
    from rl_megatron.rollout.sampling import SamplingParams
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.reshard_refs import megatron_reference, vllm_reference

    infos = {m: load_hf_config(spec["ckpts"][m]) for m in MODELS}
    states = {m: load_file(f"{spec['ckpts'][m]}/model.safetensors") for m in MODELS}
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    cases: list[dict] = []
    version = 0

    def init(tp: int, pp: int, vpp: int | None = None) -> None:
        # Each rebuild leaks gloo threads (~50 per rank): rebuild once per layout only.
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, vpp, order=MEGATRON_RANK_ORDER)
        model_parallel_cuda_manual_seed(0)

    def sync(actor, target, info, training):
        nonlocal version
        version += 1
        weight_sync = WeightSync(target, info=info, training=training, bucket_mb=BUCKET_MB)
        return weight_sync.sync(actor, version)

    def record(m, training, t_g, target, stats, plan=None):
        layout = [training.tp, training.pp, training.dp, training.vpp]
        case = dict(model=m, layout=layout, t_g=t_g, target=target, **stats.as_dict())
        if plan is not None:
            local = plan.local_rank(rank)
            case["plan_received"] = plan.traffic[local].received * plan.key.elem_size
            case["plan_sent"] = plan.traffic[local].sent * plan.key.elem_size
            case["hybridflow_bytes"] = plan.hybridflow_bytes()
        cases.append(case)

    # Phase 1, per training layout: build the actors (kept: syncing needs only their
    # tensors, not Megatron's groups) and sync into vLLM's layout for every t_g.
    actors: dict = {}
    for t, p, d, vpp in [(*lay, None) for lay in LAYOUTS] + [VPP_LAYOUT]:
        init(t, p, vpp)
        training = TrainingLayout(t, p, d, vpp=vpp)
        actors[training] = {
            m: build_actor(spec["ckpts"][m], ParallelLayout.from_megatron(), dtype=torch.float32)
            for m in MODELS
        }
        for t_g, m in itertools.product(_pairs(t, p), MODELS):
            info = infos[m]
            gen = gen_for(training, t_g)
            padded = vllm_layout.vllm_padded_vocab(info.vocab_size, t_g)
            store = TensorStoreTarget(
                vllm_layout.vllm_specs, info, gen, rank, padded, device=test_device()
            )
            stats = sync(actors[training][m], store, info, training)
            want = vllm_reference(states[m], info, t_g, gen.coordinates(rank)["gen_tp"], padded)
            bad = _mismatches(store.tensors, want)
            assert not bad, f"{m} {(t, p, d, vpp)} t_g={t_g} vllm layout: {bad[:4]}"
            plan = build_plan(_plan_key(info, training, gen, vllm_layout.vllm_specs, padded))
            record(m, training, t_g, "vllm_store", stats, plan)
        if (t, p, d) == MEMORY_LAYOUT:
            cases.append(_profiled_sync(rank, actors[training]["llama_gqa"], infos, training))

    # Phase 2, per t_g: one Megatron engine per model at TP t_g, synced from every
    # training layout (NaN-filled before each sync, so every row must be written).
    for t_g in GEN_TPS:
        init(t_g, 1)
        for m in MODELS:
            info = infos[m]
            chunks = build_gpt_chunks(
                info,
                ParallelLayout.from_megatron(),
                dtype=torch.float32,
                perform_initialization=False,
            )
            engine = MegatronEngine(chunks, info, max_model_len=64)
            target = MegatronEngineTarget(engine)
            want = megatron_reference(states[m], info, t_g, rank % t_g, target.padded_vocab())
            for training, by_model in actors.items():
                if (training.tp * training.pp) % t_g:
                    continue
                for param in chunks[0].parameters():
                    param.data.fill_(float("nan"))
                stats = sync(by_model[m], target, info, training)
                bad = _mismatches({k: v.data for k, v in target.params.items()}, want)
                assert not bad, f"{m} {training} t_g={t_g} megatron engine: {bad[:4]}"
                batch = engine.generate(PROMPTS, greedy)
                assert batch.weight_version == version
                tokens = [batch.row_tokens(i)[1] for i in range(len(batch))]
                assert tokens == spec["greedy"][m], f"{m} {training} t_g={t_g}: {tokens}"
                record(m, training, t_g, "megatron_engine", stats)
            if t_g == 1 and m == "qwen2_tied":
                cases.append(_refusals(actors, infos, engine))
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(cases))


def _plan_key(info, training, gen, target, gen_padded):
    from rl_megatron.models.conversions import padded_vocab_size
    from rl_megatron.resharding.agreement import MIB
    from rl_megatron.resharding.plan import PlanKey

    train_padded = padded_vocab_size(info.vocab_size, 128, training.tp)
    bucket = int(BUCKET_MB * MIB)
    return PlanKey(info, training, gen, target, train_padded, gen_padded, bucket, 4)


def _profiled_sync(rank, actor, infos, training) -> dict:
    """A sync to t_g = 1 with a 4 KiB bucket under a memory measurement; and,
    as the measurement's control, the name-based full gather with the same bucket (it
    holds whole HF tensors, so it must read above the bucket), which must agree bit for
    bit."""
    from megatron.core import parallel_state as ps

    from rl_megatron.resharding.layouts import generation_layout_for
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.full_gather import SpecNameLoader, full_gather_sync

    info = infos["llama_gqa"]
    gen = generation_layout_for(training, 1)
    padded = vllm_layout.vllm_padded_vocab(info.vocab_size, 1)
    store = TensorStoreTarget(vllm_layout.vllm_specs, info, gen, rank, padded, device=test_device())
    weight_sync = WeightSync(
        store, info=info, training=training, bucket_mb=MEMORY_BUCKET_MB, measure_peak=True
    )
    stats, peak = _profiled_peak(lambda: weight_sync.sync(actor, version=1))
    baseline = TensorStoreTarget(
        vllm_layout.vllm_specs, info, gen, rank, padded, device=test_device()
    )
    loader = SpecNameLoader(baseline)
    baseline_stats, baseline_peak = _profiled_peak(
        lambda: full_gather_sync(
            actor,
            loader,
            info=info,
            training=training,
            version=1,
            bucket_mb=MEMORY_BUCKET_MB,
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
        )
    )
    bad = _mismatches(baseline.tensors, store.tensors)
    assert not bad, f"full gather differs from resharding: {bad[:4]}"
    return {
        "kind": "memory",
        **stats.as_dict(),
        "profiled_peak_bytes": peak,
        "full_gather_bytes_received": baseline_stats.bytes_received,
        "full_gather_profiled_peak_bytes": baseline_peak,
    }


def _refusals(actors, infos, engine) -> dict:
    """A Qwen2 engine offered the Llama actor's weights: refused on every rank before any
    write; and `generate` refuses in the middle of an update."""
    from rl_megatron.resharding.layouts import TrainingLayout
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.megatron.target import MegatronEngineTarget
    from rl_megatron.rollout.sampling import SamplingParams

    out: dict = {"kind": "refusals", "version_before": engine.weight_version}
    training = TrainingLayout(*MEMORY_LAYOUT)  # TP2·PP2 on 4 ranks, PP2 on 2 (GPUs)
    before = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    weight_sync = WeightSync(
        MegatronEngineTarget(engine),
        info=infos["llama_gqa"],
        training=training,
        bucket_mb=BUCKET_MB,
    )
    try:
        weight_sync.sync(actors[training]["llama_gqa"], version=10_000)
        out["mismatch_error"] = None
    except ValueError as exc:
        out["mismatch_error"] = str(exc)
    after = dict(engine.model.named_parameters())
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    out["version_after_refusal"] = engine.weight_version
    engine.begin_weight_update(10_001)
    try:
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=2))
        out["partial_error"] = None
    except RuntimeError as exc:
        out["partial_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list[dict]]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from tests.rollout_refs import hf_greedy

    root = tmp_path_factory.mktemp("resharding")
    ckpts, greedy, gaps = {}, {}, []
    for name, cfg in MODELS.items():
        cfg = dict(cfg)
        kind = cfg.pop("model_type")
        config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind](
            **cfg, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0
        )
        torch.manual_seed(len(name))
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # QK-norms far from 1 and from each other: a swap would show
            for pname, p in model.named_parameters():
                if pname.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.25, 1.75)
        model.generation_config.eos_token_id = None
        model.save_pretrained(root / name, safe_serialization=True)
        ckpts[name] = str(root / name)
        rows = [hf_greedy(model, prompt, MAX_NEW) for prompt in PROMPTS]
        greedy[name] = [r[0] for r in rows]
        gaps += [r[1] for r in rows]
    assert min(gaps) > MIN_GAP, "a greedy step has no clear winner; change the seed"
    out = root / "out"
    out.mkdir()
    run_on_ranks(_body, world_size=WORLD, spec={"ckpts": ckpts, "greedy": greedy, "out": str(out)})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _cases(results, **match):
    for rank, cases in enumerate(results):
        for case in cases:
            if all(case.get(k) == v for k, v in match.items()):
                yield rank, case


def test_every_layout_pair_is_bit_exact(results):
    """The spawn asserts bit-exactness and greedy parity in place; here: nothing skipped."""
    expected = sum(len(_pairs(t, p)) for t, p, _ in LAYOUTS) + len(_pairs(1, 2))
    for cases in results:
        for target in ("vllm_store", "megatron_engine"):
            assert len([c for c in cases if c.get("target") == target]) == expected * len(MODELS)


def test_executor_moves_what_the_plan_says(results):
    """Bytes received per rank are the plan's, which receives no row twice and none the
    rank holds (tests/unit/test_reshard_plan.py); sends and receives balance."""
    for _, case in _cases(results, target="vllm_store"):
        assert case["bytes_received"] == case["plan_received"]
        assert case["bytes_sent"] == case["plan_sent"]
    for model in MODELS:
        for layout in [list(lay) + [None] for lay in LAYOUTS]:
            for t_g in _pairs(layout[0], layout[1]):
                rows = [c for _, c in _cases(results, model=model, layout=layout, t_g=t_g)]
                assert sum(c["bytes_sent"] for c in rows) == sum(c["bytes_received"] for c in rows)


def test_no_traffic_when_tg_equals_t_and_p_is_1(results):
    """Llama-GQA (vocabulary split alike by both paddings): nothing crosses ranks."""
    for t, p, d in LAYOUTS:
        if p != 1:
            continue
        for _, case in _cases(results, model="llama_gqa", layout=[t, p, d, None], t_g=t):
            assert case["bytes_sent"] == case["bytes_received"] == 0, case
            assert case["messages_sent"] == case["messages_received"] == 0
            assert case["bytes_local"] > 0


def test_traffic_matches_hybridflow_where_it_applies(results):
    """t_g ∈ {1, t} (vLLM's consecutive groups are then HybridFlow's strided ones) and
    stages of equal size (p ≤ 2): per-rank bytes = (d_g − 1)/(t·p)·M_split + the norms
    of the other stages, with M_split the model's TP-split bytes."""
    from rl_megatron.checkpoint import hf_mapping as hm
    from tests.reshard_refs import model_info

    info = model_info("llama_gqa")
    h, layers = info.hidden_size, info.num_layers
    norms = (2 * layers + 1) * h * 4
    shapes = hm.expected_hf_tensors(hm.rules_for(info, "lm"), info).values()
    total = 4 * sum(torch.Size(s).numel() for s in shapes)
    split = total - norms
    checked = 0
    for t, p, d in LAYOUTS:
        if p > 2:
            continue
        for t_g in _pairs(t, p):
            if t_g not in (1, t):
                continue
            d_g = t * p // t_g
            cases = _cases(
                results, model="llama_gqa", layout=[t, p, d, None], t_g=t_g, target="vllm_store"
            )
            for _, case in cases:
                received = case["bytes_received"]
                formula = (d_g - 1) * split // (t * p)
                if p == 1:
                    assert received == formula, case
                else:
                    # A stage lacks the other stage's 2·(L/2) layer norms; stage 0 also
                    # lacks the final norm.
                    assert received - formula in (layers * h * 4, (layers + 1) * h * 4), case
                checked += 1
    assert checked >= 4 * WORLD


def test_peak_extra_memory_within_one_bucket(results):
    bucket = int(MEMORY_BUCKET_MB * (1 << 20))
    for rank, mem in _cases(results, kind="memory"):
        assert mem["bytes_received"] > 10 * bucket, "the case must need many buckets"
        assert 0 < mem["peak_staging_bytes"] <= bucket, (rank, mem)
        # Independent of our counter: every CPU (or, on a GPU, CUDA) tensor allocated
        # during the sync.
        assert mem["profiled_peak_bytes"] <= bucket + MEMORY_SLACK_BYTES, (rank, mem)
        # Control: the same measurement sees the full gather's whole tensors.
        assert mem["full_gather_profiled_peak_bytes"] > 4 * bucket, (rank, mem)
    for _, case in _cases(results, target="vllm_store"):
        assert case["peak_staging_bytes"] <= int(BUCKET_MB * (1 << 20))


def test_mismatched_engine_is_refused_before_writing(results):
    for _, case in _cases(results, kind="refusals"):
        assert "weight sync refused" in case["mismatch_error"]
        assert case["untouched"]
        assert case["version_after_refusal"] == case["version_before"] > 0
        assert "middle of weight update" in case["partial_error"]
