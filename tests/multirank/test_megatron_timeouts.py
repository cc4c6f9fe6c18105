"""Every process group megatron-core creates times out after `parallel.timeout_s` seconds.

90 s is not a whole number of minutes: rounding to minutes (megatron-core takes its timeout
in minutes) would give 60 s, and a group created without one gets torch's 30 minutes.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from tests.spawn import run_on_ranks

TIMEOUT_S = 90


def _timeouts(group: dist.ProcessGroup) -> list[datetime.timedelta]:
    """The timeout of each backend behind `group` (gloo for the CPU, NCCL or gloo for CUDA)."""
    return [group._get_backend(device).options._timeout for device in group._device_types]


def _body(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state

    from rl_megatron.distributed import init_megatron
    from rl_megatron.parallel import ParallelLayout

    world = dist.group.WORLD
    before = set(dist.distributed_c10d._world.pg_map)
    init_megatron(ParallelLayout(tp=2, pp=1, dp=world_size // 2), TIMEOUT_S)
    created = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
    assert len(created) >= 10, f"megatron created only {len(created)} groups"
    assert parallel_state.get_tensor_model_parallel_group() in created
    expected = datetime.timedelta(seconds=TIMEOUT_S)
    wrong = {
        g.group_desc: [str(t) for t in _timeouts(g)]
        for g in created
        if g is not world and any(t != expected for t in _timeouts(g))
    }
    assert not wrong, f"groups without a {TIMEOUT_S} s timeout: {wrong}"


def test_megatron_subgroups_get_timeout_s():
    run_on_ranks(_body, world_size=2)
