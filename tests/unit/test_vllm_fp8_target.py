"""VllmEngineTarget's FP8 write path, on a stand-in engine whose parameters are the pairs
vLLM's `fp8_per_block` linear layers hold (a float8 `weight`, a float32
`weight_scale_inv` per 128x128 block) beside plain bf16 ones.

vLLM's CPU build cannot run an FP8 model here (DESIGN.md §7, "FP8 rollout"), so the
engine is a stand-in; the target, its staging and the quantizer are the real ones, driven
as a weight sync drives them (check, begin, writable, param_done, finish). The engine
must end up holding exactly the quantizer applied to the trainer's shards.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from rl_megatron.models.hf_config import parse_hf_config
from rl_megatron.resharding.fp8 import NonFiniteWeightError
from rl_megatron.rollout.vllm.target import VllmEngineTarget
from tests.unit.test_fp8_quantizer import reference_blockwise

FP8 = torch.float8_e4m3fn
QKV = "model.layers.0.self_attn.qkv_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
PLAIN = ("model.embed_tokens.weight", "model.norm.weight")


def fp8_linear(out: int, inp: int, scale_shape=None) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(out, inp, dtype=FP8), requires_grad=False)
    shape = scale_shape or (-(-out // 128), -(-inp // 128))
    layer.weight_scale_inv = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    return layer


def stand_in_engine(scale_shape=None):
    """An engine object with what the target reads of `VllmEngine`, and its model."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(64, 200, dtype=torch.bfloat16)
    model.model.norm = torch.nn.Module()
    model.model.norm.weight = torch.nn.Parameter(torch.zeros(200, dtype=torch.bfloat16))
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.self_attn.qkv_proj = fp8_linear(320, 200, scale_shape)  # ragged: 3 x 2 blocks
    layer.mlp.down_proj = fp8_linear(256, 130)
    model.model.layers = torch.nn.ModuleList([layer])
    hf = LlamaConfig(hidden_size=200, num_attention_heads=4, vocab_size=64, num_hidden_layers=1)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    events = []
    engine = SimpleNamespace(
        args=SimpleNamespace(tp=1, weight_reload="direct"),
        layout=SimpleNamespace(world_size=1),
        llm=SimpleNamespace(
            collective_rpc=lambda fn: [fn(worker)],
            llm_engine=SimpleNamespace(
                model_config=SimpleNamespace(dtype=torch.bfloat16, hf_config=hf),
                vllm_config=SimpleNamespace(parallel_config=SimpleNamespace()),
            ),
        ),
        begin_weight_update=lambda v: events.append(("begin", v)),
        finish_weight_update=lambda: events.append(("finish",)),
        _mark_failed=lambda why: events.append(("failed", why)),
        _loaded=set(),
    )
    return engine, model, parse_hf_config(hf.to_dict()), events


def trainer_shards(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(p.shape, generator=g) * 0.05).to(torch.bfloat16)
        for name, p in model.named_parameters()
        if not name.endswith("weight_scale_inv")
    }


def sync(target, shards, version=1):
    target.begin(version)
    for name, value in shards.items():
        target.writable(name).copy_(value)
        target.param_done(name)
    target.finish()


def test_sync_writes_the_quantized_trainer_weights_bit_for_bit():
    engine, model, info, events = stand_in_engine()
    target = VllmEngineTarget(engine)
    assert target.buffers_params  # quantized as each parameter completes
    assert target.padded_vocab() == 64
    shards = trainer_shards(model)
    # The plan knows checkpoint-format weights only; the scales are the target's business.
    assert target.check({n: tuple(v.shape) for n, v in shards.items()}, info) == []
    sync(target, shards)
    params = dict(model.named_parameters())
    for name in (QKV, DOWN):
        ref_q, ref_scale = reference_blockwise(shards[name])
        assert torch.equal(params[name].view(torch.uint8), ref_q.view(torch.uint8)), name
        scale = params[name.removesuffix("weight") + "weight_scale_inv"]
        assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), name
    for name in PLAIN:
        assert torch.equal(params[name], shards[name]), name
    # The engine counts every parameter as loaded, scales included (its completeness check).
    assert engine._loaded == set(params)
    assert events == [("begin", 1), ("finish",)]
    # One parameter staged at a time: the largest fp8 weight's bf16 bytes, no more.
    assert target.staging_peak_bytes() == 320 * 200 * 2
    # A second sync with other weights overwrites them all.
    shards2 = trainer_shards(model, seed=1)
    sync(target, shards2, version=2)
    ref_q, _ = reference_blockwise(shards2[DOWN])
    assert torch.equal(params[DOWN].view(torch.uint8), ref_q.view(torch.uint8))


def test_a_repacked_scale_layout_is_refused_naming_the_parameter():
    engine, model, info, _ = stand_in_engine(scale_shape=(2, 3))  # transposed scales
    target = VllmEngineTarget(engine)
    target.padded_vocab()
    shards = trainer_shards(model)
    problems = target.check({n: tuple(v.shape) for n, v in shards.items()}, info)
    assert len(problems) == 1 and QKV in problems[0] and "(3, 2)" in problems[0], problems
    assert "rollout.quantization=null" in problems[0]


def test_a_non_finite_trainer_weight_stops_the_sync_naming_it():
    engine, model, info, _ = stand_in_engine()
    target = VllmEngineTarget(engine)
    target.padded_vocab()
    shards = trainer_shards(model)
    shards[DOWN][7, 100] = float("nan")
    with pytest.raises(NonFiniteWeightError, match=DOWN):
        sync(target, shards)


def test_fp8_layers_vllm_processes_are_written_here_and_others_still_refused(monkeypatch):
    """vLLM's FP8 linear method processes its weight and scales after loading, so the
    repacked-layout check finds them; the target quantizes into them itself (their
    checkpoint format is what it writes), so they are not refused. Any other processed
    parameter still is."""
    from rl_megatron.rollout.vllm import target as target_module
    from rl_megatron.rollout.vllm.repacked import Repacked

    fp8_params = [QKV, QKV.removesuffix("weight") + "weight_scale_inv", DOWN]
    found = [Repacked(name, "Fp8LinearMethod's processing", True) for name in fp8_params]
    engine, *_ = stand_in_engine()
    engine.llm.llm_engine.model_config.quantization = "fp8"
    monkeypatch.setattr(target_module, "repacked_parameters", lambda model, platform: found)
    target = VllmEngineTarget(engine)  # weight_reload=direct: nothing refused
    assert not target.layerwise
    norm = Repacked("model.norm.weight", "a kernel's layout", True)
    monkeypatch.setattr(
        target_module, "repacked_parameters", lambda model, platform: [*found, norm]
    )
    with pytest.raises(ValueError, match=r"^vLLM parameter model\.norm\.weight is not kept"):
        VllmEngineTarget(engine)
