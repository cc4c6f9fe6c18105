"""Parameters vLLM repacks after loading (`rollout/vllm/repacked.py`), found before the
first sync, and what the in-place sync target does with them (`VllmEngineTarget`).

A tiny module tree with vLLM's real quant-method objects stands in for the engine's model
(the CPU build is installed; no engine is started). A layer whose post-processing was
replaced by one that writes its (square) weight back transposed — a repack no shape,
stride or dtype comparison can see — must be found on any platform; on the CPU platform
vLLM's own unquantized methods pack every linear layer; a quantized method is found by its
class; a weight whose dtype changed after vLLM recorded it is found by vLLM's record. The
target then refuses `direct` in one line naming the parameter, and with `auto` puts the
engine's updates through vLLM's layerwise reload (which re-runs the processing).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (the CPU build)")

from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    UnquantizedEmbeddingMethod,
)

from rl_megatron.rollout.vllm import target as target_module  # noqa: E402
from rl_megatron.rollout.vllm.repacked import refusal, repacked_parameters  # noqa: E402


class Fp8LinearMethod:  # named like vLLM's: a quantized layer's method, by its class
    pass


def layer(method, *shapes: tuple[int, ...]) -> torch.nn.Module:
    m = torch.nn.Module()
    for leaf, shape in zip(("weight", "bias"), shapes, strict=False):
        m.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape), requires_grad=False))
    if method is not None:
        m.quant_method = method
    return m


def tiny_model(o_proj_method=None) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = layer(UnquantizedEmbeddingMethod(), (16, 4))
    model.qkv_proj = layer(UnquantizedLinearMethod(), (12, 4), (12,))
    model.o_proj = layer(o_proj_method or UnquantizedLinearMethod(), (4, 4))
    model.norm = layer(None, (4,))
    return model


def transposed_after_loading(method):
    """`method` whose post-processing writes the weight back transposed (same shape)."""

    def process_weights_after_loading(module):
        module.weight.data = module.weight.data.t().contiguous()

    method.process_weights_after_loading = process_weights_after_loading
    return method


def names(found) -> list[str]:
    return [r.name for r in found]


def test_a_replaced_post_processing_is_found_on_any_platform():
    assert repacked_parameters(tiny_model(), "cuda") == []
    model = tiny_model(transposed_after_loading(UnquantizedLinearMethod()))
    model.o_proj.quant_method.process_weights_after_loading(model.o_proj)  # vLLM's load
    (found,) = repacked_parameters(model, "cuda")
    assert found.name == "o_proj.weight" and found.storage
    assert "UnquantizedLinearMethod's process_weights_after_loading was replaced" in found.why


def test_the_cpu_platform_packs_linear_layers_and_keeps_embeddings_beside_a_copy():
    found = {r.name: r for r in repacked_parameters(tiny_model(), "cpu")}
    assert set(found) == {"embed_tokens.weight", "qkv_proj.weight", "qkv_proj.bias",
                          "o_proj.weight"}  # fmt: skip
    assert found["qkv_proj.weight"].storage and not found["embed_tokens.weight"].storage


def test_a_quantized_method_and_a_changed_dtype_are_found():
    model = tiny_model(Fp8LinearMethod())
    assert names(repacked_parameters(model, "cuda")) == ["o_proj.weight"]
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    model = tiny_model()
    record_metadata_for_reloading(model)  # what vLLM records before processing
    model.qkv_proj.weight.data = model.qkv_proj.weight.data.to(torch.bfloat16)
    (found,) = repacked_parameters(model, "cuda")
    assert found.name == "qkv_proj.weight"
    assert "(12, 4) torch.float32 became (12, 4) torch.bfloat16" in found.why


def test_a_weight_reordered_in_its_own_shape_and_dtype_is_found():
    # A square weight left as a transposed view: same shape and dtype, other strides.
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    model = tiny_model()
    record_metadata_for_reloading(model)
    model.o_proj.weight.data = model.o_proj.weight.data.t()
    (found,) = repacked_parameters(model, "cuda")
    assert found.name == "o_proj.weight" and found.storage


class FakeEngine:
    """What `VllmEngineTarget` reads of a `VllmEngine` before the first sync."""

    def __init__(self, model: torch.nn.Module, weight_reload: str) -> None:
        self.args = SimpleNamespace(tp=1, weight_reload=weight_reload)
        self.layout = SimpleNamespace(world_size=1)
        config = SimpleNamespace(model_config=SimpleNamespace(quantization=None))
        self.llm = SimpleNamespace(collective_rpc=lambda fn: [model], llm_engine=config)
        self.layerwise_because: str | None = None

    def use_layerwise_reload(self, why: str) -> None:
        self.layerwise_because = why


@pytest.fixture
def on_a_gpu(monkeypatch):
    """vLLM's platform as on a GPU, where `auto` writes in place."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(current_platform, "device_type", "cuda")


def test_the_in_place_target_refuses_direct_and_falls_back_to_the_reload_with_auto(on_a_gpu):
    def repacked_model():
        model = tiny_model(transposed_after_loading(UnquantizedLinearMethod()))
        model.o_proj.quant_method.process_weights_after_loading(model.o_proj)
        return model

    with pytest.raises(ValueError) as err:
        target_module.VllmEngineTarget(FakeEngine(repacked_model(), "direct"))
    assert str(err.value) == (
        "vLLM parameter o_proj.weight is not kept in the checkpoint format after loading "
        "(its UnquantizedLinearMethod's process_weights_after_loading was replaced): an "
        "in-place weight sync would write it wrongly; use weight_reload='layerwise' (vLLM's "
        "reload re-runs the processing) or 'auto'"
    )
    engine = FakeEngine(repacked_model(), "auto")
    target = target_module.VllmEngineTarget(engine)
    assert target.layerwise and target.buffers_params
    assert "o_proj.weight" in engine.layerwise_because
    engine = FakeEngine(tiny_model(), "auto")  # nothing repacked: written in place
    target = target_module.VllmEngineTarget(engine)
    assert not target.layerwise and engine.layerwise_because is None


def test_experts_are_in_place_on_triton_only():
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    class UnquantizedFusedMoEMethod:  # vLLM's class, by name, with the backend it chose
        def __init__(self, backend):
            self.unquantized_backend = backend

    def experts(backend) -> list[str]:
        model = torch.nn.Module()
        model.experts = layer(UnquantizedFusedMoEMethod(backend), (2, 8, 4))
        return [r.why for r in repacked_parameters(model, "cuda")]

    assert experts(UnquantizedMoeBackend.TRITON) == []
    assert experts(UnquantizedMoeBackend.FLASHINFER_CUTLASS) == [
        "UnquantizedFusedMoEMethod shuffles it for the FlashInfer CUTLASS kernels"
    ]
    assert experts(None) != []


def test_refusal_names_the_quantization_setting():
    model = tiny_model(Fp8LinearMethod())
    line = refusal(repacked_parameters(model, "cuda"), "fp8")
    assert "o_proj.weight" in line and "quantization='fp8'" in line
