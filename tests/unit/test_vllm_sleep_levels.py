"""The vLLM engine's sleep levels against a stand-in of vLLM's allocator (GPU-only paths).

vLLM's CPU build has no sleep mode, so the GPU paths of `VllmEngine._sleep` / `_wake` are
driven here through stand-ins: `FakeLLM` behaves as vLLM 0.26's `LLM.sleep` / `wake_up` do
on its allocator (every allocation unmapped; the tags asked for mapped back), and the
allocator raises on what the real one cannot do (unmapping an unmapped allocation, mapping
a mapped one). Level 0 (`rollout.sleep_level: 0`) drives the allocator itself: only the
KV cache's allocations go. The H200 run checked the real thing (greedy tokens unchanged
after level-0 sleeps and wakes: benchmarks/runs/2026-12-01-h200-run10-sync-kept-mapped.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from rl_megatron.rollout.engine import RolloutEngine
from rl_megatron.rollout.vllm import engine as vllm_engine
from rl_megatron.rollout.vllm.engine import VllmEngine


@dataclass
class Allocation:
    tag: str
    handle: tuple[int, int]  # (pointer, bytes), as vLLM's
    is_asleep: bool = False


class FakeAllocator:
    def __init__(self) -> None:
        self.pointer_to_data = {
            1: Allocation("weights", (1, 100)),
            2: Allocation("kv_cache", (2, 1000)),
            3: Allocation("kv_cache", (3, 1000)),
        }
        self.free_bytes = 1 << 40  # the driver's free memory (`torch.cuda.mem_get_info`)
        self.released = 0  # `torch.cuda.empty_cache` calls

    def mapped(self) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for data in self.pointer_to_data.values():
            out.setdefault(data.tag, []).append(not data.is_asleep)
        return out

    def by_handle(self, handle) -> Allocation:
        return self.pointer_to_data[handle[0]]


@pytest.fixture
def allocator(monkeypatch) -> FakeAllocator:
    from vllm.device_allocator import cumem

    alloc = FakeAllocator()

    def unmap_and_release(handle):
        data = alloc.by_handle(handle)
        assert not data.is_asleep, f"{data.tag} unmapped twice"

    def create_and_map(handle):
        data = alloc.by_handle(handle)
        assert data.is_asleep, f"{data.tag} mapped twice"

    monkeypatch.setattr(cumem.CuMemAllocator, "get_instance", staticmethod(lambda: alloc))
    monkeypatch.setattr(cumem, "unmap_and_release", unmap_and_release)
    monkeypatch.setattr(cumem, "create_and_map", create_and_map)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (alloc.free_bytes, 1 << 41))

    def empty_cache() -> None:
        alloc.released += 1

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    return alloc


class FakeLLM:
    """`vllm.LLM`'s sleep API as vLLM 0.26 runs it on its allocator, and a recorder."""

    def __init__(self, alloc: FakeAllocator) -> None:
        self.alloc = alloc
        self.calls: list[str] = []
        self.worker = SimpleNamespace(
            model_runner=SimpleNamespace(post_kv_cache_wake_up=lambda: self.calls.append("post"))
        )

    def collective_rpc(self, fn, args=()):
        self.calls.append(fn.__name__)
        return [fn(self.worker, *args)]

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep{level}")
        for data in self.alloc.pointer_to_data.values():
            assert not data.is_asleep, f"vLLM's sleep would unmap {data.tag} twice"
            data.is_asleep = True

    def wake_up(self, tags) -> None:
        self.calls.append("wake_up:" + ",".join(tags))
        for data in self.alloc.pointer_to_data.values():
            if data.tag in tags:
                assert data.is_asleep, f"vLLM's wake would map {data.tag} twice"
                data.is_asleep = False

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True


def engine_on(alloc: FakeAllocator) -> VllmEngine:
    """A `VllmEngine` on a GPU with sleep mode, around `FakeLLM` (nothing else built)."""
    eng = VllmEngine.__new__(VllmEngine)
    RolloutEngine.__init__(eng, weight_version=1)
    eng._sleep_mode = True
    eng._llm = FakeLLM(alloc)
    eng._prefix_cache_dirty = True  # something was generated
    eng._kv_cache_unmapped = False
    return eng


# A level-0 sleep and its KV-cache wake, as the stand-in records them.
LEVEL_0_ROUND = [
    "reset_prefix_cache",
    "_rpc_unmap_kv_cache",
    "_rpc_asleep_bytes",
    "_rpc_map_kv_cache",
    "post",
]


def test_level_0_unmaps_only_the_kv_cache_and_maps_it_back(allocator):
    eng = engine_on(allocator)
    eng.sleep(level=0)
    assert allocator.mapped() == {"weights": [True], "kv_cache": [False, False]}
    assert eng.awake_tags == {"weights"} and eng.weight_version == 1
    eng.wake(["weights"])  # nothing asleep there
    eng.wake(["kv_cache"])
    assert allocator.mapped() == {"weights": [True], "kv_cache": [True, True]}
    # The KV cache's contents went with it: its cached prefixes first. vLLM's own sleep
    # (which would unmap the weights) never ran.
    assert eng._llm.calls == LEVEL_0_ROUND


def test_a_deeper_sleep_after_level_0_unmaps_each_allocation_once(allocator):
    eng = engine_on(allocator)
    eng.sleep(level=0)
    eng.sleep(level=2)  # vLLM's sleep unmaps everything: the KV cache is mapped back first
    assert allocator.mapped() == {"weights": [False], "kv_cache": [False, False]}
    eng.wake()
    assert allocator.mapped() == {"weights": [True], "kv_cache": [True, True]}
    assert eng._llm.calls == [
        *LEVEL_0_ROUND,
        "sleep2",
        "_rpc_asleep_bytes",
        "wake_up:weights,kv_cache",
    ]


def test_level_0_while_vllm_still_sleeps_leaves_the_wake_to_vllm(allocator):
    eng = engine_on(allocator)
    eng.sleep(level=2)
    eng.wake(["weights"])
    eng.sleep(level=0)  # its KV cache is still vLLM's asleep one: vLLM's wake resumes it
    eng.wake(["kv_cache"])
    assert allocator.mapped() == {"weights": [True], "kv_cache": [True, True]}
    assert [c for c in eng._llm.calls if c != "_rpc_asleep_bytes"] == [
        "sleep2",
        "wake_up:weights",
        "wake_up:kv_cache",
    ]


def test_the_prefix_cache_is_reset_only_when_something_was_cached(allocator):
    eng = engine_on(allocator)
    eng._param_names, eng._layerwise = set(), False

    def update(version: int) -> None:  # the weights written in place: no bucket
        eng.begin_weight_update(version)
        eng.finish_weight_update()

    update(2)  # after a generate: reset
    update(3)  # nothing generated since: no reset
    assert eng._llm.calls.count("reset_prefix_cache") == 1
    eng._prefix_cache_dirty = True
    eng.sleep(level=2)  # vLLM drops the cache with the KV memory
    eng.wake(["weights"])
    update(4)
    assert eng._llm.calls.count("reset_prefix_cache") == 1
    assert eng.weight_version == 4


def test_level_0_needs_vllms_allocator_bookkeeping(allocator):
    allocator.pointer_to_data = {  # an older allocator: no is_asleep on its records
        p: SimpleNamespace(tag=d.tag, handle=d.handle) for p, d in allocator.pointer_to_data.items()
    }
    with pytest.raises(RuntimeError, match="rollout.sleep_level=0"):
        vllm_engine._kv_cache_allocations(allocator)


def test_torchs_cached_memory_is_given_back_only_when_the_wake_needs_it(allocator):
    """A wake maps its tags' unmapped allocations (weights 100 bytes, KV cache 2 000 here):
    torch's cache is emptied only when the driver's free memory is short of that plus the
    headroom, once per wake that is short."""
    eng = engine_on(allocator)
    headroom = vllm_engine.wake_headroom_bytes
    eng.sleep(level=2)
    allocator.free_bytes = 100 + headroom(100)  # just enough for the weights
    eng.wake(["weights"])
    assert allocator.released == 0
    allocator.free_bytes = 2000 + headroom(2000) - 1  # one byte short for the KV cache
    eng.wake(["kv_cache"])
    assert allocator.released == 1
    assert allocator.mapped() == {"weights": [True], "kv_cache": [True, True]}
    eng.sleep(level=0)  # level 0: the KV cache only, counted the same way
    allocator.free_bytes = 2000 + headroom(2000)
    eng.wake(["kv_cache"])
    assert allocator.released == 1


def test_asleep_bytes_count_the_unmapped_allocations_of_the_tags(allocator):
    allocator.pointer_to_data[2].is_asleep = True
    allocator.pointer_to_data[1].is_asleep = True
    rpc = vllm_engine._rpc_asleep_bytes
    assert rpc(None, ("kv_cache",)) == 1000  # allocation 3 is still mapped
    assert rpc(None, ("weights", "kv_cache")) == 1100
    assert rpc(None, ()) == 0


def test_mapped_bytes_follow_the_sleep_levels(allocator):
    """What vLLM's allocator holds mapped: everything awake, nothing after a level-2 sleep,
    the weights alone after their wake or a level-0 sleep."""
    eng = engine_on(allocator)
    assert eng.mapped_bytes() == 2100
    eng.sleep(level=2)
    assert eng.mapped_bytes() == 0
    eng.wake(["weights"])
    assert eng.mapped_bytes() == 100
    eng.wake(["kv_cache"])
    eng.sleep(level=0)
    assert eng.mapped_bytes() == 100
    eng._sleep_mode = False  # no sleep mode: nothing to say
    assert eng.mapped_bytes() is None


def test_unmapped_bytes_count_every_asleep_allocation(allocator):
    """What vLLM's allocator holds asleep, every tag: what torch counts allocated without the
    device holding it. Always the complement of the mapped bytes."""
    eng = engine_on(allocator)
    assert eng.unmapped_bytes() == 0
    eng.sleep(level=2)
    assert eng.unmapped_bytes() == 2100
    eng.wake(["weights"])
    assert eng.unmapped_bytes() == 2000
    eng.wake(["kv_cache"])
    eng.sleep(level=0)
    assert eng.unmapped_bytes() == 2000
    assert eng.mapped_bytes() + eng.unmapped_bytes() == 2100
    # A tag of neither kind (vLLM's default) counts too; a record that does not say whether
    # it sleeps counts as mapped (subtracted from a peak, it would make the peak too low).
    allocator.pointer_to_data[4] = Allocation("default", (4, 7), is_asleep=True)
    allocator.pointer_to_data[5] = SimpleNamespace(tag="weights", handle=(5, 5))
    assert eng.unmapped_bytes() == 2007
    eng._sleep_mode = False  # no sleep mode: nothing to say
    assert eng.unmapped_bytes() is None
    assert RolloutEngine.unmapped_bytes(eng) is None  # the engines without an allocator


def test_the_trainer_records_what_the_engine_holds_mapped(allocator):
    """`memory_gb/<state>_mapped` beside the driver's figure (none on a CPU)."""
    from rl_megatron.trainer.ppo_trainer import PPOTrainer
    from rl_megatron.utils.timers import PhaseTimer

    eng = engine_on(allocator)
    eng.sleep(level=2)
    eng.wake(["weights"])
    trainer = SimpleNamespace(engine=eng, phases=PhaseTimer())
    PPOTrainer._record_device_used(trainer, "engine_asleep")
    assert trainer.phases.pop()["memory_gb/engine_asleep_mapped"] == 100 / 2**30


def test_wake_if_room_maps_the_weights_when_they_fit_without_emptying_the_cache(allocator):
    """During the actor's last optimizer step the trainer maps the weights back only when
    the driver's free memory covers them and the headroom (just enough here): they are
    mapped, the engine counts them awake, and torch's cache is left alone (giving it back
    would wait for the device)."""
    eng = engine_on(allocator)
    eng.sleep(level=2)
    allocator.free_bytes = 100 + vllm_engine.wake_headroom_bytes(100)
    assert eng.wake_if_room(["weights"]) is True
    assert allocator.pointer_to_data[1].is_asleep is False
    assert allocator.mapped() == {"weights": [True], "kv_cache": [False, False]}
    assert eng.awake_tags == {"weights"}
    assert allocator.released == 0
    assert eng._llm.calls[-1] == "wake_up:weights"
    eng.wake(["weights"])  # the sync's wake: nothing left to do
    assert eng._llm.calls[-1] == "wake_up:weights" and allocator.released == 0


def test_wake_if_room_without_room_maps_nothing_and_leaves_the_wake_to_the_sync(allocator):
    """One byte short: False, nothing mapped, torch's cache not given back; the sync's plain
    wake then gives it back and maps the weights, as before."""
    eng = engine_on(allocator)
    eng.sleep(level=2)
    allocator.free_bytes = 100 + vllm_engine.wake_headroom_bytes(100) - 1
    calls = len(eng._llm.calls)
    assert eng.wake_if_room(["weights"]) is False
    assert allocator.mapped() == {"weights": [False], "kv_cache": [False, False]}
    assert eng.awake_tags == set()
    assert allocator.released == 0
    assert eng._llm.calls[calls:] == ["_rpc_asleep_bytes"]
    eng.wake(["weights"])
    assert allocator.released == 1
    assert allocator.mapped() == {"weights": [True], "kv_cache": [False, False]}
    assert eng.awake_tags == {"weights"}


def test_wake_if_room_with_the_weights_awake_does_nothing(allocator):
    """After a level-0 sleep the weights never left: True, whatever the free memory, with
    nothing asked of vLLM and torch's cache untouched."""
    eng = engine_on(allocator)
    eng.sleep(level=0)
    allocator.free_bytes = 0
    calls = list(eng._llm.calls)
    assert eng.wake_if_room(["weights"]) is True
    assert eng._llm.calls == calls
    assert allocator.mapped() == {"weights": [True], "kv_cache": [False, False]}
    assert eng.awake_tags == {"weights"} and allocator.released == 0


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_after_the_weights_woke_alone_wakes_the_kv_cache_first(allocator, level):
    """The weights woke during the update (`wake_if_room`), the KV cache still asleep; a
    sleep then (vLLM's, which unmaps every allocation from fully awake) maps it back first."""
    eng = engine_on(allocator)
    eng.sleep(level=2)
    assert eng.wake_if_room(["weights"])
    eng._llm.calls.clear()
    eng.sleep(level=level)
    assert eng._llm.calls[-2:] == ["wake_up:kv_cache", f"sleep{level}"], eng._llm.calls
    assert allocator.mapped() == {"weights": [False], "kv_cache": [False, False]}
    assert eng.awake_tags == frozenset()
