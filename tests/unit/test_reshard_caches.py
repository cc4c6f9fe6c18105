"""What a `WeightSync` keeps across syncs (plan, program, source table, copy views), and what
must invalidate it.

One process, a one-rank gloo group: training layout (1, 1, 1) → vLLM's layout at t_g = 1
moves nothing between ranks (the agreement's collectives on several ranks are covered by
tests/multirank/test_reshard_agreement.py). The actor is a module tree holding, under
GPTModel's parameter names, the training shards of random HF tensors
(`megatron_reference`); the expected target is what vLLM holds after loading the same
tensors itself (`vllm_reference`). The padded-vocabulary model is used so that zero fills
run beside the copies, Llama-GQA for QKV's strided runs, Qwen3-MoE for one tensor per
expert copied into a slot of vLLM's stacked `w13_weight` / `w2_weight`
(`moe_vllm_reference`). Tolerance: bit-exact (pure copies; unwritten rows stay NaN), and
the kept program's views write each target element exactly once (`written_counts`).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.models.hf_config import parse_hf_config
from rl_megatron.resharding import copy_program, tensor_facts
from rl_megatron.resharding.copy_program import Bound, graph_of, issue, large_pairs_apart
from rl_megatron.resharding.layouts import TrainingLayout, generation_layout_for
from rl_megatron.resharding.shards import ShardSpec, check_tensors, spec_shapes
from rl_megatron.resharding.targets import TensorStoreTarget
from rl_megatron.resharding.tensor_facts import ShapesInOrder, TensorFacts
from rl_megatron.resharding.weight_sync import WeightSync
from rl_megatron.rollout.vllm import specs as vllm_layout
from tests.reshard_refs import (
    MODELS,
    MOE_MODELS,
    assert_bit_exact,
    megatron_reference,
    model_info,
    moe_vllm_reference,
    random_hf_state,
    vllm_reference,
)

QKV = "model.layers.1.self_attn.qkv_proj.weight"  # strided runs (q, k, v of each group)
EMBED = "model.embed_tokens.weight"  # one flat copy, padding rows zero-filled
SRC_QKV = "decoder.layers.1.self_attention.linear_qkv.weight"
SRC_EMBED = "embedding.word_embeddings.weight"
BUCKET_MB = 1 / 256  # 4 KiB


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def actor_holding(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree with `tensors` as parameters under their GPTModel names (stand-in for
    a Megatron chunk at PP 1: `decoder.layers[i].layer_number` is i + 1, as in megatron)."""
    root = module_holding(tensors)
    layers = root.decoder.layers
    root.decoder.layers = torch.nn.ModuleList(
        getattr(layers, str(i)) for i in range(len(layers._modules))
    )
    for i, layer in enumerate(root.decoder.layers):
        layer.layer_number = i + 1
    return root


def module_holding(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree with `tensors` as parameters under their (dotted) names."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def param(chunk: torch.nn.Module, name: str) -> torch.nn.Parameter:
    return chunk.get_parameter(name)


def replace_param(chunk: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    setattr(chunk.get_submodule(module_name), leaf, torch.nn.Parameter(value, requires_grad=False))


class GraphStandIn:
    """`copy_program.graph_of` on the CPU: what a CUDA graph is to the kept views. It fixes
    the views of the step it is given when captured (a graph, its kernels' addresses) and
    replays exactly those, whatever the tensors are now; counts captures and replays. As
    `graph_of` does, it copies large pairs one by one (from 1 KiB: the tiny models' larger
    tensors), so the kept steps' values are checked through that path too."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, bound: Bound):
        self.captures += 1
        bound = large_pairs_apart(bound, min_bytes=1024)

        def replay() -> None:
            self.replays += 1
            issue(bound)

        return replay


class Case:
    """One model's actor (training shards of HF state A), a store, its sync, references.

    graphs: the kept steps are issued as (stand-in) graphs from their second sync on, as on
    CUDA; otherwise directly, as on the CPU.
    """

    def __init__(self, model: str, graphs: bool = False, **moe_overrides) -> None:
        self.info = info = (
            parse_hf_config({**MOE_MODELS[model], **moe_overrides})
            if model in MOE_MODELS
            else model_info(model)
        )
        self.training = TrainingLayout(1, 1, 1)
        self.gen = generation_layout_for(self.training, 1)
        self.train_vocab = padded_vocab_size(info.vocab_size, 128, 1)
        self.gen_vocab = vllm_layout.vllm_padded_vocab(info.vocab_size, 1)
        self.chunk = actor_holding(self.training_shards(seed=0))
        self.store = self.new_store()
        self.graphs = GraphStandIn() if graphs else None
        self.weight_sync = self.sync_into(self.store)

    def training_shards(self, seed: int) -> dict[str, torch.Tensor]:
        state = random_hf_state(self.info, seed)
        return megatron_reference(state, self.info, 1, 0, self.train_vocab)

    def want(self, seed: int) -> dict[str, torch.Tensor]:
        state = random_hf_state(self.info, seed)
        reference = moe_vllm_reference if self.info.num_experts else vllm_reference
        return reference(state, self.info, 1, 0, self.gen_vocab)

    def new_store(self, cls=TensorStoreTarget) -> TensorStoreTarget:
        return cls(vllm_layout.vllm_specs, self.info, self.gen, 0, self.gen_vocab)

    def sync_into(self, store: TensorStoreTarget) -> WeightSync:
        weight_sync = WeightSync(store, info=self.info, training=self.training, bucket_mb=BUCKET_MB)
        if self.graphs is not None and weight_sync._views is not None:
            weight_sync._views.graphs, weight_sync._views.capture = True, self.graphs
        return weight_sync

    def sync(self, weight_sync: WeightSync | None = None, version: int = 0) -> TensorStoreTarget:
        weight_sync = weight_sync or self.weight_sync
        weight_sync.sync([self.chunk], version)
        return weight_sync.target

    def kept_views(self, weight_sync: WeightSync | None = None) -> list:
        return (weight_sync or self.weight_sync)._views.bound


MODEL_NAMES = ("llama_gqa", "qwen3_padded_vocab", "qwen3_moe")


@pytest.fixture(
    params=[(model, graphs) for model in MODEL_NAMES for graphs in (False, True)],
    ids=lambda p: f"{p[0]}-{'graphs' if p[1] else 'direct'}",
)
def case(request) -> Case:
    return Case(*request.param)


def test_repeated_syncs_reuse_plan_program_and_views_and_see_new_values(case):
    assert_bit_exact(case.sync().tensors, case.want(0), "first sync")
    plan, program, first = case.weight_sync.plan, case.weight_sync._program, case.kept_views()
    assert plan is not None and first
    for t in case.store.tensors.values():
        t.fill_(float("nan"))
    # A training step: the same tensors, new values.
    for name, t in case.training_shards(seed=1).items():
        param(case.chunk, name).data.copy_(t)
    assert_bit_exact(case.sync(version=1).tensors, case.want(1), "second sync")
    assert case.weight_sync.plan is plan and case.weight_sync._program is program
    assert case.kept_views() is first
    assert case.weight_sync.version == 1


def test_a_replaced_target_tensor_is_written_and_the_old_one_left_alone(case):
    case.sync()
    first = case.kept_views()
    old = {name: case.store.tensors[name] for name in (QKV, EMBED)}
    for name, t in old.items():
        t.fill_(7.0)
        # As after an engine reallocates its weights: same name and shape, new storage.
        case.store.tensors[name] = torch.full_like(t, float("nan"))
    assert_bit_exact(case.sync().tensors, case.want(0), "after replacing target tensors")
    assert all(t.eq(7.0).all() for t in old.values())
    assert case.kept_views() is not first


@pytest.mark.parametrize("how", ["parameter object", "param.data"])
def test_a_replaced_source_tensor_is_read(case, how):
    case.sync()
    # New tensors under the same names (the old ones stay alive, holding state 0).
    new = case.training_shards(seed=1)
    stale = {name: param(case.chunk, name).data for name in (SRC_QKV, SRC_EMBED)}
    for name in stale:
        if how == "parameter object":
            replace_param(case.chunk, name, new[name])
        else:
            param(case.chunk, name).data = new[name]
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
    for name, t in new.items():
        p = param(case.chunk, name)
        storage = p.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        p.data.copy_(t)
    assert_bit_exact(case.sync().tensors, case.want(2), "after offload and reload")


@pytest.mark.parametrize("storage", ["new", "the same"])
def test_a_non_contiguous_replacement_is_refused_not_written_through_old_views(case, storage):
    """Same shape, other strides: in new memory, or over the old tensor's own elements at
    its very address (only the strides tell the kept views are wrong)."""
    case.sync()
    old = case.store.tensors[QKV]
    rows, cols = old.shape
    if storage == "new":
        case.store.tensors[QKV] = torch.empty(cols, rows).t()
    else:
        case.store.tensors[QKV] = old.as_strided((rows, cols), (1, rows))
    with pytest.raises(ValueError, match=f"dst tensor '{QKV}' is not contiguous"):
        case.sync()
    assert case.weight_sync.version is None  # the target was told the transfer failed


def test_a_replaced_module_is_read(case):
    """A module swapped for a new one (the old one freed) holding a new parameter under the
    same name: the old module's parameter dict is unchanged, yet the table is rebuilt."""
    case.sync()
    module_name, _, leaf = SRC_QKV.rpartition(".")
    parent, _, child = module_name.rpartition(".")
    new = case.training_shards(seed=1)[SRC_QKV]
    fresh = torch.nn.Module()
    for name, old in case.chunk.get_submodule(module_name).named_parameters():
        value = new if name == leaf else old.detach().clone()
        fresh.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    setattr(case.chunk.get_submodule(parent), child, fresh)
    del old
    gc.collect()
    got = case.sync().tensors
    assert torch.equal(got[QKV], case.want(1)[QKV])


def test_a_source_of_another_shape_is_refused_on_a_repeated_sync(case):
    case.sync()
    p = param(case.chunk, SRC_QKV)
    p.data = torch.zeros(p.shape[0] + 1, p.shape[1])
    with pytest.raises(ValueError, match=f"trainer '{SRC_QKV}' has shape"):
        case.sync()


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_kept_steps_are_captured_on_their_second_sync_and_replayed_until_they_move(model):
    """Bound and issued directly, then captured once and replayed; a moved target tensor is
    bound afresh and issued directly (its old graph would write the old tensor), then
    captured again. Every sync sees the actor's values of its time."""
    case = Case(model, graphs=True)
    graphs = case.graphs
    case.sync()
    steps = sum(len(r.local) for r in case.weight_sync._program[1].rounds)
    assert (graphs.captures, graphs.replays) == (0, 0)
    for seed, version in ((1, 1), (2, 2)):
        for name, t in case.training_shards(seed=seed).items():
            param(case.chunk, name).data.copy_(t)
        assert_bit_exact(case.sync(version=version).tensors, case.want(seed), f"sync {version}")
    assert (graphs.captures, graphs.replays) == (steps, 2 * steps)
    case.store.tensors[QKV] = torch.full_like(case.store.tensors[QKV], float("nan"))
    assert_bit_exact(case.sync().tensors, case.want(2), "after a target moved")
    assert (graphs.captures, graphs.replays) == (steps, 2 * steps)
    assert_bit_exact(case.sync().tensors, case.want(2), "captured again")
    assert (graphs.captures, graphs.replays) == (2 * steps, 3 * steps)


def test_large_pairs_are_set_apart_in_order_and_the_rest_kept():
    """`large_pairs_apart`: the multi-tensor copy's pairs of at least `min_bytes` become
    single copies in their order; the rest, the strided runs and zero fills stay; the split
    step writes what the unsplit one does."""
    sizes = [10, 300, 20, 256, 30]  # float32: 1 200 and 1 024 bytes are "large" at 1 KiB
    src = [torch.randn(n) for n in sizes]
    dst = [torch.full((n,), float("nan")) for n in sizes]
    zeros = torch.ones(4)
    bound = Bound(dst, src, [], [], [zeros])
    split = large_pairs_apart(bound, min_bytes=1024)
    assert [(d.numel(), s.numel()) for d, s in split.copies] == [(300, 300), (256, 256)]
    assert [d.data_ptr() for d, _ in split.copies] == [dst[1].data_ptr(), dst[3].data_ptr()]
    assert [t.numel() for t in split.dst] == [10, 20, 30]
    assert [t.data_ptr() for t in split.src] == [
        src[0].data_ptr(),
        src[2].data_ptr(),
        src[4].data_ptr(),
    ]
    assert split.zeros == [zeros]
    issue(split)
    assert all(map(torch.equal, dst, src)) and zeros.eq(0).all()
    at_bound = large_pairs_apart(bound, min_bytes=1200)  # inclusive: 1 200 yes, 1 024 no
    assert [d.numel() for d, _ in at_bound.copies] == [300]
    assert large_pairs_apart(bound, min_bytes=10**6) is bound  # nothing large: unchanged


class _CountCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """The copy ops a call issues: `copy_` (each pair's size) and `_foreach_copy_` (sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.single: list[int] = []
        self.multi: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.single.append(args[0].numel())
        elif func is torch.ops.aten._foreach_copy_.default:
            self.multi.append([t.numel() for t in args[0]])
        return func(*args, **(kwargs or {}))


def test_a_graph_copies_its_large_pairs_one_by_one(monkeypatch):
    """`graph_of` captures the large pairs as single copies and the rest as one multi-tensor
    copy (the capture itself stood in by running the captured function directly)."""
    monkeypatch.setattr(copy_program, "captured", lambda fn: fn)
    big = copy_program.PER_TENSOR_COPY_MIN_BYTES // 4  # float32 elements
    sizes = [7, big, 9, big + 5]
    src = [torch.randn(n) for n in sizes]
    dst = [torch.zeros(n) for n in sizes]
    launch = graph_of(Bound(dst, src, [], [], []))
    with _CountCopies() as seen:
        launch()
    assert seen.single == [big, big + 5] and seen.multi == [[7, 9]]
    assert all(map(torch.equal, dst, src))


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda_only
def test_a_captured_graph_copies_what_its_sources_hold_when_it_is_replayed():
    """`graph_of` for real: capturing runs nothing; each replay, queued right behind writes
    to the sources on the current stream (no synchronisation between), copies those
    values: the multi-tensor copy, the large pairs' single copies, a strided run and a zero
    fill alike."""
    device = torch.device("cuda")
    src = [torch.empty(n, device=device) for n in (1, 1000, 4096, 70_000) for _ in range(60)]
    src += [torch.empty(3 << 20, device=device) for _ in range(3)]  # 12 MiB: a `copy_` each
    dst = [torch.full_like(t, float("nan")) for t in src]
    base_src = torch.empty(8, 64, device=device)
    base_dst = torch.full((8, 96), float("nan"), device=device)
    run_src = base_src.as_strided((8, 32), (64, 1), 16)
    run_dst = base_dst.as_strided((8, 32), (96, 1), 40)
    zeros = torch.full((100,), 3.0, device=device)
    launch = graph_of(Bound(dst, src, [run_dst], [run_src], [zeros]))
    torch.cuda.synchronize()
    assert all(t.isnan().all() for t in dst) and zeros.eq(3.0).all(), "capturing ran copies"
    for value in (1.0, 2.0):
        for t in src:
            t.fill_(value)
        base_src.copy_(torch.arange(base_src.numel(), device=device).view(8, 64) * value)
        zeros.fill_(value)
        launch()
        torch.cuda.synchronize()
        assert all(t.eq(value).all() for t in dst), value
        assert torch.equal(run_dst, run_src)
        assert base_dst[:, :40].isnan().all() and base_dst[:, 72:].isnan().all()
        assert zeros.eq(0).all()


@cuda_only
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_a_sync_on_cuda_replays_graphs_and_sees_new_values(model):
    """A weight sync between CUDA tensors: graphs from the second sync on (the default on
    CUDA), bit-exact after each training step, and a moved target bound afresh, its old
    tensor left alone."""
    case = Case(model)
    case.chunk.cuda()  # the same parameter objects, their data on the GPU
    store = TensorStoreTarget(
        vllm_layout.vllm_specs, case.info, case.gen, 0, case.gen_vocab, device="cuda"
    )
    weight_sync = case.sync_into(store)

    def synced(seed: int) -> dict[str, torch.Tensor]:
        for name, t in case.training_shards(seed=seed).items():
            param(case.chunk, name).data.copy_(t)
        weight_sync.sync([case.chunk], seed)
        return {name: t.cpu() for name, t in store.tensors.items()}

    assert_bit_exact(synced(0), case.want(0), "first sync (direct)")
    assert not weight_sync._views.captured
    for seed in (1, 2):
        assert_bit_exact(synced(seed), case.want(seed), f"sync {seed} (replayed)")
        assert weight_sync._views.captured
    old = store.tensors[QKV]
    store.tensors[QKV] = torch.full_like(old, float("nan"))
    old.fill_(7.0)
    assert_bit_exact(synced(3), case.want(3), "after a target moved")
    assert not weight_sync._views.captured and old.eq(7.0).all()
    assert_bit_exact(synced(4), case.want(4), "captured again")


def test_a_source_of_another_dtype_is_refused_on_a_repeated_sync(case):
    """One parameter cast after a sync: the facts are read afresh and their dtypes mix."""
    case.sync()
    case.sync()  # the facts of the first sync reused
    p = param(case.chunk, SRC_QKV)
    p.data = p.data.double()
    with pytest.raises(ValueError, match="training parameters mix dtypes"):
        case.sync()


def test_a_source_gone_is_refused_on_a_repeated_sync(case):
    """A parameter dropped from the actor after a sync: the one-list shape check sees a
    name short and the full check names it, before anything is written."""
    case.sync()
    module_name, _, leaf = SRC_QKV.rpartition(".")
    del case.chunk.get_submodule(module_name)._parameters[leaf]
    with pytest.raises(ValueError, match=f"trainer lacks parameter '{SRC_QKV}'"):
        case.sync()


@pytest.mark.parametrize("cpp_check", [True, False], ids=["cpp-check", "read-all"])
def test_a_source_viewed_anew_at_its_address_is_refused(case, cpp_check, monkeypatch):
    """`param.data` replaced by a view of its own elements with the rows and columns
    swapped: same address, so only the shape tells. The C++ check sees it (the facts are
    read afresh), and so does reading every field where torch offers no such check."""
    if not cpp_check:
        monkeypatch.setattr(tensor_facts, "_TensorGuards", None)
    case.sync()
    case.sync()  # the facts of the first sync reused
    p = param(case.chunk, SRC_QKV)
    rows, cols = p.shape
    p.data = p.data.view(cols, rows)
    with pytest.raises(ValueError, match=f"trainer '{SRC_QKV}' has shape"):
        case.sync()


def test_tensor_facts_are_reused_while_nothing_changed():
    """`TensorFacts.of(tensors, previous)` is `previous` while names, addresses, shapes,
    strides, dtypes, devices and `requires_grad` hold; read afresh when one changes."""
    tensors = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    first = TensorFacts.of(tensors)
    assert first.unchanged is not None  # this torch offers the C++ check
    assert TensorFacts.of(tensors, first) is first
    changes = {
        "shape at the same address": lambda t: {**t, "a": t["a"].view(3, 2)},
        "strides at the same address": lambda t: {**t, "a": t["a"].as_strided((2, 3), (1, 2))},
        "address": lambda t: {**t, "b": torch.zeros(4)},
        "dtype": lambda t: {**t, "b": t["b"].view(torch.int32)},
        "requires_grad": lambda t: {**t, "b": t["b"].requires_grad_()},
        "order": lambda t: {"b": t["b"], "a": t["a"]},
        "a name, the tensors the same": lambda t: {"a": t["a"], "c": t["b"]},
    }
    for what, change in changes.items():
        tensors = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
        first = TensorFacts.of(tensors)
        changed = change(tensors)
        after = TensorFacts.of(changed, first)
        assert after is not first, what
        assert after == TensorFacts.of(changed), what


def test_shapes_in_order_match_any_order_and_nothing_else():
    """`ShapesInOrder`: the plan's names in any order with its shapes match; a shape off,
    a name missing, a name added, or the same count with one name swapped do not; the
    order it keeps follows the names it is shown."""
    want = {"a": (2, 3), "b": (4,), "c": (1, 5)}
    shapes = ShapesInOrder(want)

    def facts(**tensors: tuple[int, ...]) -> TensorFacts:
        return TensorFacts.of({name: torch.empty(shape) for name, shape in tensors.items()})

    assert shapes.match(facts(a=(2, 3), b=(4,), c=(1, 5)))
    assert shapes.match(facts(c=(1, 5), a=(2, 3), b=(4,)))  # another order
    assert not shapes.match(facts(c=(1, 5), a=(3, 2), b=(4,)))  # a shape off
    assert not shapes.match(facts(a=(2, 3), b=(4,)))  # c missing
    assert not shapes.match(facts(a=(2, 3), b=(4,), c=(1, 5), d=(1,)))  # d added
    assert not shapes.match(facts(a=(2, 3), b=(4,), d=(1, 5)))  # c swapped for d
    assert shapes.match(facts(a=(2, 3), b=(4,), c=(1, 5)))


def written_counts(weight_sync: WeightSync) -> dict[str, torch.Tensor]:
    """How many times the kept program's views write each element of each target tensor
    (from the views' geometry, whatever values they carry; one rank: `local` steps only)."""
    target = weight_sync.target.tensors
    by_address = {t.untyped_storage().data_ptr(): name for name, t in target.items()}
    counts = {name: torch.zeros(t.numel(), dtype=torch.int64) for name, t in target.items()}
    for steps in weight_sync._views.bound:
        for bound in steps:
            for view in [*bound.dst, *bound.strided_dst, *bound.zeros, *bound.outs()]:
                name = by_address[view.untyped_storage().data_ptr()]
                base = target[name]
                offset = view.storage_offset() - base.storage_offset()
                index = torch.arange(base.numel()).as_strided(view.shape, view.stride(), offset)
                counts[name] += torch.bincount(index.reshape(-1), minlength=base.numel())
    return counts


def test_every_target_element_is_written_exactly_once(case):
    case.sync()
    for name, count in written_counts(case.weight_sync).items():
        missed, twice = int(count.eq(0).sum()), int(count.gt(1).sum())
        assert not missed and not twice, f"{name}: {missed} missed, {twice} written twice"


def views_into(case: Case, name: str, views: list[torch.Tensor]) -> int:
    address = case.store.tensors[name].untyped_storage().data_ptr()
    return sum(v.untyped_storage().data_ptr() == address for v in views)


@pytest.mark.parametrize("runs_as_blocks", [None, True])
def test_runs_bound_block_by_block_write_the_same_elements(case, runs_as_blocks):
    """Kept runs as one view per block (CUDA's default, forced here) or strided (the CPU's
    default): bit-exact either way, every element written once, and QKV's blocks all in
    the multi-tensor copy when bound block by block."""
    case.weight_sync._views.runs_as_blocks = runs_as_blocks
    assert_bit_exact(case.sync().tensors, case.want(0), "first sync")
    for name, count in written_counts(case.weight_sync).items():
        assert count.eq(1).all(), name
    bound = [b for steps in case.kept_views() for b in steps]
    strided = sum(len(b.strided_dst) for b in bound)
    flat_qkv = sum(views_into(case, QKV, b.dst) for b in bound)
    strided_qkv = sum(views_into(case, QKV, b.strided_dst) for b in bound)
    if runs_as_blocks:
        assert strided == 0
        assert flat_qkv == 3 * case.info.num_key_value_heads  # q, k, v of each group
    else:
        assert (flat_qkv, strided_qkv) == (0, 3)  # on the CPU: one strided run each
    case.chunk.get_parameter(SRC_QKV).data.add_(1.0)  # the kept views see new values
    assert torch.equal(case.sync().tensors[QKV], case.want(0)[QKV] + 1.0)


@pytest.mark.parametrize("expert_width", [64, 48])  # 48: not the hidden size (64)
def test_moe_experts_fill_each_stacked_tensor_in_one_concatenation(expert_width):
    """Megatron's fc1 of every expert into its layer's `w13_weight`, fc2 into `w2_weight`
    (a move along dim 1 of each slot, whole at t = t_g): one `torch.cat` of the layer's
    experts, in slot order, into the whole stacked tensor; no expert copied alone."""
    case = Case("qwen3_moe", moe_intermediate_size=expert_width)
    assert_bit_exact(case.sync().tensors, case.want(0), "qwen3_moe")
    ((bound,),) = case.kept_views()  # one round, one step
    stacked = {
        t.untyped_storage().data_ptr(): t
        for name, t in case.store.tensors.items()
        if name.endswith(("w13_weight", "w2_weight"))
    }

    def into_experts(views):
        return sum(v.untyped_storage().data_ptr() in stacked for v in views)

    assert into_experts(bound.dst) == into_experts(bound.strided_dst) == 0
    assert len(bound.concats) == len(stacked) == 2 * case.info.num_layers
    experts = case.info.num_experts
    for out, pieces in bound.concats:
        whole = stacked[out.untyped_storage().data_ptr()]
        assert out.data_ptr() == whole.data_ptr() and out.numel() == whole.numel()
        assert len(pieces) == experts
        assert all(p.numel() == whole.numel() // experts for p in pieces)


def test_check_tensors_fast_path_and_messages():
    specs = [ShardSpec("a", (2, 3), 0, ()), ShardSpec("b", (4,), 0, ())]
    good = {"b": torch.zeros(4), "a": torch.zeros(2, 3)}  # any order
    for want in (specs, spec_shapes(specs)):
        assert check_tensors(want, good, "x") == []
        assert check_tensors(want, {"a": (2, 3), "b": [4]}, "x") == []  # shapes, not tensors
        assert check_tensors(want, {"a": torch.zeros(3, 2), "c": torch.zeros(1)}, "x") == [
            "x 'a' has shape [3, 2], the plan [2, 3]",
            "x lacks parameter 'b' (plan shape [4])",
            "x parameter 'c' is not in the plan",
        ]
        assert check_tensors(want, {**good, "b": torch.zeros(1, 4)}, "x") == [
            "x 'b' has shape [1, 4], the plan [4]"
        ]


def test_the_kept_state_goes_with_the_sync(case):
    """Nothing global: a dropped sync frees its target's tensors, and a live sync does not
    keep a dropped actor alive."""
    case.sync()
    chunk = weakref.ref(case.chunk)
    del case.chunk
    gc.collect()
    assert chunk() is None
    store, tensor = weakref.ref(case.store), weakref.ref(case.store.tensors[QKV])
    del case.store, case.weight_sync
    gc.collect()
    assert store() is None and tensor() is None


def test_each_target_gets_every_row(case):
    """Two syncs into two targets from the same actor, alternately: each has its own state."""
    other = case.sync_into(case.new_store())
    for _ in range(2):
        for weight_sync in (case.weight_sync, other):
            for t in weight_sync.target.tensors.values():
                t.fill_(float("nan"))
            assert_bit_exact(case.sync(weight_sync).tensors, case.want(0), "alternating targets")
    assert case.kept_views() is not case.kept_views(other)


class BufferingStore(TensorStoreTarget):
    """A store that, like vLLM's CPU build, wants each parameter reported as soon as its last
    rows are in: it records how many parameters were open (handed out, not yet reported)."""

    buffers_params = True

    def begin(self, version: int) -> None:
        super().begin(version)
        self.open: set[str] = set()
        self.most_open = 0
        self.incomplete_when_done: list[str] = []

    def writable(self, name: str) -> torch.Tensor:
        self.open.add(name)
        self.most_open = max(self.most_open, len(self.open))
        return super().writable(name)

    def param_done(self, name: str) -> None:
        if self.tensors[name].isnan().any() or name in self.done:
            self.incomplete_when_done.append(name)
        self.open.discard(name)
        super().param_done(name)


def test_a_buffering_target_hears_of_each_parameter_as_soon_as_it_is_complete(case):
    store = case.new_store(BufferingStore)
    weight_sync = case.sync_into(store)
    for version in range(2):
        for t in store.tensors.values():
            t.fill_(float("nan"))
        assert_bit_exact(case.sync(weight_sync, version).tensors, case.want(0), "buffering")
        assert store.most_open == 1 and not store.incomplete_when_done
        assert store.done == set(store.tensors)
    assert weight_sync._views is None and weight_sync._program[1].per_param


class StandInVllmEngine:
    """What `VllmEngineTarget` reads of a `VllmEngine` on a GPU (direct writes into vLLM's
    checkpoint-format parameters), around a module tree holding vLLM's tensors."""

    def __init__(self, model: torch.nn.Module, hf_config: dict) -> None:
        from types import SimpleNamespace

        self.model = model
        self.args = SimpleNamespace(tp=1, weight_reload="direct")
        self.layout = SimpleNamespace(world_size=1)
        config = SimpleNamespace(to_dict=lambda: dict(hf_config))
        self.llm = SimpleNamespace(
            collective_rpc=lambda fn: [model],
            llm_engine=SimpleNamespace(
                model_config=SimpleNamespace(hf_config=config),
                vllm_config=SimpleNamespace(parallel_config=SimpleNamespace()),
            ),
        )
        self._loaded: set[str] = set()
        self.versions: list[int] = []

    def begin_weight_update(self, version: int) -> None:
        self.versions.append(version)

    def finish_weight_update(self) -> None:
        pass


@pytest.mark.parametrize("model", ["llama_gqa", "qwen3_moe"])
def test_vllm_target_keeps_its_parameter_table_until_vllm_replaces_a_parameter(model):
    """The target reads vLLM's parameter table once, not at every sync; a parameter object
    that vLLM replaced is written, not the one the kept table still holds."""
    from rl_megatron.rollout.vllm.target import VllmEngineTarget

    case = Case(model)
    hf = MOE_MODELS[model] if model in MOE_MODELS else MODELS[model]
    nan = {n: torch.full_like(t, float("nan")) for n, t in case.want(0).items()}
    engine = StandInVllmEngine(module_holding(nan), hf)
    target = VllmEngineTarget(engine)
    assert not target.layerwise
    weight_sync = case.sync_into(target)
    weight_sync.sync([case.chunk], 1)
    got = {n: p.detach() for n, p in engine.model.named_parameters()}
    assert_bit_exact(got, case.want(0), "first sync")
    walks = []
    named_parameters = engine.model.named_parameters
    engine.model.named_parameters = lambda *a, **k: walks.append(1) or named_parameters(*a, **k)
    weight_sync.sync([case.chunk], 2)
    assert walks == [], "a repeated sync walked vLLM's module tree"
    old = engine.model.get_parameter(QKV)
    replace_param(engine.model, QKV, torch.full_like(old, float("nan")))
    old.data.fill_(7.0)
    weight_sync.sync([case.chunk], 3)
    assert walks == [1]
    replaced = {QKV: engine.model.get_parameter(QKV).detach()}
    assert_bit_exact(replaced, {QKV: case.want(0)[QKV]}, "replaced")
    assert old.eq(7.0).all()
    assert engine.versions == [1, 2, 3]


class PythonOverrideParameter(torch.nn.Parameter):
    """A parameter whose torch calls run Python first, as vLLM's do (`BasevLLMParameter`
    forwards `__torch_function__` to torch's): counts them."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        PythonOverrideParameter.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_vllm_target_reads_its_parameters_without_their_python_override():
    """A repeated sync into vLLM's parameters reads their shapes and storage as plain
    tensors: their Python `__torch_function__` runs Python on every read (128 calls of
    the 0.85B sync's ~1.5 ms of host time on the H200 host), and it still writes them."""
    from rl_megatron.rollout.vllm.target import VllmEngineTarget

    case = Case("llama_gqa")
    model = module_holding({n: torch.zeros_like(t) for n, t in case.want(0).items()})
    for name, p in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        override = PythonOverrideParameter(p.detach(), requires_grad=False)
        setattr(model.get_submodule(module_name), leaf, override)
    weight_sync = case.sync_into(VllmEngineTarget(StandInVllmEngine(model, MODELS["llama_gqa"])))
    weight_sync.sync([case.chunk], 1)
    PythonOverrideParameter.calls = 0
    weight_sync.sync([case.chunk], 2)
    assert PythonOverrideParameter.calls == 0
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert_bit_exact(got, case.want(0), "vLLM-like parameters")
