"""The Megatron engine with expert parallelism: greedy tokens at EP=2 equal those at EP=1.

A tiny Qwen3-MoE (2 layers, 4 experts, top-2, perturbed random weights) is made in the test.
Two gloo ranks are two training DP replicas; at EP=2 they split the experts, so every MoE
forward of one waits for the other's (a token all-to-all). Each rank generates its own
prompts — rank 0 five (three decode batches of `max_batch_size` 2), rank 1 two (one batch)
— greedily, with no stop token, then with a stop token per rank that ends rows at different
steps, then with rank 1 holding no prompts at all (an uneven evaluation share). At EP=1 each
rank decodes alone; at EP=2 the ranks must agree on every forward (`MegatronEngine._agree`).

Tolerance: tokens exact. EP=1 and EP=2 run the same fp32 expert weights on the same tokens;
only the grouping of tokens into the experts' matmuls differs (logits within ~1e-6,
tests/multirank/test_moe.py), far below the perturbed model's top-1 leads.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.spawn import ON_GPU, run_on_ranks

MAX_NEW = 10
PROMPTS = {0: (3, 9, 1, 14, 6), 1: (11, 4)}  # prompt lengths per rank

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU (gloo) test of the expert-parallel engine")


def _init(ep: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.parallel import MEGATRON_RANK_ORDER

    ps.destroy_model_parallel()
    # A rank that skipped a forward leaves the other's all-to-all waiting: fail in a
    # minute rather than hang.
    ps.initialize_model_parallel(
        1,
        1,
        expert_model_parallel_size=ep,
        order=MEGATRON_RANK_ORDER,
        distributed_timeout_minutes=1,
    )
    model_parallel_cuda_manual_seed(0)


def _first_stop(rows: list[list[int]], step: int) -> int:
    """A token some row first emits at `step` or later (it ends that row there)."""
    for row in rows:
        for t in row[step:]:
            if row.index(t) >= step:
                return t
    raise AssertionError(f"no token first emitted at step >= {step} in {rows}")


def _body(rank: int, world_size: int, root) -> None:
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.megatron.engine import MegatronEngine
    from rl_megatron.rollout.sampling import SamplingParams

    info = load_hf_config(root / "qwen3_moe")
    g = torch.Generator().manual_seed(100 + rank)  # different prompts per replica
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in PROMPTS[rank]]
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    results, stop = {}, None
    for ep in (1, 2):
        _init(ep)
        chunks = build_actor(
            root / "qwen3_moe", ParallelLayout.from_megatron(), dtype=torch.float32
        )
        engine = MegatronEngine(chunks, info, max_model_len=64, seed=0, max_batch_size=2)
        assert engine.needs_every_replica == (ep > 1)
        # The experts really are split: each rank holds 4/ep of them.
        local = {n.split(".local_experts.")[1].split(".")[0]
                 for n, _ in chunks[0].named_parameters() if ".local_experts." in n}  # fmt: skip
        assert len(local) == 4 // ep

        def tokens(batch):
            return [batch.row_tokens(i)[1] for i in range(len(batch))]

        out = {"greedy": tokens(engine.generate(prompts, greedy))}
        if stop is None:
            # A row of rank 0 stops at step 2 or later, one of rank 1's at step 5 or
            # later: the ranks' batches end at different steps, rows within a batch too.
            stop = _first_stop(out["greedy"], 2 if rank == 0 else 5)
        stopping = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=[stop])
        batch = engine.generate(prompts, stopping)
        out["stop"] = tokens(batch)
        out["stop_reasons"] = batch.finish_reasons
        # Rank 1 holds no prompts (an uneven evaluation share) and still joins.
        batch = engine.generate(prompts if rank == 0 else [], stopping)
        out["uneven"] = tokens(batch)
        results[ep] = out

    ref = results[1]
    lengths = [len(r) for r in ref["stop"]]
    assert "stop" in ref["stop_reasons"] and len(set(lengths)) > 1, (lengths, ref)
    assert ref["uneven"] == (ref["stop"] if rank == 0 else [])
    for key in ref:
        assert results[2][key] == ref[key], (
            f"rank {rank} {key}: EP2 {results[2][key]} != {ref[key]}"
        )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.multirank.test_hf_parity import _perturb
    from tests.multirank.test_moe import _hf_configs

    root = tmp_path_factory.mktemp("megatron_engine_ep")
    torch.manual_seed(0)
    cfg = _hf_configs()["qwen3_moe"]
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    _perturb(model, 0)
    model.save_pretrained(root / "qwen3_moe", safe_serialization=True)
    return root


def test_greedy_at_ep2_equals_ep1(checkpoint):
    run_on_ranks(_body, world_size=2, root=checkpoint)
