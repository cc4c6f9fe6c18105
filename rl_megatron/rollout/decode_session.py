"""The Megatron engine's decode state: KV cache, step buffers and per-position CUDA graphs.

The KV cache and the decode step's input buffers live in a `DecodeSession` kept from one
call to the next while the shape (rows, prompt width P, new tokens) stays the same; P is
rounded up to a multiple of `PROMPT_WIDTH_STEP` so that prompts of slightly different
lengths share it. On a GPU, each decode position gets a CUDA graph of the whole model
forward the first time it is decoded (that call runs eagerly, which is the warm-up
capture needs); later calls replay it, one launch per token instead of a few hundred
kernels issued from Python, which is what bounds batch decoding of a small model (on the
H200: 2.4k → 13.7k tokens/s at batch 64 for the 0.85B shape). A graph bakes in the
addresses of the parameters, the cache and the buffers: the session drops its graphs
when any parameter's storage moved (offload and reload). Captures stop at a memory budget
(`GRAPH_MEMORY_FRACTION`, shared by the sessions the engine keeps: it sets each session's
`graph_budget` to what the others' graphs left); the engine turns graphs off at TP > 1, with
expert parallelism, when it records the MoE routing (whose hooks a replay would skip) and
under `rollout.enforce_eager`.
"""

from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from rl_megatron.models.sdpa_attention import causal_padding_mask

# Prompt widths are rounded up to this, so one decode session (and its graphs) serves
# batches whose longest prompt differs by a few tokens.
PROMPT_WIDTH_STEP = 16
# Device memory the decode graphs of all kept sessions may hold, as a fraction of the GPU's. Each
# position's graph keeps its attention temporaries, which grow with the position, so a
# graph pool cannot reuse one position's blocks for the next: on the H200, 16 layers of
# 32 full (non-GQA) heads at 128 rows held 54 GB after ~250 positions. Past the budget
# the remaining positions decode eagerly.
GRAPH_MEMORY_FRACTION = 0.08
# Decode sessions an engine keeps between calls: training's and evaluation's. Each holds a
# KV cache of rows × (prompt width + new tokens) positions; their graphs share one budget.
MAX_SESSIONS = 2

Shape = tuple[int, int, int]  # (rows, prompt width, new tokens) of a decode session


def graph_budget(device: torch.device) -> int:
    """Bytes the decode graphs of all sessions on `device` may hold (0 off a GPU)."""
    if device.type != "cuda":
        return 0
    return int(GRAPH_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory)


class DecodeSession:
    """The KV cache, static decode inputs and per-position CUDA graphs of one shape.

    Decode step k (absolute position `prompt_width + k`) reads `tokens`, `positions` and
    `keep` and writes `logits` in place, so a graph captured once replays for any batch
    of this shape. The cache is megatron-core's `StaticInferenceContext` (one
    `[P + R, rows, ...]` key and value buffer per layer, allocated by the first prefill).
    """

    def __init__(self, forward, rows: int, prompt_width: int, max_new: int, vocab: int,
                 device: torch.device, use_graphs: bool) -> None:  # fmt: skip
        from megatron.core.inference.contexts import StaticInferenceContext

        self.forward = forward
        self.shape = (rows, prompt_width, max_new)
        self.prompt_width = prompt_width
        self.ctx = StaticInferenceContext(rows, prompt_width + max_new)
        self.tokens = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        self.keep = torch.zeros(rows, prompt_width + max_new, dtype=torch.bool, device=device)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graph_bytes = 0  # reserved by the captures so far
        # This session's share of the graph budget; the engine sets it before each use.
        self.graph_budget = graph_budget(device) if self.use_graphs else 0
        self.param_ptrs: list[int] = []

    @property
    def nbytes(self) -> int:
        """Device memory held: the KV cache (allocated by the first prefill), the step's
        buffers and the graph pool's growth."""
        tensors = [self.tokens, self.positions, self.keep, self.logits]
        tensors += [t for kv in self.ctx.key_value_memory_dict.values() for t in kv]
        return sum(t.numel() * t.element_size() for t in tensors) + self.graph_bytes

    def check_parameters(self, model: torch.nn.Module) -> None:
        """Drop the graphs if a parameter's storage moved since they were captured."""
        ptrs = [param.data_ptr() for param in model.parameters()]
        if ptrs != self.param_ptrs:
            self.graphs.clear()
            self.param_ptrs = ptrs

    def prefill(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Forward the left-padded prompt block `[rows, P]`; last-position logits."""
        p = self.prompt_width
        self.ctx.sequence_len_offset = 0
        self.ctx.enable_prefill_mode()
        self.keep.zero_()
        self.keep[:, :p] = keep
        position_ids = (keep.long().cumsum(1) - 1).clamp(min=0)
        logits = self.forward(tokens, position_ids, causal_padding_mask(keep), self.ctx)
        self.ctx.enable_decode_mode()
        return logits

    def decode(self, step: int) -> torch.Tensor:
        """Logits after feeding `tokens` at position P + step (inputs already in place)."""
        graph = self.graphs.get(step)
        if graph is not None:
            graph.replay()
            return self.logits
        self._step(step)
        if self.use_graphs:
            self._capture(step)
        return self.logits

    def _step(self, step: int) -> None:
        end = self.prompt_width + step + 1
        self.ctx.sequence_len_offset = end - 1
        mask = ~self.keep[:, None, None, :end]
        self.logits.copy_(self.forward(self.tokens, self.positions, mask, self.ctx))

    def _capture(self, step: int) -> None:
        if self.graph_bytes > self.graph_budget:
            return  # this position decodes eagerly (see GRAPH_MEMORY_FRACTION)
        # torch.cuda.graph empties the caching allocator on entry; doing it first makes the
        # difference below the graph pool's growth alone. (Measured without it, the freed
        # warm-up temporaries cancelled the growth: the budget never tripped, and the graphs
        # of the half-depth 7B shape held 54 GB:
        # benchmarks/runs/2026-11-30-h200x2-run04-vllm-in-trainer-pp2.md.)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        # The eager step just run was the warm-up (kernels chosen, workspaces allocated).
        # Capturing records kernels without running them, so the cache is untouched.
        graph = torch.cuda.CUDAGraph()
        # No cyclic garbage collection inside the capture: a collection there may free an
        # unreachable older session, whose graphs' teardown is not permitted while a stream
        # captures ("operation not permitted when stream is capturing (function reset)",
        # seen in the GPU test, which builds several engines). torch.cuda.graph collects on
        # entry, so nothing accumulates.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._step(step)
        except RuntimeError as exc:
            self.use_graphs = False
            self.graphs.clear()
            warnings.warn(f"megatron rollout engine: CUDA graph capture failed ({exc}); "
                          f"decoding eagerly", stacklevel=2)  # fmt: skip
            return
        finally:
            if collecting:
                gc.enable()
        self.graphs[step] = graph
        self.graph_bytes += max(0, torch.cuda.memory_reserved() - reserved)


class DecodeSessions:
    """The sessions an engine keeps, least recently used first, at most `MAX_SESSIONS`;
    their graphs share one budget (`GRAPH_MEMORY_FRACTION` of the device).

    `sessions[shape]`, `shape in sessions` and iteration (oldest first) read them.
    """

    def __init__(self, forward: Callable, vocab: int, device: torch.device,
                 use_graphs: bool) -> None:  # fmt: skip
        self.forward, self.vocab, self.device, self.use_graphs = forward, vocab, device, use_graphs
        self._kept: OrderedDict[Shape, DecodeSession] = OrderedDict()
        self._graph_budget = graph_budget(device) if use_graphs else 0

    def __getitem__(self, shape: Shape) -> DecodeSession:
        return self._kept[shape]

    def __contains__(self, shape: object) -> bool:
        return shape in self._kept

    def __iter__(self) -> Iterator[Shape]:
        return iter(self._kept)

    @property
    def nbytes(self) -> int:
        """Device memory the kept sessions hold (KV caches, buffers, graph pools)."""
        return sum(session.nbytes for session in self._kept.values())

    def width(self, rows: int, width: int, max_new: int) -> int:
        """The prompt width to decode at: that of the most recently used kept session of
        these rows and new tokens that is at least `width` and at most twice it (its graphs
        are reused; the extra left-padding costs prefill only), else `width`."""
        for b, p, r in reversed(self._kept):
            if b == rows and r == max_new and width <= p <= 2 * width:
                return p
        return width

    def get(self, rows: int, prompt_width: int, max_new: int,
            model: torch.nn.Module) -> DecodeSession:  # fmt: skip
        """The kept session of this shape (now the most recently used), else a new one in
        place of the least recently used; its graphs dropped if `model`'s parameters moved."""
        shape = (rows, prompt_width, max_new)
        session = self._kept.pop(shape, None)
        if session is None:
            while len(self._kept) >= MAX_SESSIONS:
                self._kept.popitem(last=False)  # freed before the new one allocates
            session = DecodeSession(
                self.forward, rows, prompt_width, max_new, self.vocab, self.device,
                self.use_graphs,
            )  # fmt: skip
        self._kept[shape] = session
        # One graph budget for all sessions: what the others' graphs hold is spent.
        others = sum(s.graph_bytes for s in self._kept.values() if s is not session)
        session.graph_budget = self._graph_budget - others
        session.check_parameters(model)
        return session
