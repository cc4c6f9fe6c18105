"""The vLLM engine's weight-sync target: where resharded rows go in vLLM's parameters.

Where vLLM keeps checkpoint-format parameters (the GPU build; unquantized CUDA layers are
not post-processed) rows are written straight into them. Where it repacks weights after
loading (the CPU build), each parameter is assembled in a buffer and handed, already
sharded, to vLLM's layerwise reload, which re-runs the layer's post-processing once the
layer is complete. Which parameters vLLM repacked is found when the target is built
(`repacked.py`): with any, `auto` takes the reload too and `direct` is refused. Its
parameter layout is `specs.vllm_specs`.

Where vLLM generates with FP8 weights (`rollout.quantization: fp8`, GPUs only), each
linear layer holds a float8 `weight` and its float32 `weight_scale_inv` (one per 128x128
block) instead of the checkpoint's bf16 weight: such a parameter is assembled in a
staging buffer of the trainer's dtype, then quantized into both on its device
(`resharding/fp8.py`), one parameter's buffer at a time. Those two are this target's to
write, so the repack check leaves them out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from rl_megatron.models.hf_config import HFModelInfo, parse_hf_config
from rl_megatron.resharding.fp8 import FP8_DTYPE, block_scale_shape, quantize_blockwise_
from rl_megatron.resharding.layouts import GenerationLayout
from rl_megatron.resharding.shards import check_tensors
from rl_megatron.resharding.sources import ParameterOwners
from rl_megatron.resharding.targets import ReshardTarget, config_mismatch
from rl_megatron.rollout.vllm.repacked import refusal, repacked_parameters
from rl_megatron.rollout.vllm.specs import vllm_specs

logger = logging.getLogger(__name__)


def _rpc_model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.model


FP8_SCALE = "weight_scale_inv"  # vLLM's name for a block-quantized weight's scales


def fp8_weights(table: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], list[str]]:
    """vLLM's FP8 weights: (weight name -> its scales' name, one line per problem).

    A problem is a layout the quantizer does not fill: scales missing, not float32 or not
    one per 128x128 block of the `[out, in]` weight (vLLM repacked them for a kernel:
    transposed, padded, or e8m0 scales on Blackwell's DeepGEMM). The sync refuses it.
    """
    pairs, problems = {}, []
    for name, weight in table.items():
        if weight.dtype != FP8_DTYPE:
            continue
        scale_name = name.removesuffix("weight") + FP8_SCALE
        scale = table.get(scale_name)
        want = block_scale_shape(tuple(weight.shape)) if weight.dim() == 2 else None
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            have = None if scale is None else (tuple(scale.shape), scale.dtype)
            problems.append(
                f"vLLM fp8 weight '{name}' {tuple(weight.shape)} has scales {have}, not "
                f"float32 {want} (one per 128x128 block): a layout the sync cannot fill; "
                "use rollout.quantization=null"
            )
        pairs[name] = scale_name
    return pairs, problems


def _plain_tensor_reads() -> Any:
    """A context in which vLLM's parameters read as plain tensors.

    vLLM's parameter classes (`BasevLLMParameter`) define `__torch_function__` in Python,
    so every shape or `.data` read of one runs Python: ~1.5 µs a read where a plain
    tensor's is ~0.1 µs, twice per parameter per sync (~0.25 ms of a 99-tensor sync on a
    CPU; on the H200 host, 128 such calls per sync,
    benchmarks/runs/2026-12-02-h200-run13-sync-after-graphs.md). Their override only
    forwards to torch's; with subclass overrides disabled the reads are torch's own, and
    `.data` is a plain tensor of the same storage either way.
    """
    return torch._C.DisableTorchFunctionSubclass()


class VllmEngineTarget(ReshardTarget):
    """vLLM in the trainer's processes (`VllmEngine`), built by the engine itself."""

    shard_specs = staticmethod(vllm_specs)

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.layout = GenerationLayout(tp=engine.args.tp, world_size=engine.layout.world_size)
        # In-process (`external_launcher`): the RPC returns the model object itself.
        self.model: torch.nn.Module = engine.llm.collective_rpc(_rpc_model)[0]
        reload = engine.args.weight_reload
        from vllm.platforms import current_platform

        self.layerwise = current_platform.is_cpu() if reload == "auto" else reload == "layerwise"
        # FP8 weights are quantized once their last rows landed: the copy program then
        # reports each parameter as it completes (no kept views, no copy graph).
        has_fp8 = any(p.dtype == FP8_DTYPE for p in self.model.parameters())
        if not self.layerwise:
            self._check_in_place(reload, current_platform.device_type)
        if has_fp8:
            self._fp8_dtype = engine.llm.llm_engine.model_config.dtype  # the trainer's
        self.buffers_params = self.layerwise or has_fp8
        self._names: set[str] = set()
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: dict[torch.nn.Module, int] = {}  # bytes vLLM still holds per module
        self._swapped: list[tuple[torch.Tensor, Any]] = []  # (meta parameter, its loader)
        self._live = self._peak = 0
        # vLLM's parameter table, checked at the start of every sync (`padded_vocab`, the
        # first thing a sync's agreement asks a target) and read again only when vLLM
        # replaced a parameter object (its layerwise reload does; writes in place do not):
        # never written through a stale table, and no module-tree walk per sync.
        self._table: dict[str, torch.nn.Parameter] = {}
        self._planned: dict[str, torch.nn.Parameter] = {}  # the table less fp8 scales
        self._fp8: dict[str, str] = {}  # fp8 weight -> its scales (`fp8_weights`)
        self._fp8_problems: list[str] = []
        self._owners: ParameterOwners | None = None
        # The engine's model config and parallel settings never change for its life:
        # checked once per trainer model info.
        self._config_checked: tuple[HFModelInfo, list[str]] | None = None

    def _check_in_place(self, reload: str, platform: str) -> None:
        """Before the first sync: parameters vLLM repacked after loading (`repacked.py`)
        cannot be written in place. With `auto` every update then goes through vLLM's
        layerwise reload, which re-runs the processing; `direct` is refused in one line."""
        with _plain_tensor_reads():
            fp8, _ = fp8_weights(dict(self.model.named_parameters()))
        written_here = set(fp8) | set(fp8.values())  # quantized by this target, not vLLM
        found = [r for r in repacked_parameters(self.model, platform) if r.name not in written_here]
        if not found:
            return
        quantization = self.engine.llm.llm_engine.model_config.quantization
        if reload == "direct":
            raise ValueError(refusal(found, quantization))
        why = refusal(found, quantization)
        self.engine.use_layerwise_reload(why)
        # Slower than writing in place (each layer re-processed): say so once, at build.
        logger.warning("vLLM weight sync through the layerwise reload: %s", why)
        self.layerwise = self.buffers_params = True

    # ---- shapes ----------------------------------------------------------------

    def _refresh_table(self) -> None:
        """Read vLLM's parameter table again if a parameter object changed since."""
        if self._owners is None or not self._owners.still_owned():
            self._table = dict(self.model.named_parameters())
            self._owners = ParameterOwners(self.model)
            with _plain_tensor_reads():
                self._fp8, self._fp8_problems = fp8_weights(self._table)
            scales = set(self._fp8.values())
            self._planned = {n: p for n, p in self._table.items() if n not in scales}

    def _shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """vLLM parameter → (checkpoint-format shard shape, dtype)."""
        params = self._planned
        if not self.layerwise:
            return {name: (tuple(p.shape), p.dtype) for name, p in params.items()}
        # Repacked weights lost their shape; vLLM recorded the checkpoint format.
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        out = {}
        for name, param in params.items():
            module_name, _, leaf = name.rpartition(".")
            meta = get_layerwise_info(self.model.get_submodule(module_name)).restore_metadata
            recorded = meta[0].get(leaf, param)  # a bias is never moved to meta
            out[name] = (tuple(recorded.shape), recorded.dtype)
        return out

    def padded_vocab(self) -> int:
        self._refresh_table()  # a new sync
        name = "model.embed_tokens.weight"
        if not self.layerwise:
            with _plain_tensor_reads():
                return self._table[name].shape[0] * self.layout.tp
        return self._shapes()[name][0][0] * self.layout.tp

    def check(self, shapes: Mapping[str, tuple[int, ...]], info: HFModelInfo) -> list[str]:
        problems = self._config_problems(info)
        if self.layerwise:
            tensors: dict[str, Any] = {name: shape for name, (shape, _) in self._shapes().items()}
            return problems + check_tensors(shapes, tensors, "vLLM")
        problems += self._fp8_problems
        with _plain_tensor_reads():
            return problems + check_tensors(shapes, self._planned, "vLLM")

    def _config_problems(self, info: HFModelInfo) -> list[str]:
        """The engine's config against the trainer's (both fixed: compared once per info)."""
        if self._config_checked is None or self._config_checked[0] is not info:
            hf = self.engine.llm.llm_engine.model_config.hf_config
            problems = config_mismatch(info, parse_hf_config(hf.to_dict()), "vLLM")
            parallel = self.engine.llm.llm_engine.vllm_config.parallel_config
            if info.num_experts and getattr(parallel, "enable_expert_parallel", False):
                # Its experts would be split over ranks, not each expert over TP
                # (`specs.vllm_specs`).
                problems.append(
                    "vLLM runs with enable_expert_parallel (rollout.engine_kwargs), which "
                    "resharding does not describe; leave it off"
                )
            self._config_checked = (info, problems)
        return list(self._config_checked[1])

    # ---- update ----------------------------------------------------------------

    def begin(self, version: int) -> None:
        self._names, self._buffers, self._pending, self._swapped = set(), {}, {}, []
        self._live = self._peak = 0
        # On the CPU build this also puts every layer into vLLM's layerwise reload, which
        # moves its parameters to the meta device (new objects): the table follows.
        self.engine.begin_weight_update(version)
        if self.layerwise:
            self._refresh_table()

    def writable(self, name: str) -> torch.Tensor:
        self._names.add(name)
        if name in self._fp8:
            return self._staging(name, self._table[name], self._fp8_dtype)
        if not self.layerwise:
            with _plain_tensor_reads():
                return self._table[name].data
        meta = self._table[name]  # on the meta device during a layerwise reload
        return self._staging(name, meta, meta.dtype, device="cpu")

    def _staging(
        self, name: str, param: torch.Tensor, dtype: torch.dtype, device: Any = None
    ) -> torch.Tensor:
        """The buffer parameter `name` is assembled in (its checkpoint shape), made once."""
        buf = self._buffers.get(name)
        if buf is None:
            with _plain_tensor_reads():
                shape, where = param.shape, param.device if device is None else device
            buf = torch.empty(shape, dtype=dtype, device=where)
            self._buffers[name] = buf
            self._live += buf.nbytes
            self._peak = max(self._peak, self._live)
        return buf

    def param_done(self, name: str) -> None:
        if name in self._fp8:
            buf = self._buffers.pop(name)
            with _plain_tensor_reads():
                weight, scale = self._table[name].data, self._table[self._fp8[name]].data
            quantize_blockwise_(buf, weight, scale, name)
            self._live -= buf.nbytes
            self._names.add(self._fp8[name])  # its scales are written too
        elif self.layerwise:
            self._load_sharded(name, self._buffers.pop(name))

    def _load_sharded(self, name: str, shard: torch.Tensor) -> None:
        """Hand vLLM's layerwise reload one finished, already sharded parameter.

        The reload wraps each parameter's weight loader so that a layer is materialised,
        loaded and post-processed (repacked) once all its tensors arrived. Its own loaders
        would slice our shard as if it were the full HF tensor, so this parameter's loader
        is re-wrapped around `default_weight_loader` (a shape-checked copy) for this
        update; `finish` / `abort` put the previous loader back.
        """
        from vllm.model_executor.model_loader.reload.layerwise import (
            get_layerwise_info,
            make_online_process_loader,
        )
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        module_name, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        param = getattr(module, leaf)
        # The meta parameter is vLLM's recorded metadata itself: put its loader back
        # after the reload (`_restore_loaders`), or later HF-named updates would copy.
        self._swapped.append((param, param.weight_loader))
        param.weight_loader = default_weight_loader
        param.weight_loader = make_online_process_loader(module, leaf)
        self._pending[module] = self._pending.get(module, 0) + shard.nbytes
        param.weight_loader(param, shard)
        if not get_layerwise_info(module).can_load():  # processed: vLLM let go of the shards
            self._live -= self._pending.pop(module)

    def finish(self) -> None:
        # The engine checks that every parameter was loaded; ours were written directly.
        self.engine._loaded |= self._names
        try:
            # On the CPU build this processes the layers still waiting (vLLM's finalize).
            self.engine.finish_weight_update()
        finally:
            self._restore_loaders()
        self._live = 0

    def abort(self, why: str) -> None:
        self._buffers.clear()
        self._restore_loaders()
        self.engine._mark_failed(why)  # generate refuses a partial update from here on

    def _restore_loaders(self) -> None:
        for param, loader in self._swapped:
            param.weight_loader = loader
        self._swapped = []

    def staging_peak_bytes(self) -> int:
        return self._peak
