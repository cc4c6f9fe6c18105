"""Resharding real Megatron MoE actors into vLLM's fused-MoE layout on 4 gloo ranks.

One spawn: Qwen3-MoE and Mixtral (`tests/reshard_refs.py`: 4 layers, 4 experts) are built
as actors from HF checkpoints by the trainer's builder at TP1·EP2 (EP over DP), TP1·EP4,
TP2·EP2, TP2·EP2·ETP2 and TP2·PP2·EP2 (the layouts megatron-core builds; eval only), and
for each generation TP dividing the plan block they are synced by a `WeightSync` into
`TensorStoreTarget`s of vLLM's layout (NaN until written) and compared with the checkpoint
sliced straight into vLLM's shards (`moe_vllm_reference`); the name-based full gather (TP /
expert-TP all-gather, EP and PP broadcasts) fills a second store through `SpecNameLoader`.
Bytes per rank of both paths are written to JSON and checked below.

Tolerance: bit-exact (pure copies).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.reshard_refs import MOE_MODELS
from tests.spawn import ON_GPU, run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ON_GPU, reason="CPU (gloo) test")]

WORLD = 4
# (tp, pp, ep, etp) on 4 ranks
LAYOUTS = [(1, 1, 2, 1), (1, 1, 4, 1), (2, 1, 2, 1), (2, 1, 2, 2), (2, 2, 2, 1)]
BUCKET_MB = 1 / 64


def _body(rank: int, world_size: int, spec: dict) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.resharding.layouts import (
        MEGATRON_RANK_ORDER,
        GenerationLayout,
        TrainingLayout,
    )
    from rl_megatron.resharding.plan import plan_block
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.full_gather import SpecNameLoader, full_gather_sync
    from tests.reshard_refs import moe_vllm_reference
    from tests.unit.test_reshard_plan import assert_bit_exact

    cases = []
    for tp, pp, ep, etp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            order=MEGATRON_RANK_ORDER,
        )  # fmt: skip
        model_parallel_cuda_manual_seed(0)
        training = TrainingLayout(tp, pp, world_size // (tp * pp), ep=ep, etp=etp)
        for m, path in spec["ckpts"].items():
            info = load_hf_config(path)
            state = load_file(f"{path}/model.safetensors")
            actor = build_actor(path, ParallelLayout.from_megatron(), dtype=torch.float32)
            for t_g in (t for t in (1, 2, 4) if plan_block(training) % t == 0):
                gen = GenerationLayout(t_g, world_size)
                padded = vllm_layout.vllm_padded_vocab(info.vocab_size, t_g)
                gen_tp = gen.coordinates(rank)["gen_tp"]
                want = moe_vllm_reference(state, info, t_g, gen_tp, padded)
                where = f"{m} tp{tp} pp{pp} ep{ep} etp{etp} t_g={t_g}"
                store = TensorStoreTarget(vllm_layout.vllm_specs, info, gen, rank, padded)
                sync = WeightSync(store, info=info, training=training, bucket_mb=BUCKET_MB)
                stats = sync.sync(actor, version=1)
                assert_bit_exact(store.tensors, want, f"{where} reshard")
                baseline = TensorStoreTarget(vllm_layout.vllm_specs, info, gen, rank, padded)
                theirs = full_gather_sync(
                    actor, SpecNameLoader(baseline), info=info, training=training, version=1,
                    bucket_mb=BUCKET_MB, tp_group=ps.get_tensor_model_parallel_group(),
                    pp_group=ps.get_pipeline_model_parallel_group(),
                    ep_group=ps.get_expert_model_parallel_group(),
                    etp_group=ps.get_expert_tensor_parallel_group(),
                )  # fmt: skip
                assert_bit_exact(baseline.tensors, want, f"{where} full gather")
                plan = sync.plan
                cases.append(
                    dict(
                        model=m, layout=[tp, pp, ep, etp], t_g=t_g,
                        received=stats.bytes_received, sent=stats.bytes_sent,
                        plan_received=plan.traffic[plan.local_rank(rank)].received * 4,
                        peak_staging_bytes=stats.peak_staging_bytes,
                        full_gather_received=theirs.bytes_received,
                        full_gather_sent=theirs.bytes_sent,
                    )
                )  # fmt: skip
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(cases))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list[dict]]:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("reshard_moe")
    ckpts = {}
    for name, cfg in MOE_MODELS.items():
        cfg = dict(cfg)
        kind = cfg.pop("model_type")
        config = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[kind](**cfg)
        torch.manual_seed(len(name))
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        ckpts[name] = str(root / name)
    out = root / "out"
    out.mkdir()
    run_on_ranks(_body, world_size=WORLD, spec={"ckpts": ckpts, "out": str(out)})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_moe_layout_pair_is_bit_exact(results):
    """The spawn asserts bit-exactness in place; here: nothing skipped (13 pairs × 2)."""
    for cases in results:
        assert len(cases) == 13 * len(MOE_MODELS)


def test_reshard_moves_what_the_plan_says_and_no_more_than_full_gather(results):
    for cases in results:
        for case in cases:
            assert case["received"] == case["plan_received"], case
            assert case["received"] <= case["full_gather_received"], case
            assert case["peak_staging_bytes"] <= BUCKET_MB * (1 << 20), case


def test_tp1_ep2_into_tp1_moves_only_the_other_experts(results):
    """EP over DP into one vLLM replica per rank: each rank receives the two experts it
    lacks, whole (3·Fe·h fp32 elements each per layer), exactly what full gather moves."""
    info = MOE_MODELS["qwen3_moe"]
    expert = 3 * info["moe_intermediate_size"] * info["hidden_size"] * 4
    for cases in results:
        (case,) = [
            c for c in cases if c["model"] == "qwen3_moe" and c["layout"] == [1, 1, 2, 1]
            and c["t_g"] == 1
        ]  # fmt: skip
        assert case["received"] == info["num_hidden_layers"] * 2 * expert
        assert case["full_gather_received"] == case["received"]
