"""Run-time verification of a weight sync (`resharding/verify.py`), without an engine.

The engine is a `TensorStoreTarget` in vLLM's layout (one process, a one-rank gloo group,
as tests/unit/test_reshard_caches.py); "reading it back" returns its tensors with one
element changed by the smallest step (its bits + 1), as an engine that repacked or
mis-wrote one parameter would hold. Every parameter of a dense and of an MoE model is
corrupted in turn: the verification must name it, the element and both values, and the
engine must refuse to generate (the target aborted). Bit-exact: any difference is caught.
"""

from __future__ import annotations

import time

import pytest
import torch

from rl_megatron.resharding.layouts import TrainingLayout, generation_layout_for
from rl_megatron.resharding.plan import PlanKey, build_plan
from rl_megatron.resharding.verify import (
    Rotation,
    SyncVerifier,
    SyncVerifyError,
    differs,
    first_difference,
    kind_of,
    restricted_plan,
)
from rl_megatron.resharding.weight_sync import WeightSync
from rl_megatron.rollout.vllm import specs as vllm_layout
from tests.unit.test_reshard_caches import BUCKET_MB, Case, one_rank  # noqa: F401

BITS = {2: torch.int16, 4: torch.int32}


def choose(names, mode: str, index: int) -> list[str]:
    """The parameters the `index`-th verification checks (whole tensors, no windows)."""
    if mode == "full":
        return list(names)
    return [name for name, _ in Rotation(names, {}).picks(index)]


def nudged(t: torch.Tensor, flat: int) -> torch.Tensor:
    """`t` with element `flat` moved by one unit in the last place."""
    out = t.clone()
    out.reshape(-1).view(BITS[t.element_size()])[flat] += 1
    return out


def names_of(case: Case) -> list[str]:
    return [s.name for s in vllm_layout.vllm_specs(case.info, 1, 0, case.gen_vocab)]


def test_first_difference_finds_one_bit_in_bf16_and_takes_nan_as_equal():
    a = torch.randn(3, 5).to(torch.bfloat16)
    assert first_difference(a, a.clone()) is None
    b = nudged(a, 7)
    index, have, sent = first_difference(b, a)
    assert index == (1, 2)
    assert (have, sent) == (b[1, 2].item(), a[1, 2].item()) and have != sent
    nan = torch.full((2,), float("nan"))
    assert first_difference(nan, nan.clone()) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 8).to(torch.bfloat16),  # 8-byte words
        lambda: torch.randn(3, 5).to(torch.bfloat16),  # 30 bytes: 2-byte words
        lambda: torch.randn(6, 5),  # fp32, 120 bytes: 8-byte words
        lambda: torch.randn(1, 37).to(torch.float8_e4m3fn),  # 1-byte elements
        lambda: torch.randn(4, 9).to(torch.bfloat16)[1:],  # storage offset of 18 bytes
    ],
)
def test_differs_sees_one_changed_element_anywhere(make):
    """The device-side check compares whole words: a change in any element, the first and
    the last (a partial word's) included, is seen; equal bits are equal (NaN too)."""
    a = make()
    assert not bool(differs(a, a.clone()))
    for flat in (0, a.numel() // 2, a.numel() - 1):
        changed = a.clone()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        changed.reshape(-1).view(bits)[flat] += 1
        assert bool(differs(changed, a)) and bool(differs(a, changed)), flat
    nan = torch.full((5,), float("nan"), dtype=torch.bfloat16)
    assert not bool(differs(nan, nan.clone()))
    assert bool(differs(torch.zeros(4), -torch.zeros(4)))  # -0 and +0: other bits


@pytest.mark.parametrize("model", ["llama_gqa", "qwen3_moe"])
def test_sample_covers_every_kind_each_time_and_every_parameter_in_turn(model):
    names = names_of(Case(model))
    kinds = {kind_of(n) for n in names}
    assert "other" not in kinds
    want = {"attention_qkv", "attention_o", "embedding", "norm"}
    want |= {"experts_w13", "experts_w2", "router"} if "moe" in model else {"mlp_gate_up"}
    assert want <= kinds
    seen: set[str] = set()
    for index in range(len(names)):
        chosen = choose(names, "sample", index)
        assert sorted(kind_of(n) for n in chosen) == sorted(kinds)  # one of each kind
        seen |= set(chosen)
    assert seen == set(names)
    assert choose(names, "full", 3) == names


def tp2_plan():
    """A plan from training TP 2 into one generation rank (t_g 1): messages between ranks."""
    case = Case("llama_gqa")
    training = TrainingLayout(2, 1, 1)
    gen = generation_layout_for(training, 1)
    key = PlanKey(case.info, training, gen, vllm_layout.vllm_specs, case.train_vocab * 2,
                  case.gen_vocab, 1 << 12, 4)  # fmt: skip
    return build_plan(key)


def test_a_restricted_plan_moves_only_the_chosen_rows():
    plan = tp2_plan()
    chosen = {"model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"}
    sub = restricted_plan(plan, chosen)
    for rounds in sub.rounds:
        for r in rounds:
            moves = [*r.writes, *(m for ms in (*r.sends.values(), *r.recvs.values()) for m in ms)]
            assert {m.dst_param for m in moves} <= chosen
    # rank 0 receives from rank 1 exactly what rank 1 sends it
    sent = [m for r in sub.rounds[1] for m in r.sends.get(0, [])]
    got = [m for r in sub.rounds[0] for m in r.recvs.get(1, [])]
    assert sent == got and sent
    assert set(sub.writes[0]) == chosen


def engine_reading(store, corrupt: str | None, flat: int = 0):
    def read(names=None):
        tensors = dict(store.tensors)
        if corrupt is not None:
            tensors[corrupt] = nudged(tensors[corrupt], flat)
        return tensors

    return read


@pytest.mark.parametrize("model", ["llama_gqa", "qwen3_moe"])
def test_full_verification_catches_one_changed_element_in_any_parameter(model):
    case = Case(model)
    store = case.store
    for name in names_of(case):
        flat = store.tensors[name].numel() // 2
        verifier = SyncVerifier("full", interval=1, read_engine=engine_reading(store, name, flat))
        weight_sync = WeightSync(store, info=case.info, training=case.training,
                                 bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
        with pytest.raises(SyncVerifyError) as err:
            weight_sync.sync([case.chunk], version=1)
        index = list(torch.unravel_index(torch.tensor(flat), store.tensors[name].shape))
        assert f"engine parameter {name} differs" in str(err.value)
        assert f"at index {[int(i) for i in index]}" in str(err.value)
        assert store.version is None and weight_sync.version is None  # aborted


@pytest.mark.parametrize("model", ["llama_gqa", "qwen3_moe"])
def test_sample_verification_catches_a_changed_parameter_when_its_turn_comes(model):
    case = Case(model)
    names = names_of(case)
    target = "model.layers.1.self_attn.o_proj.weight"
    verifier = SyncVerifier("sample", interval=2, read_engine=engine_reading(case.store, target))
    weight_sync = WeightSync(case.store, info=case.info, training=case.training,
                             bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
    turn = next(i for i in range(len(names)) if target in choose(names, "sample", i))
    for sync in range(2 * turn):
        stats = weight_sync.sync([case.chunk], version=sync)
        if sync % 2:
            assert stats.verify is None  # interval 2
        else:
            assert stats.verify.verified_tensors == len(choose(names, "sample", 0))
            assert stats.verify.verified_bytes > 0
    with pytest.raises(SyncVerifyError, match=target):
        weight_sync.sync([case.chunk], version=2 * turn)


def test_each_chosen_set_is_compiled_once_per_plan(monkeypatch):
    """`sample` rotates through a fixed number of sets: their restricted plans and copy
    programs are compiled on first use and reused after (the sync's host cost)."""
    import rl_megatron.resharding.verify as verify

    compiled = []
    real = verify.compile_program
    monkeypatch.setattr(
        verify, "compile_program", lambda *a, **k: compiled.append(1) or real(*a, **k)
    )
    case = Case("llama_gqa")
    names = names_of(case)
    verifier = SyncVerifier("sample", interval=1, read_engine=lambda names: case.store.tensors)
    weight_sync = WeightSync(case.store, info=case.info, training=case.training,
                             bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
    sets = {tuple(choose(names, "sample", i)) for i in range(len(names))}
    for version in range(len(names)):  # one whole rotation: every set once
        assert weight_sync.sync([case.chunk], version=version).verify.verified_tensors > 0
    first = len(compiled)
    assert first >= len(sets) > 1
    for version in range(len(names), 2 * len(names)):  # the same sets again: no compiling
        weight_sync.sync([case.chunk], version=version)
    assert len(compiled) == first


def test_an_honest_engine_passes_and_off_reads_nothing():
    case = Case("qwen3_moe")
    reads = []

    def read(names):
        reads.append(names)
        return case.store.tensors

    verifier = SyncVerifier("full", interval=1, read_engine=read)
    weight_sync = WeightSync(case.store, info=case.info, training=case.training,
                             bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
    started = time.perf_counter()
    stats = weight_sync.sync([case.chunk], version=1)
    wall = time.perf_counter() - started
    assert 0 < stats.verify.verify_s <= wall  # its cost, as the metrics report it
    # the plan's first check reads every parameter (which are comparable), then the chosen
    assert stats.verify.verified_tensors == len(names_of(case))
    assert reads[0] is None and sorted(reads[1]) == sorted(names_of(case)) and len(reads) == 2
    weight_sync.sync([case.chunk], version=2)
    assert len(reads) == 3 and sorted(reads[2]) == sorted(names_of(case))
    assert stats.verify.verified_bytes == sum(t.nbytes for t in case.store.tensors.values())
    # off: the trainer's sync has no verifier, and its stats say nothing was verified
    stats = case.weight_sync.sync([case.chunk], version=3)
    assert case.weight_sync.verifier is None and stats.verify is None


def test_off_builds_no_verifier_for_vllm():
    from rl_megatron.rollout.vllm.verify import verifier_for

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"off read the engine ({name})")

    assert verifier_for(Untouchable(), "off", 1) is None
    with pytest.raises(AssertionError, match="off read the engine"):
        verifier_for(Untouchable(), "sample", 1)  # on: it does look at the engine


@pytest.mark.parametrize("corrupt", [None, "weight", "weight_scale_inv"])
def test_a_parameter_stored_as_fp8_is_compared_with_the_sent_weight_quantized(corrupt):
    """vLLM's FP8 engines hold a linear weight as fp8 bytes and per-block scales (the
    target quantizes what lands): the check quantizes what it recomputes the same way and
    compares both tensors bitwise, naming the one that differs."""
    from rl_megatron.resharding.fp8 import FP8_DTYPE, block_scale_shape, quantize_blockwise_
    from rl_megatron.resharding.verify import StoredForm

    case = Case("llama_gqa")
    name = "model.layers.1.mlp.down_proj.weight"
    scale_name = name.removesuffix("weight") + "weight_scale_inv"

    def quantized(sent):
        out = torch.empty(sent.shape, dtype=FP8_DTYPE)
        scale = torch.empty(block_scale_shape(tuple(sent.shape)))
        quantize_blockwise_(sent, out, scale, name)
        return {name: out, scale_name: scale}

    def read(names):
        tensors = dict(case.store.tensors)
        tensors.update(quantized(tensors[name]))  # what an honest FP8 target holds
        if corrupt is not None:
            key = name if corrupt == "weight" else scale_name
            bits = {1: torch.uint8, 4: torch.int32}[tensors[key].element_size()]
            tensors[key] = tensors[key].clone()
            tensors[key].reshape(-1).view(bits)[1 if corrupt == "weight" else 0] += 1
        return tensors

    sent_dtype = case.store.tensors[name].dtype
    verifier = SyncVerifier("full", interval=1, read_engine=read,
                            forms={name: StoredForm(sent_dtype, quantized, (name, scale_name))})  # fmt: skip
    weight_sync = WeightSync(case.store, info=case.info, training=case.training,
                             bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
    if corrupt is None:
        stats = weight_sync.sync([case.chunk], version=1)
        # the fp8 weight and its scales are each one verified tensor
        assert stats.verify.verified_tensors == len(names_of(case)) + 1
        return
    with pytest.raises(SyncVerifyError) as err:
        weight_sync.sync([case.chunk], version=1)
    key = name if corrupt == "weight" else scale_name
    assert f"engine parameter {key} differs from the trainer's weight quantized" in str(err.value)
    assert f"at index {[0, 1] if corrupt == 'weight' else [0, 0]}" in str(err.value)


# ---------------------------------------------------------------- sample's row windows


def window_verifier(case: Case, read, window_bytes: int) -> tuple[SyncVerifier, WeightSync]:
    verifier = SyncVerifier("sample", interval=1, read_engine=read, window_bytes=window_bytes)
    weight_sync = WeightSync(case.store, info=case.info, training=case.training,
                             bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
    return verifier, weight_sync


def hf_rows(spec) -> list[tuple[str | None, int]]:
    """Each row of `spec` along its dim: (HF tensor, its row), or (None, 0) for padding."""
    rows = []
    for span in spec.spans:
        for i in range(span.length):
            rows.append((span.hf_name, span.hf_start + i if span.hf_name else 0))
    return rows


def test_a_windowed_restricted_plan_writes_exactly_those_rows_of_the_sync():
    """Every window of every parameter, run into scratch, is bit for bit the window's rows
    of what the whole sync wrote (a source offset shifted wrongly, or a window renumbered
    from its start in the wrong direction, moves other rows)."""
    from rl_megatron.resharding.copy_program import compile_program
    from rl_megatron.resharding.executor import execute
    from rl_megatron.resharding.verify import ScratchTarget

    case = Case("qwen3_padded_vocab")  # vocab padding rows: fills clipped too
    synced = case.sync()
    plan = case.weight_sync._program[0]  # the plan the sync ran
    sources = case.weight_sync._sources([case.chunk])
    checked = 0
    for spec in plan.targets[0]:
        if spec.stack:
            continue
        rows = spec.shape[spec.dim]
        for start, length in ((0, 1), (rows // 3, max(1, rows // 2)), (rows - 2, 2)):
            if not 0 <= start < rows:
                continue
            sub = restricted_plan(plan, {spec.name}, {spec.name: (start, length)})
            (window_spec,) = sub.targets[0]
            want = synced.tensors[spec.name].narrow(spec.dim, start, min(length, rows - start))
            assert window_spec.shape == tuple(want.shape)
            # its spans still say which HF row each row holds
            assert hf_rows(window_spec) == hf_rows(spec)[start : start + want.shape[spec.dim]]
            scratch = ScratchTarget({spec.name: want}, None, {spec.name: window_spec.shape})
            scratch.tensors[spec.name].fill_(float("nan"))  # every row must be written
            execute(sub, compile_program(sub, 0), 0, sources, scratch, group=None)
            assert torch.equal(scratch.tensors[spec.name], want), (spec.name, start)
            checked += 1
    assert checked > 10


def test_windowed_moves_shrink_alike_on_sender_and_receiver():
    plan = tp2_plan()
    name = "lm_head.weight"
    (spec,) = [s for s in plan.targets[0] if s.name == name]
    sub = restricted_plan(plan, {name}, {name: (100, 300)})
    sent = [m for r in sub.rounds[1] for m in r.sends.get(0, [])]
    got = [m for r in sub.rounds[0] for m in r.recvs.get(1, [])]
    local = [m for r in sub.rounds[0] for m in r.writes]
    assert sent == got
    # the window's 300 rows, each written once, renumbered from 0
    rows = sorted((m.dst_offset, m.dst_offset + m.rows) for m in [*got, *local])
    assert rows[0][0] == 0 and rows[-1][1] == 300
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert sub.writes[0] == {name: len(got) + len(local)}
    assert sub.targets[0][0].shape == (300, *spec.shape[1:])


def test_rotation_checks_every_kind_each_time_and_every_window_within_two_periods():

    names = names_of(Case("llama_gqa"))
    windows = {n: 3 for n in names if "embed" in n or "lm_head" in n or "gate_up" in n}
    rotation = Rotation(names, windows)
    kinds = {kind_of(n) for n in names}
    pairs = {(n, w) for n in names for w in (range(windows[n]) if n in windows else [None])}
    seen = set()
    for index in range(2 * rotation.period):
        picks = rotation.picks(index)
        assert sorted(kind_of(n) for n, _ in picks) == sorted(kinds)
        assert picks == rotation.picks(index + rotation.period)  # periodic: sets compile once
        seen |= set(picks)
    assert seen == pairs
    # the longest kind's cycle: two layers' gate_up x 3 windows, or the norms
    groups = {}
    for n in names:
        groups.setdefault(kind_of(n), []).append(n)
    assert rotation.period == max(
        len(g) * max(windows.get(n, 1) for n in g) for g in groups.values()
    )


def test_sample_bounds_a_checks_bytes_by_the_window_and_names_the_whole_tensors_index():
    """With windows smaller than the vocabulary matrices, a check reads at most a window of
    each; a changed element of the LM head is caught when its window comes round, and the
    error names its index in the whole tensor."""
    case = Case("llama_gqa")
    name = "lm_head.weight"
    shape = case.store.tensors[name].shape
    row = shape[0] - 3  # in the last window
    flat = row * shape[1] + 5
    window_bytes = 64 * shape[1] * 4  # 64 rows of fp32
    verifier, weight_sync = window_verifier(
        case, engine_reading(case.store, name, flat), window_bytes
    )
    caught = None
    for version in range(64):
        try:
            stats = weight_sync.sync([case.chunk], version=version)
        except SyncVerifyError as err:
            caught = (version, str(err))
            break
        assert (
            stats.verify.verified_bytes <= len({kind_of(n) for n in names_of(case)}) * window_bytes
        )
    assert caught is not None, "the changed row's window never came round"
    assert f"engine parameter {name} differs" in caught[1]
    assert f"at index {[row, 5]}" in caught[1]
    windows = verifier._selection.rotation.windows[name]
    assert windows == -(-shape[0] // 64) and caught[0] < 2 * verifier._selection.rotation.period


def test_a_sample_check_is_one_chunk_sized_by_its_windows():
    """Scratch is cut by the windows' bytes, not the whole tensors': with 4 KiB windows and
    a 64 KiB bucket every set of the period is one chunk (one program, one host sync),
    where the whole vocabulary matrices (128 KiB each) would not fit one."""
    case = Case("llama_gqa")
    verifier = SyncVerifier(
        "sample", interval=1, read_engine=lambda names: case.store.tensors, window_bytes=4096
    )
    weight_sync = WeightSync(
        case.store, info=case.info, training=case.training, bucket_mb=1 / 16, verifier=verifier
    )
    weight_sync.sync([case.chunk], version=0)
    sets = verifier._selection.sets
    assert len(sets) == verifier._selection.rotation.period > 1
    assert all(len(chunks) == 1 for chunks in sets.values())
    assert case.store.tensors["lm_head.weight"].nbytes > 64 * 1024 // 2


def test_a_parameter_reshaped_after_the_first_check_is_an_error():
    case = Case("llama_gqa")
    name = "model.layers.0.mlp.down_proj.weight"

    def read(names):
        tensors = dict(case.store.tensors)
        if names is not None:  # after the plan's first look: the engine swapped it
            tensors[name] = tensors[name].t().contiguous()
        return tensors

    verifier = SyncVerifier("full", interval=1, read_engine=read)
    weight_sync = WeightSync(case.store, info=case.info, training=case.training,
                             bucket_mb=BUCKET_MB, verifier=verifier)  # fmt: skip
    with pytest.raises(SyncVerifyError, match=f"{name} is .* as at the first check"):
        weight_sync.sync([case.chunk], version=1)


def test_an_interval_verifies_the_first_sync_and_every_interval_th_after():
    verifier = SyncVerifier("sample", interval=3, read_engine=lambda names: {})
    assert [verifier.due() for _ in range(7)] == [True, False, False, True, False, False, True]
    every = SyncVerifier("full", interval=1, read_engine=lambda names: {})
    assert all(every.due() for _ in range(3))
