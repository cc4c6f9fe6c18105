"""`ParallelLayout`: the degrees from the config, their checks, and the rank arithmetic."""

from __future__ import annotations

import pytest

from rl_megatron.config import ConfigError, ParallelConfig
from rl_megatron.parallel import ParallelLayout


def test_from_config_derives_dp_and_sizes():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2, pp=2, vpp=2), world_size=8)
    assert (layout.tp, layout.pp, layout.dp, layout.vpp) == (2, 2, 2, 2)
    assert layout.world_size == 8 and layout.replica_size == 4
    assert layout.model_parallel_size == 4 and layout.grad_dp == 2
    assert layout.expert_tp == 2  # megatron-core's default: the dense tp


def test_coordinates_follow_tp_cp_ep_pp_dp_order():
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    # tp fastest, then pp, then dp: each replica is a block of consecutive ranks.
    assert [layout.coordinates(r) for r in (0, 1, 2, 5, 7)] == [
        {"tp": 0, "cp": 0, "pp": 0, "dp": 0},
        {"tp": 1, "cp": 0, "pp": 0, "dp": 0},
        {"tp": 0, "cp": 0, "pp": 1, "dp": 0},
        {"tp": 1, "cp": 0, "pp": 0, "dp": 1},
        {"tp": 1, "cp": 0, "pp": 1, "dp": 1},
    ]
    assert layout.replica_ranks(1) == [4, 5, 6, 7]
    for rank in range(8):
        assert rank in layout.replica_ranks(layout.coordinates(rank)["dp"])


def test_context_parallel_layout():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2, cp=2), world_size=8)
    assert (layout.dp, layout.replica_size, layout.grad_dp, layout.sequence_divisor) == (
        2,
        4,
        4,
        4,
    )
    assert layout.coordinates(6) == {"tp": 0, "cp": 1, "pp": 0, "dp": 1}
    assert layout.replica_ranks(1) == [4, 5, 6, 7]


def test_sequence_divisor():
    assert ParallelLayout(tp=4, pp=1, dp=1).cp_chunks == 1
    assert ParallelLayout(tp=1, pp=1, dp=1, cp=3).cp_chunks == 6
    assert ParallelLayout(tp=4, pp=1, dp=1).sequence_divisor == 1
    assert ParallelLayout(tp=4, pp=1, dp=1, sequence_parallel=True).sequence_divisor == 4
    assert ParallelLayout(tp=2, pp=1, dp=1, cp=2, sequence_parallel=True).sequence_divisor == 8


@pytest.mark.parametrize(
    "fields, world, message",
    [
        ({"tp": 0}, 4, "parallel.tp: must be >= 1, got 0"),
        ({"tp": 3}, 4, "parallel: world size 4 is not divisible by tp·pp·cp = 3·1·1"),
        ({"cp": 0}, 4, "parallel.cp: must be >= 1, got 0"),
        ({"cp": 3}, 4, "parallel: world size 4 is not divisible by tp·pp·cp = 1·1·3"),
        ({"ep": 2}, 4, "parallel.ep: splits the experts of an MoE model; this model has none"),
        ({"etp": 2}, 4, "parallel.etp: splits the experts of an MoE model; this model has none"),
        ({"etp": 0}, 4, "parallel.etp: must be >= 1"),
        ({"pp": 1, "vpp": 2}, 4, "parallel.vpp: interleaved pipelining needs parallel.pp >= 2"),
        ({"tp": 1, "sequence_parallel": True}, 4, "parallel.sequence_parallel: needs"),
    ],
)
def test_bad_degrees_are_one_line_naming_the_key(fields, world, message):
    with pytest.raises(ConfigError) as raised:
        ParallelLayout.from_config(ParallelConfig(**fields), world_size=world)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "fields, world, message",
    [
        ({"ep": 3}, 4, "parallel.ep: world size 4 is not divisible by etp·ep·pp = 1·3·1"),
        ({"pp": 2, "ep": 2}, 4, "parallel.ep: with parallel.pp=2 > 1 megatron-core needs etp·ep = tp·cp"),
        ({"tp": 2, "pp": 2, "ep": 2, "etp": 2}, 8, "parallel.ep: with parallel.pp=2 > 1"),
    ],
)  # fmt: skip
def test_expert_degrees_megatron_core_refuses_are_one_line(fields, world, message):
    with pytest.raises(ConfigError) as err:
        ParallelLayout.from_config(ParallelConfig(**fields), world_size=world, moe=True)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_expert_layouts_megatron_core_accepts():
    # EP over the DP ranks; EP inside TP with pipelining (etp·ep = tp); ETP.
    for fields, world, coords in [
        ({"ep": 2}, 2, {1: {"etp": 0, "ep": 1, "edp": 0}}),
        ({"tp": 2, "pp": 2, "ep": 2}, 4, {3: {"etp": 0, "ep": 1, "edp": 0}}),
        ({"tp": 2, "ep": 2, "etp": 2}, 4, {3: {"etp": 1, "ep": 1, "edp": 0}}),
    ]:
        layout = ParallelLayout.from_config(ParallelConfig(**fields), world_size=world, moe=True)
        assert layout.expert_tp == fields.get("etp", 1)
        for rank, want in coords.items():
            assert layout.expert_coordinates(rank) == want
    dense = ParallelLayout.from_config(ParallelConfig(tp=2, pp=2), world_size=4)
    assert dense.etp is None and dense.expert_tp == 2  # megatron-core's default, unused


def test_pipeline_stages_of_virtual_chunks():
    """First / last stage of a chunk: pp rank 0's chunk 0, the last pp rank's last chunk
    (what megatron-core's is_pipeline_first/last_stage answer for a vp_stage)."""
    layout = ParallelLayout(tp=2, pp=2, dp=1, vpp=2)
    # ranks 0, 1: pp rank 0; ranks 2, 3: pp rank 1.
    assert [layout.is_first_stage(r, 0) for r in range(4)] == [True, True, False, False]
    assert [layout.is_first_stage(r, 1) for r in range(4)] == [False] * 4
    assert [layout.is_last_stage(r, 1) for r in range(4)] == [False, False, True, True]
    assert [layout.is_last_stage(r, 0) for r in range(4)] == [False] * 4
    plain = ParallelLayout(tp=1, pp=2, dp=1)
    assert (plain.is_first_stage(0), plain.is_last_stage(0)) == (True, False)
    assert (plain.is_first_stage(1), plain.is_last_stage(1)) == (False, True)


def test_record_and_launch_line_name_every_degree():
    dense = ParallelLayout.from_config(ParallelConfig(tp=2, pp=2, vpp=2), world_size=8)
    assert dense.record() == {
        "world_size": 8, "tp": 2, "pp": 2, "vpp": 2, "dp": 2, "cp": 1, "ep": 1, "etp": 2,
        "sequence_parallel": False,
    }  # fmt: skip
    # A dense model's etp is megatron-core's default (tp·cp), never None.
    assert dense.describe() == "tp=2 pp=2 dp=2 cp=1 ep=1 etp=2 vpp=2 sp=off"
    moe = ParallelLayout.from_config(
        ParallelConfig(tp=2, ep=2, etp=1, sequence_parallel=True), world_size=4, moe=True
    )
    assert moe.describe() == "tp=2 pp=1 dp=2 cp=1 ep=2 etp=1 vpp=None sp=on"
    assert moe.record()["ep"] == 2 and moe.record()["sequence_parallel"] is True
