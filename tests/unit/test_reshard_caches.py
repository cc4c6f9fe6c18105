"""The executor's copy views kept across syncs, and what must invalidate them.

One process, no torch.distributed: training layout (1, 1, 1) → vLLM's layout at t_g = 1
moves nothing between ranks, so `execute_plan` needs no process group (the agreement's
collectives are covered by tests/multirank/test_reshard_agreement.py). Sources are the
training shards of random HF tensors (`megatron_reference`); the expected target is what
vLLM holds after loading the same tensors itself (`vllm_reference`). The padded-vocabulary
model is used so that zero fills run beside the copies, Llama-GQA for QKV's strided runs.
Tolerance: bit-exact (pure copies; unwritten rows stay NaN).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rl_megatron.checkpoint.conversions import padded_vocab_size
from rl_megatron.resharding import executor, shards
from rl_megatron.resharding.executor import execute_plan
from rl_megatron.resharding.layouts import TrainingLayout, generation_layout_for
from rl_megatron.resharding.plan import PlanKey, build_plan
from rl_megatron.resharding.targets import TensorStoreTarget
from tests.reshard_refs import (
    assert_bit_exact,
    megatron_reference,
    model_info,
    random_hf_state,
    vllm_reference,
)

QKV = "model.layers.1.self_attn.qkv_proj.weight"  # strided runs (q, k, v of each group)
EMBED = "model.embed_tokens.weight"  # one flat copy, padding rows zero-filled
SRC_QKV = "decoder.layers.1.self_attention.linear_qkv.weight"
SRC_EMBED = "embedding.word_embeddings.weight"


class Case:
    """One model's plan, training shards of HF state A, an empty store, and references."""

    def __init__(self, model: str) -> None:
        self.info = info = model_info(model)
        training = TrainingLayout(1, 1, 1)
        self.gen = generation_layout_for(training, 1)
        self.train_vocab = padded_vocab_size(info.vocab_size, 128, 1)
        self.gen_vocab = shards.vllm_padded_vocab(info.vocab_size, 1)
        key = PlanKey(
            info, training, self.gen, "vllm", self.train_vocab, self.gen_vocab, 1 << 12, 4
        )
        self.plan = build_plan(key)
        self.sources = self.training_shards(seed=0)
        self.store = self.new_store()

    def training_shards(self, seed: int) -> dict[str, torch.Tensor]:
        state = random_hf_state(self.info, seed)
        return megatron_reference(state, self.info, 1, 0, self.train_vocab)

    def want(self, seed: int) -> dict[str, torch.Tensor]:
        state = random_hf_state(self.info, seed)
        return vllm_reference(state, self.info, 1, 0, self.gen_vocab)

    def new_store(self) -> TensorStoreTarget:
        return TensorStoreTarget("vllm", self.info, self.gen, 0, self.gen_vocab)

    def sync(self, store: TensorStoreTarget | None = None) -> TensorStoreTarget:
        store = store or self.store
        store.begin(0)
        execute_plan(self.plan, 0, self.sources, store)
        store.finish()
        return store


@pytest.fixture(params=["llama_gqa", "padded_vocab"])
def case(request) -> Case:
    return Case(request.param)


def _bound(store) -> list:
    (entry,) = executor._BOUND[store].values()
    return entry[2]


def test_repeated_syncs_reuse_their_views_and_see_new_values(case):
    assert_bit_exact(case.sync().tensors, case.want(0), "first sync")
    first = _bound(case.store)
    for t in case.store.tensors.values():
        t.fill_(float("nan"))
    # A training step: the same tensors, new values.
    for name, t in case.training_shards(seed=1).items():
        case.sources[name].copy_(t)
    assert_bit_exact(case.sync().tensors, case.want(1), "second sync")
    assert _bound(case.store) is first


def test_a_replaced_target_tensor_is_written_and_the_old_one_left_alone(case):
    case.sync()
    first = _bound(case.store)
    old = {name: case.store.tensors[name] for name in (QKV, EMBED)}
    for name, t in old.items():
        t.fill_(7.0)
        # As after an engine reallocates its weights: same name and shape, new storage.
        case.store.tensors[name] = torch.full_like(t, float("nan"))
    assert_bit_exact(case.sync().tensors, case.want(0), "after replacing target tensors")
    assert all(t.eq(7.0).all() for t in old.values())
    assert _bound(case.store) is not first


def test_a_replaced_source_tensor_is_read(case):
    case.sync()
    # New tensors under the same names (the old ones stay alive, holding state 0).
    new = case.training_shards(seed=1)
    stale = {name: case.sources[name] for name in (SRC_QKV, SRC_EMBED)}
    for name in stale:
        case.sources[name] = new[name]
    got = case.sync().tensors
    want_new, want_old = case.want(1), case.want(0)
    for name in (QKV, EMBED):
        assert torch.equal(got[name], want_new[name]), name
    others = [n for n in want_old if n not in (QKV, EMBED)]
    assert_bit_exact({n: got[n] for n in others}, {n: want_old[n] for n in others}, "others")
    assert all(torch.equal(stale[n], case.training_shards(seed=0)[n]) for n in stale)


def test_offloaded_and_reloaded_sources(case):
    """As trainer/offload.py does: the storage shrunk to 0 bytes, then grown and refilled."""
    case.sync()
    new = case.training_shards(seed=2)
    for name, t in case.sources.items():
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        t.copy_(new[name])
    assert_bit_exact(case.sync().tensors, case.want(2), "after offload and reload")


def test_a_non_contiguous_replacement_is_refused_not_written_through_old_views(case):
    case.sync()
    shape = case.store.tensors[QKV].shape
    case.store.tensors[QKV] = torch.empty(shape[::-1]).t()  # same shape, other strides
    with pytest.raises(ValueError, match=f"dst tensor '{QKV}' is not contiguous"):
        case.sync()


def test_views_do_not_outlive_their_target(case):
    """The cache is per target: a dropped target's tensors are freed with it."""
    case.sync()
    store, tensor = weakref.ref(case.store), weakref.ref(case.store.tensors[QKV])
    del case.store
    gc.collect()
    assert store() is None and tensor() is None


def test_each_target_gets_every_row(case):
    """Two targets synced from the same sources alternately each hold their own views."""
    other = case.new_store()
    for _ in range(2):
        for store in (case.store, other):
            for t in store.tensors.values():
                t.fill_(float("nan"))
            assert_bit_exact(case.sync(store).tensors, case.want(0), "alternating targets")
