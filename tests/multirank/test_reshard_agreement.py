"""The weight sync's agreement on 4 gloo ranks: how many collectives, and refusals that hold.

One spawn, three parts, each synced by a `WeightSync` into vLLM's layout
(`TensorStoreTarget`) from a random Megatron actor, and compared with the name-based full
gather into another store:

* PP = 4 (the middle stages hold no vocabulary, so they guess it): the first sync of a
  new weight sync needs three all-reduces (the agreement, the checks against the agreed
  plan, the engine's acceptance), later ones two; every sync bit-exact, also after a
  training step; a live weight sync does not keep a dropped actor alive;
* TP = 2, DP = 2 at t_g = 2 (nothing crosses ranks; copies stay bound across syncs): a
  replaced parameter object and a replaced `param.data` are read; a target tensor of
  the wrong shape on one rank, engine vocabularies that differ, and an engine that refuses
  to begin on one rank are refused on every rank, each with its reason, before anything is
  written (the first in a single all-reduce); a sync after a refusal works;
* one rank per group (each rank its own singleton group): no collective at all, and a
  refusal still raises.

Tolerance: bit-exact (pure copies; the stores start as NaN).
"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.spawn import ON_GPU, run_on_ranks, test_device

pytestmark = pytest.mark.slow

WORLD = 4
BUCKET_MB = 1 / 64
MODEL = "llama_gqa"
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def _body(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_loader import unwrap
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.resharding.layouts import (
        MEGATRON_RANK_ORDER,
        GenerationLayout,
        TrainingLayout,
        generation_layout_for,
    )
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.full_gather import SpecNameLoader, full_gather_sync
    from tests.reshard_refs import assert_bit_exact, model_info

    info = model_info(MODEL)
    results: dict = {}
    counted = [0]
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        counted[0] += 1
        return all_reduce(*args, **kwargs)

    def store_for(gen, padded=None, cls=TensorStoreTarget, at=rank):
        padded = padded or vllm_layout.vllm_padded_vocab(info.vocab_size, gen.tp)
        return cls(vllm_layout.vllm_specs, info, gen, at, padded, device=test_device())

    def sync_of(target, training, group=None) -> WeightSync:
        return WeightSync(target, info=info, training=training, bucket_mb=BUCKET_MB, group=group)

    def sync(weight_sync, chunks) -> tuple[int, str | None]:
        """(all-reduces issued, the refusal's message or None)."""
        counted[0] = 0
        dist.all_reduce = counting
        try:
            weight_sync.sync(chunks, version=0)
            return counted[0], None
        except ValueError as exc:
            return counted[0], str(exc)
        finally:
            dist.all_reduce = all_reduce

    def reference(chunks, gen, training) -> dict[str, torch.Tensor]:
        ref = store_for(gen)
        full_gather_sync(chunks, SpecNameLoader(ref), info=info, training=training, version=0,
                         bucket_mb=BUCKET_MB, tp_group=ps.get_tensor_model_parallel_group(),
                         pp_group=ps.get_pipeline_model_parallel_group())  # fmt: skip
        return ref.tensors

    def exact(store, chunks, gen, training, where: str) -> None:
        assert_bit_exact(store.tensors, reference(chunks, gen, training), f"rank {rank} {where}")

    def actor(t: int, p: int, d: int):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(t, p, order=MEGATRON_RANK_ORDER)
        model_parallel_cuda_manual_seed(0)
        training = TrainingLayout(t, p, d)
        return build_gpt_chunks(info, ParallelLayout.from_megatron(), dtype=torch.float32), training

    # ---- PP = 4: middle stages guess the vocabulary the first time.
    chunks, training = actor(1, 4, 1)
    gen = generation_layout_for(training, 2)
    store = store_for(gen)
    pp4 = sync_of(store, training)
    counts = []
    for step in range(3):
        counts.append(sync(pp4, chunks)[0])
        exact(store, chunks, gen, training, f"pp4 sync {step}")
        for param in chunks[0].parameters():  # a training step
            param.data.mul_(1.5)
    results["pp4_all_reduces"] = counts
    # The live sync's source tables and copy views do not keep a dropped actor alive.
    dropped = weakref.ref(unwrap(chunks[0]))

    # ---- TP = 2, DP = 2 → t_g = 2: nothing crosses ranks.
    chunks, training = actor(2, 1, 2)
    gc.collect()
    results["dropped_actor_freed"] = dropped() is None and pp4.version == 0
    gen = generation_layout_for(training, 2)
    store = store_for(gen)
    tp2 = sync_of(store, training)
    counts = [sync(tp2, chunks)[0]]
    exact(store, chunks, gen, training, "tp2")
    model = unwrap(chunks[0])
    layer = model.decoder.layers[0].self_attention.linear_qkv
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    model.embedding.word_embeddings.weight.data = torch.randn_like(
        model.embedding.word_embeddings.weight
    )
    counts.append(sync(tp2, chunks)[0])
    exact(store, chunks, gen, training, "replaced parameters")
    results["tp2_all_reduces"] = counts

    def refused(weight_sync, what: str) -> None:
        for t in store.tensors.values():
            t.fill_(float("nan"))
        n, error = sync(weight_sync, chunks)
        untouched = all(t.isnan().all() for t in store.tensors.values())
        results[what] = {"all_reduces": n, "error": error, "untouched": untouched}

    right = store.tensors[QKV]
    if rank == 3:
        store.tensors[QKV] = torch.empty(right.shape[0] + 1, right.shape[1])
    refused(tp2, "wrong_shape")
    store.tensors[QKV] = right
    if rank == 0:  # another engine on rank 0, with a larger padded vocabulary
        refused(sync_of(store_for(gen, padded=store.padded_vocab() + 64), training),
                "vocab_differs")  # fmt: skip
    else:
        refused(tp2, "vocab_differs")

    class Asleep(TensorStoreTarget):
        def begin(self, version: int) -> None:
            if rank == 1:
                raise RuntimeError("the engine is asleep")
            super().begin(version)

    asleep = store_for(gen, cls=Asleep)
    asleep.tensors = store.tensors
    asleep.version = 5
    refused(sync_of(asleep, training), "begin_refused")
    results["begin_refused"]["version_after"] = asleep.version
    results["after_refusals"] = sync(tp2, chunks)[0]
    exact(store, chunks, gen, training, "after refusals")

    # ---- Each rank alone in its group: nothing to agree on.
    chunks, _ = actor(1, 1, 4)
    single = TrainingLayout(1, 1, 1)
    groups = [dist.new_group([r]) for r in range(world_size)]
    alone = GenerationLayout(tp=1, world_size=1)
    store = store_for(alone, at=0)
    alone_sync = sync_of(store, single, groups[rank])
    results["alone_all_reduces"] = [sync(alone_sync, chunks)[0] for _ in "ab"]
    whole = TrainingLayout(1, 1, 4)  # the reference gathers in the world's layout
    exact(store, chunks, generation_layout_for(whole, 1), whole, "alone")
    store.tensors[QKV] = torch.empty(1)
    results["alone_refused"] = sync(alone_sync, chunks)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    if ON_GPU:
        pytest.skip("counts gloo all-reduces; the GPU runs cover the sync in test_resharding")
    out = tmp_path_factory.mktemp("reshard_agreement")
    run_on_ranks(_body, world_size=WORLD, out=str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_one_all_reduce_to_agree_and_check_one_to_begin(results):
    for r in results:
        assert r["pp4_all_reduces"] == [3, 2, 2]  # the middle stages' first guess is wrong
        assert r["tp2_all_reduces"] == [2, 2]
        assert r["after_refusals"] == 2


def test_kept_tables_do_not_keep_a_dropped_actor(results):
    assert all(r["dropped_actor_freed"] for r in results)


def test_one_rank_needs_no_collective(results):
    for rank, r in enumerate(results):
        assert r["alone_all_reduces"] == [0, 0]
        n, error = r["alone_refused"]
        assert n == 0
        assert error.startswith(f"weight sync refused on rank {rank}: tensor store '{QKV}'")


def test_a_mismatch_on_one_rank_is_refused_everywhere_in_one_all_reduce(results):
    for rank, r in enumerate(results):
        case = r["wrong_shape"]
        assert case["untouched"] and case["all_reduces"] == 1, case
        if rank == 3:
            assert case["error"].startswith(
                f"weight sync refused on rank 3: tensor store '{QKV}' has shape"
            )
        else:
            assert "another rank found a mismatch" in case["error"]


def test_disagreeing_engine_vocabularies_are_refused_everywhere(results):
    for r in results:
        case = r["vocab_differs"]
        assert case["untouched"] and case["all_reduces"] == 2, case
        assert "engine padded vocabularies differ across ranks (512…576)" in case["error"]


def test_an_engine_refusing_to_begin_stops_every_rank(results):
    for rank, r in enumerate(results):
        case = r["begin_refused"]
        assert case["untouched"], case
        if rank == 1:
            assert case["error"] == (
                "weight sync refused on rank 1: the engine refused the update: the engine is asleep"
            )
            assert case["version_after"] == 5  # never begun
        else:
            assert "another rank found a mismatch" in case["error"]
            assert case["version_after"] is None  # aborted
