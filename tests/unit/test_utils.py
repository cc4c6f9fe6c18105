"""Observability helpers and launch-environment parsing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rl_megatron.distributed import _first_slurm_host, launch_env
from rl_megatron.resharding.layouts import TrainingLayout, generation_layout_for, micro_dp
from rl_megatron.utils.flops import TransformerShape, flops_per_token, mfu
from rl_megatron.utils.metrics import MetricsTracker, read_metrics
from rl_megatron.utils.timers import PhaseTimer


def test_metrics_tracker_writes_one_json_line_per_step(tmp_path):
    tracker = MetricsTracker(tmp_path, rank=0)
    tracker.log(1, {"actor/pg_loss": 0.5, "timing_s/generate": 2})
    tracker.log(2, {"actor/pg_loss": float("nan")})
    rows = read_metrics(tmp_path)
    assert rows == [
        {"step": 1, "actor/pg_loss": 0.5, "timing_s/generate": 2.0},
        {"step": 2, "actor/pg_loss": "nan"},
    ]
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])


def test_metrics_tracker_silent_off_rank_0(tmp_path):
    MetricsTracker(tmp_path, rank=1).log(1, {"a/b": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_phase_timer_accumulates_per_phase():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.time("update"):
            sum(range(10000))
    with timer.time("generate"):
        pass
    metrics = timer.pop()
    assert set(metrics) == {"timing_s/update", "timing_s/generate"}
    assert metrics["timing_s/update"] > 0 and timer.pop() == {}


def test_flops_per_token_matches_hand_count():
    # One layer, hidden 4, 2 heads (head_dim 2), 1 KV group, FFN 8, vocab 10, gated MLP.
    shape = TransformerShape(1, 4, 8, 2, 1, 10)
    attn = 4 * (4 + 2 * 1 * 2) + 4 * 4  # QKV + output projection
    ffn = 3 * 4 * 8
    n = attn + ffn + 4 * 10
    assert shape.matmul_params() == n
    seq = 16
    causal_attention = 2 * 2 * 1 * 4 * seq / 2
    assert flops_per_token(shape, seq, training=False) == 2 * n + causal_attention
    assert flops_per_token(shape, seq) == 3 * (2 * n + causal_attention)
    # Llama-2-7B at 4k tokens: 6·N with N = 6.61e9 matmul parameters (6.74e9 minus the
    # 0.13e9 input embedding) plus causal attention 6·L·h·s = 3.2e9.
    llama7b = TransformerShape(32, 4096, 11008, 32, 32, 32000)
    assert llama7b.matmul_params() == pytest.approx(6.61e9, rel=0.01)
    assert flops_per_token(llama7b, 4096) == pytest.approx(6 * 6.61e9 + 3.22e9, rel=0.01)
    assert mfu(1000.0, llama7b, 4096, peak_tflops=989.0) == pytest.approx(
        1000 * flops_per_token(llama7b, 4096) / 989e12
    )
    # Qwen3-0.6B: head_dim 128 while hidden / heads = 64, so q and o_proj are 2048 wide;
    # its model card gives 0.44B non-embedding parameters (the tied head counts once more).
    qwen3 = TransformerShape(28, 1024, 3072, 16, 8, 151936, head_dim=128)
    assert qwen3.matmul_params() - 1024 * 151936 == pytest.approx(0.44e9, rel=0.01)
    assert flops_per_token(qwen3, 4096, training=False) == pytest.approx(
        2 * qwen3.matmul_params() + 2 * 28 * 2048 * 4096
    )


def test_moe_flops_count_the_router_and_the_top_k_experts_only():
    # The hand-count shape above with 4 experts of FFN 8, top-2: each token passes through
    # the router (4 × 4) and 2 experts, whatever the number of experts.
    moe = TransformerShape(1, 4, 8, 2, 1, 10, num_experts=4, moe_topk=2)
    attn = 4 * (4 + 2 * 1 * 2) + 4 * 4
    assert moe.matmul_params() == attn + 2 * 3 * 4 * 8 + 4 * 4 + 4 * 10
    more = TransformerShape(1, 4, 8, 2, 1, 10, num_experts=64, moe_topk=2)
    assert more.matmul_params() - moe.matmul_params() == 4 * (64 - 4)  # the router only
    # Qwen3-30B-A3B (48 layers, hidden 2048, 32 heads of 128, 4 KV groups, 128 experts of
    # FFN 768, top-8, untied vocab 151936): its model card gives 3.3B activated parameters,
    # which count the input embedding too.
    a3b = TransformerShape(48, 2048, 768, 32, 4, 151936, head_dim=128, num_experts=128, moe_topk=8)
    assert a3b.matmul_params() + 2048 * 151936 == pytest.approx(3.3e9, rel=0.02)


def test_transformer_shape_of_moe_model_facts():
    from types import SimpleNamespace

    info = SimpleNamespace(num_layers=4, hidden_size=64, ffn_hidden_size=32,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                           head_dim=16, num_experts=8, moe_topk=2)  # fmt: skip
    assert TransformerShape.of(info) == TransformerShape(
        4, 64, 32, 4, 2, 100, head_dim=16, num_experts=8, moe_topk=2
    )


def test_launch_env_torchrun_then_slurm():
    env = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "n1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (3, 8, 3, "n1")
    slurm = {
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
    }
    env = launch_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (9, 16, 1, "gpu007")
    assert launch_env({}).world_size == 1


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu[003-005,9],cpu1", "gpu003"), ("node7", "node7"), ("a1,b2", "a1"), ("x[12,4]", "x12")],
)
def test_first_slurm_host(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_layout_coordinates_follow_megatron_order():
    layout = TrainingLayout(tp=2, pp=2, dp=2)
    coords = [layout.coordinates(r) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["pp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp"] for c in coords] == [0] * 4 + [1] * 4
    generation = generation_layout_for(layout, rollout_tp=2)
    assert generation.replicas == 4 and micro_dp(layout, generation) == 2
    with pytest.raises(ValueError, match="does not divide"):
        generation_layout_for(layout, rollout_tp=3)


def test_transformer_shape_of_model_facts():
    from types import SimpleNamespace

    from rl_megatron.utils.flops import TransformerShape

    info = SimpleNamespace(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                           head_dim=128)  # fmt: skip
    assert TransformerShape.of(info) == TransformerShape(
        32, 4096, 11008, 32, 8, 32000, head_dim=128
    )


def fake_cuda(monkeypatch, **state) -> dict:
    """CUDA, faked: the memory figures the timer reads come from `state` (bytes), which the
    test changes as it goes; `state["resets"]` counts the peak resets, `state["syncs"]` the
    synchronisations; `state["on_reset"]`, if set, runs at the next reset (the peaks since a
    reset start from what is allocated then). An 80 GiB device."""
    state["resets"] = 0
    state["syncs"] = 0
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "synchronize", lambda *a: state.update(syncs=state["syncs"] + 1))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: state["allocated"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda *a: state["reserved"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (state["free"], 80 * 2**30))

    def reset(*_) -> None:
        state["resets"] += 1
        after_reset = state.pop("on_reset", None)
        if after_reset is not None:
            after_reset()

    monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset)
    return state


def test_phase_memory_figures_on_a_gpu_are_the_allocators_and_the_drivers(monkeypatch):
    """With CUDA (faked here: the figures come from the functions the timer must read), each
    phase reports the allocator's peak allocated and reserved and the driver's in-use
    figure at its end, the larger over repeated entries; a part's memory is its phase's."""
    from rl_megatron.utils.timers import device_used_gb

    gib = 2**30
    state = fake_cuda(monkeypatch, allocated=3 * gib, reserved=5 * gib, free=60 * gib)
    assert device_used_gb() == 20.0
    timer = PhaseTimer()
    with timer.time("update_actor"), timer.part("update_actor", "backward"):
        state.update(allocated=7 * gib, reserved=9 * gib, free=50 * gib)
    state.update(allocated=2 * gib, reserved=4 * gib, free=70 * gib)
    with timer.time("update_actor"):  # a second mini-batch: smaller figures
        pass
    timer.record("memory_gb/engine_asleep_device_used", device_used_gb())
    m = timer.pop()
    assert m["memory_gb/update_actor_peak"] == 7.0
    assert m["memory_gb/update_actor_reserved_peak"] == 9.0
    assert m["memory_gb/update_actor_device_used"] == 30.0
    assert m["memory_gb/engine_asleep_device_used"] == 10.0
    assert m["timing_parts_s/update_actor/backward"] <= m["timing_s/update_actor"]
    assert not any(k.startswith("timing_s/update_actor/") for k in m)
    # Consistent: the allocator cannot hold more than it reserved.
    assert m["memory_gb/update_actor_peak"] <= m["memory_gb/update_actor_reserved_peak"]


def test_on_device_peaks_subtract_the_least_memory_asleep_the_phase_saw(monkeypatch):
    """`off_device_bytes` (vLLM's memory asleep, which the allocator counts) is read at every
    boundary of a phase and of its parts; the least read comes off both peaks. A wake inside
    a phase (10 GiB asleep, then 4): less 4; a sleep (0, then 10): less 0. A wake and a
    sleep again inside one (the evaluation), the wake a part: less 0, not 10. A phase
    entered twice keeps the larger."""
    gib = 2**30
    state = fake_cuda(monkeypatch, allocated=30 * gib, reserved=32 * gib, free=40 * gib)
    asleep = {"gib": 10}
    timer = PhaseTimer(off_device_bytes=lambda: asleep["gib"] * gib)
    with timer.time("reshard"):
        asleep["gib"] = 4  # the weights wake, the KV cache still sleeps
    asleep["gib"] = 0  # the KV cache wakes between two phases
    with timer.time("generate"):
        asleep["gib"] = 10  # a sleep inside a phase: less 0 (from its start), not 10
    with timer.time("evaluate"):
        with timer.part("evaluate", "wake_kv_cache"):
            asleep["gib"] = 0
        asleep["gib"] = 10  # the engine sleeps again before the phase ends
    # Three mini-batches: the largest on the device is neither the largest peak nor the last.
    for allocated, asleep["gib"] in [(30, 10), (25, 0), (22, 0)]:
        state.update(allocated=allocated * gib, reserved=(allocated + 2) * gib)
        with timer.time("update_actor"):
            pass
    m = timer.pop()
    assert m["memory_gb/reshard_peak"] == 30.0  # the allocator's own figures unchanged
    assert m["memory_gb/reshard_peak_on_device"] == 26.0
    assert m["memory_gb/reshard_reserved_peak_on_device"] == 28.0
    assert m["memory_gb/generate_peak_on_device"] == 30.0
    assert m["memory_gb/evaluate_peak_on_device"] == 30.0
    assert m["memory_gb/evaluate_reserved_peak_on_device"] == 32.0
    assert m["memory_gb/update_actor_peak"] == 30.0
    assert m["memory_gb/update_actor_peak_on_device"] == 25.0
    assert m["memory_gb/update_actor_reserved_peak_on_device"] == 27.0


@pytest.mark.parametrize("provider", [None, lambda: None], ids=["no_provider", "says_none"])
def test_no_on_device_peaks_without_a_figure_of_memory_asleep(monkeypatch, provider):
    """No provider (the Megatron engine's memory is torch's own) or one that cannot say
    (vLLM without sleep mode): the allocator's peaks alone."""
    fake_cuda(monkeypatch, allocated=3 * 2**30, reserved=5 * 2**30, free=60 * 2**30)
    timer = PhaseTimer(off_device_bytes=provider)
    with timer.time("generate"), timer.part("generate", "decode"):
        pass
    m = timer.pop()
    assert "memory_gb/generate_peak" in m
    assert not any(k.endswith("_on_device") for k in m)


def test_peaks_closed_before_a_wake_keep_the_memory_asleep_before_it(monkeypatch):
    """The actor's update maps the engine's weights back during its last optimizer step, its
    peaks taken just before (`close_peaks`): the `_on_device` peaks subtract what was asleep
    then (10 GiB), not the 6 GiB still asleep after the wake, which would over-state them
    by the 4 GiB woken. The driver's figure is still the phase's end, the wake included.
    Without `close_peaks` (the same phase as before, the wake a part of it) the least read
    is the one after the wake."""
    gib = 2**30
    state = fake_cuda(monkeypatch, allocated=50 * gib, reserved=54 * gib, free=30 * gib)
    asleep = {"gib": 10}  # level 2: weights 4 GiB, KV cache 6 GiB

    def update_actor(timer: PhaseTimer, wake) -> None:
        asleep["gib"], state["free"] = 10, 30 * gib
        with timer.time("update_actor"):
            wake(timer)

    def early_wake(timer: PhaseTimer) -> None:
        timer.close_peaks("update_actor")
        with timer.overlapped("update_actor", "wake_engine_weights"):
            asleep["gib"], state["free"] = 6, 26 * gib

    def wake_as_a_part(timer: PhaseTimer) -> None:
        with timer.part("update_actor", "wake_weights"):
            asleep["gib"], state["free"] = 6, 26 * gib

    timer = PhaseTimer(off_device_bytes=lambda: asleep["gib"] * gib)
    update_actor(timer, early_wake)
    m = timer.pop()
    assert m["memory_gb/update_actor_peak"] == 50.0
    assert m["memory_gb/update_actor_reserved_peak"] == 54.0
    assert m["memory_gb/update_actor_peak_on_device"] == 40.0
    assert m["memory_gb/update_actor_reserved_peak_on_device"] == 44.0
    assert m["memory_gb/update_actor_device_used"] == 54.0  # at the end: after the wake

    update_actor(timer, wake_as_a_part)
    m = timer.pop()
    assert m["memory_gb/update_actor_peak"] == 50.0
    assert m["memory_gb/update_actor_peak_on_device"] == 44.0
    assert m["memory_gb/update_actor_reserved_peak_on_device"] == 48.0
    assert m["memory_gb/update_actor_device_used"] == 54.0


def test_a_wake_after_giving_torchs_cache_back_counts_each_interval_apart(monkeypatch):
    """The KV cache's wake (H200, 1.5B; benchmarks/runs/2026-12-02-h200-run16-wake-during-
    update-8b.md): torch reserved 195 GiB at the phase's start, 66 of it vLLM's KV cache
    asleep; torch's cache given back (a part: `make_room`),
    then the KV cache mapped (another part). Each interval's peak less the lesser memory
    asleep at its ends: 195 − 66 before the release, 96 − 0 after it; the phase reports 129.
    One interval for the whole phase would have subtracted 0 (asleep at the end) from 195,
    more than the 140 GiB device holds."""
    gib = 2**30
    state = fake_cuda(monkeypatch, allocated=190 * gib, reserved=195 * gib, free=10 * gib)
    asleep = {"gib": 66}
    timer = PhaseTimer(off_device_bytes=lambda: asleep["gib"] * gib)
    with timer.time("wake_kv_cache"):
        with timer.part("wake_kv_cache", "make_room_for_kv_cache"):
            # Released: the peaks stay those from before until the boundary resets them.
            state["on_reset"] = lambda: state.update(
                allocated=95 * gib, reserved=96 * gib, free=110 * gib
            )
        with timer.part("wake_kv_cache", "wake_kv_cache"):
            asleep["gib"], state["free"] = 0, 44 * gib
    m = timer.pop()
    assert m["memory_gb/wake_kv_cache_reserved_peak"] == 195.0
    assert m["memory_gb/wake_kv_cache_reserved_peak_on_device"] == 129.0
    assert m["memory_gb/wake_kv_cache_peak_on_device"] == 124.0
    assert m["memory_gb/wake_kv_cache_device_used"] == 36.0


def test_close_peaks_does_not_synchronise_and_the_end_still_reads_the_driver(monkeypatch):
    """`close_peaks` reads the allocator's peaks of what the host has queued, without waiting
    for the device; the phase's end synchronises once, as before, and records the driver's
    figure then. Twice entered, the phase keeps the larger of each."""
    gib = 2**30
    state = fake_cuda(monkeypatch, allocated=20 * gib, reserved=24 * gib, free=50 * gib)
    timer = PhaseTimer(off_device_bytes=lambda: 2 * gib)
    with timer.time("update_actor"):
        syncs = state["syncs"]
        timer.close_peaks("update_actor")
        assert state["syncs"] == syncs
        state.update(free=40 * gib)
    assert state["syncs"] == syncs + 1  # the end's
    state.update(allocated=12 * gib, reserved=14 * gib, free=60 * gib)
    with timer.time("update_actor"):
        timer.close_peaks("update_actor")
    m = timer.pop()
    assert m["memory_gb/update_actor_peak"] == 20.0
    assert m["memory_gb/update_actor_reserved_peak"] == 24.0
    assert m["memory_gb/update_actor_peak_on_device"] == 18.0
    assert m["memory_gb/update_actor_reserved_peak_on_device"] == 22.0
    assert m["memory_gb/update_actor_device_used"] == 40.0


def test_overlapped_host_work_is_timed_without_synchronising(monkeypatch):
    """`overlapped` adds the host's seconds to `timing_overlap_s/<phase>/<part>` (nowhere
    else), with neither a synchronisation nor a peak reset: the device's work goes on."""
    from rl_megatron.utils import timers

    clock = {"s": 100.0}
    monkeypatch.setattr(timers, "time", SimpleNamespace(perf_counter=lambda: clock["s"]))
    state = fake_cuda(monkeypatch, allocated=2**30, reserved=2**30, free=60 * 2**30)
    timer = PhaseTimer()
    with timer.time("update_actor"):
        clock["s"] += 1.0
        syncs, resets = state["syncs"], state["resets"]
        for seconds in (0.25, 0.5):
            with timer.overlapped("update_actor", "wake_engine_weights"):
                clock["s"] += seconds
        assert (state["syncs"], state["resets"]) == (syncs, resets)
    m = timer.pop()
    assert m["timing_overlap_s/update_actor/wake_engine_weights"] == 0.75
    assert m["timing_s/update_actor"] == 1.75
    assert not any(k.startswith("timing_parts_s/") for k in m)


def test_close_peaks_outside_its_phase_is_a_clear_error():
    """The benchmark's replayed update once ran outside `update_actor` and failed with a
    bare KeyError: the error names the phase and what to do."""
    timer = PhaseTimer()
    with pytest.raises(RuntimeError, match=r"close_peaks\('update_actor'\): the phase is not open"):
        timer.close_peaks("update_actor")
    with timer.time("update_actor"):
        timer.close_peaks("update_actor")
        with pytest.raises(RuntimeError, match="not open"):
            timer.close_peaks("update_actor")  # twice


def test_print_line_writes_the_line_and_its_newline_at_once():
    """Two ranks on one console under PYTHONUNBUFFERED interleaved `print`'s two writes
    ("error: …error: …"); one write per line keeps each whole."""
    from rl_megatron.utils.console import print_line

    class Recorder:
        def __init__(self):
            self.writes = []
            self.flushed = 0

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.flushed += 1

    stream = Recorder()
    print_line("error: refused on rank 1", stream)
    assert stream.writes == ["error: refused on rank 1\n"] and stream.flushed == 1
