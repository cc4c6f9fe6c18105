"""Generation on the actor's own Megatron modules, with megatron-core's static KV cache.

The fallback where vLLM is not installed, and the numerical reference for parity. It runs
inside one training data-parallel replica: every rank of the tensor-parallel group passes
the same prompts and gets the same samples (logits are all-gathered over TP, and every TP
rank samples with the same seed). PP must be 1 (one model chunk, no VPP).

Batched decoding. Prompts are left-padded to a common width P and prefilled in one
forward with a causal + padding mask; each step then feeds one token per row and attends
to the cached keys of real tokens only. megatron-core's `StaticInferenceContext` applies
RoPE by column, so a left-padded row's positions are shifted by its padding; RoPE depends
only on the distance between query and key, so attention scores are unchanged.

Decode state and CUDA graphs: the KV cache, the decode step's buffers and one CUDA graph
per decode position live in a `DecodeSession` (`rollout/decode_session.py`). The engine's
`DecodeSessions` keep the `MAX_SESSIONS` most recently used ones, keyed by shape (rows, prompt width, new
tokens), so that an evaluation's batches do not evict training's session (and its graphs,
~7 s to capture again on an H200); a batch is left-padded into a kept session of the same
rows and new tokens up to twice as wide as it needs. The graphs of all kept sessions share
one memory budget. TP = 1 only.

Expert parallelism. An MoE layer exchanges tokens with an all-to-all over the expert group
(EP × ETP ranks), which spans training DP replicas that decode different prompts: every rank
of it must run the same number of model forwards per `generate` call, or the all-to-all
waits forever. So the ranks agree (all-reduce MAX over that group) once on the number of
decode batches, and before each decode step on whether any of them still decodes; a rank
with nothing (left) to decode joins each such forward with a one-token forward without a
cache, whose output it drops. The all-reduce replaces the per-step `done.all()` host sync
the loop already has, and a finished rank's stand-in forward is the cheapest forward there
is; decoding every batch to `max_new_tokens` instead would waste whole steps of every rank
whenever all rows stop early. The token counts may differ between ranks: the all-to-all
carries per-rank splits. A replica without prompts (an uneven evaluation share) must still
call `generate` (with an empty list): `needs_every_replica` tells the trainer so. With the
alltoall dispatcher's host-side splits, such forwards are not captured as CUDA graphs.

Routing replay. With `record_routing` (an MoE model; `actor.router_replay`) every row also
gets the experts each MoE layer's router chose for each token forwarded (`models/
router_replay.py`'s recorder on the routers' `router_replay` hook), in the vLLM engine's
format: `[n, L, k]` for the first n = prompt + response − 1 tokens (the last sampled token
is never forwarded), layers in model order. A row's prompt tokens come from the prefill
(the routers see `[P, rows]` sequence-first), response token t from decode step t. The
routing stays on the device until the batch ends (no host sync per step) and is copied
once; the hooks must run at every step, so the engine then decodes without CUDA graphs.
Forwards that only join the expert group's lockstep are not recorded.

Weights. The engine generates with the modules it was given, so when they are the actor's
own (same layout) a weight update is only a version stamp: `sync_from(actor_chunks, step)`
(`generates_with_trainer_modules`: the trainer keeps them on the device to generate).
HF-named tensors are accepted too (for tests and for a separate rollout copy); they are
buffered until `finish_weight_update` and then copied in through the family name table
(`checkpoint/hf_mapping.py`), so a bucketed update holds the full set once.

Sampling matches the vLLM engine with `logprobs_mode="processed_logprobs"`: temperature,
then top-k, then top-p; the log-prob returned is that of the sampled token under the
filtered, renormalised distribution (under plain `log_softmax(logits)` when greedy).
With a seed, row (i, j) draws one counter-based uniform per step from its own seed
`seed + i·n + j` and inverts its CDF (`sampling.sample_tokens`), for all rows at once; its
tokens therefore do not depend on which rows share its decode batch, nor on a per-prompt
cap (`prompt_max_new_tokens`: the row stops there, the batch decodes on for the others).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.checkpoint.hf_loader import iter_rule_params, unwrap
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.models.router_replay import moe_routers, record_routing
from rl_megatron.models.sdpa_attention import causal_padding_mask
from rl_megatron.parallel import ParallelGroups
from rl_megatron.rollout.batch import FinishReason, RolloutBatch
from rl_megatron.rollout.decode_session import PROMPT_WIDTH_STEP, DecodeSessions
from rl_megatron.rollout.engine import NamedTensors, OutputLayout, RolloutEngine, iter_named_tensors
from rl_megatron.rollout.sampling import SamplingParams, fit_prompts, sample_tokens, seed_tensor

logger = logging.getLogger(__name__)

# tokens, log-probs, finish reason, routing `[n, L, k]` (None: not recorded)
Sample = tuple[list[int], list[float], FinishReason, torch.Tensor | None]


class MegatronEngine(RolloutEngine):
    """Batched KV-cache generation on a Megatron `GPTModel` (TP-aware, PP = 1)."""

    generates_with_trainer_modules = True

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        info: HFModelInfo,
        *,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
        tp_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        max_batch_size: int = 64,
        pad_token_id: int = 0,
        use_cuda_graphs: bool = True,
        expert_group: dist.ProcessGroup | None = None,
        record_routing: bool = False,
    ) -> None:
        """Wrap this rank's model chunk.

        model_chunks: `[GPTModel]` (wrappers allowed); PP = 1 and no VPP.
        info: the HF config facts (vocabulary size, context length, name table).
        eos_token_ids: the model's EOS ids (default stop tokens).
        max_model_len: context length; None: `info.max_position_embeddings`.
        tp_group: the tensor-parallel group (None: the run's, `ParallelGroups.from_megatron`);
            used once, to check that its ranks share the seed (the model itself gathers the
            logits).
        seed: sampling seed; must be equal on the TP ranks of a replica (give DP replicas
            different seeds).
        max_batch_size: rows decoded together (sizes the KV cache: rows × context).
        use_cuda_graphs: on a GPU, replay one CUDA graph per decode position (see above).
        expert_group: an MoE model's expert group, whose ranks exchange tokens in every
            forward (None: the run's `ParallelGroups.expert_model`).
        record_routing: return every row's MoE routing (`RolloutBatch.routed_experts`, for
            routing replay); decodes without CUDA graphs.
        """
        super().__init__(weight_version=0)
        if len(model_chunks) != 1:
            raise ValueError(
                f"megatron rollout engine needs pp=1 without vpp (one model chunk), "
                f"got {len(model_chunks)} chunks"
            )
        self.model = unwrap(model_chunks[0])
        if not (self.model.pre_process and self.model.post_process):
            raise ValueError("megatron rollout engine needs the whole model on each rank (pp=1)")
        self.info = info
        self.vocab_size = info.vocab_size
        self.max_model_len = max_model_len or info.max_position_embeddings
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.seed = seed
        if tp_group is None or (expert_group is None and self.model.config.num_moe_experts):
            # The run's groups, read once (with context parallelism making them is collective).
            run_groups = ParallelGroups.from_megatron()
            tp_group = run_groups.tp if tp_group is None else tp_group
            expert_group = run_groups.expert_model if expert_group is None else expert_group
        self._tp_group = tp_group
        self._check_same_seed(tp_group)
        self._lockstep = self._lockstep_group(tp_group, expert_group)
        self.needs_every_replica = self._lockstep is not None
        self._no_routing = self._check_routing(record_routing)  # a rejected row's; None: off
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._buffer: dict[str, torch.Tensor] = {}
        # Graphs hold the TP all-gather of the logits too; that capture is not validated
        # (the two-GPU engine test did not finish with it), so TP > 1 decodes eagerly.
        # A replayed graph runs no Python hook: recording the routing decodes eagerly.
        self.use_cuda_graphs = (
            use_cuda_graphs
            and dist.get_world_size(tp_group) == 1
            and self._lockstep is None
            and not record_routing
        )
        self._sessions = DecodeSessions(
            self._forward, self.vocab_size, self._device, self.use_cuda_graphs
        )
        # Context parallelism: decoding one token per step cannot be split over CP ranks,
        # so each CP rank generates the whole rows itself (the same seed, the same samples)
        # and the model is told so per batch, through the one-rank group megatron-core's
        # RoPE and our attention take from `PackedSeqParams.cp_group`.
        self._own_group = None
        if self.model.config.context_parallel_size > 1:
            self._own_group, _ = dist.new_subgroups(group_size=1)  # collective

    def _check_same_seed(self, tp_group: dist.ProcessGroup) -> None:
        """TP ranks sampling with different seeds would desynchronise; refuse early."""
        if dist.get_world_size(tp_group) == 1:
            return
        seeds = torch.tensor([self.seed], device=self._device)
        low, high = seeds.clone(), seeds.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
        if low.item() != high.item():
            raise ValueError(
                f"megatron rollout engine: seeds differ across the tensor-parallel group "
                f"({low.item()} … {high.item()}); give every TP rank of a replica the same seed"
            )

    def _lockstep_group(
        self, tp_group: dist.ProcessGroup, expert_group: dist.ProcessGroup | None
    ) -> dist.ProcessGroup | None:
        """The group whose ranks must run as many forwards as this one, when it reaches
        beyond the TP group (whose ranks decode the same rows in lockstep anyway); None: no
        such rank. That is an MoE model's expert group (EP × ETP)."""
        if not self.model.config.num_moe_experts:
            return None
        experts = set(dist.get_process_group_ranks(expert_group))
        tp = set(dist.get_process_group_ranks(tp_group))
        if experts <= tp:
            return None
        if not tp <= experts:
            # Agreeing over the expert group would then let TP ranks of one replica differ.
            raise ValueError(
                f"megatron rollout engine: the expert group {sorted(experts)} neither holds "
                f"nor lies within the tensor-parallel group {sorted(tp)}"
            )
        local = next(m.num_local_experts for m in self.model.modules()
                     if hasattr(m, "num_local_experts"))  # fmt: skip
        logger.info(
            "megatron rollout engine: %d of %d experts per rank, an expert group of %d ranks "
            "that agree on every forward",
            local, self.model.config.num_moe_experts, len(experts),
        )  # fmt: skip
        return expert_group

    def _check_routing(self, record: bool) -> torch.Tensor | None:
        """With `record`: the (empty) routing of a row that is not generated, `[0, L, k]`,
        after checking that the layers are all MoE (the routing is indexed by layer)."""
        if not record:
            return None
        routers = moe_routers(self.model)
        layers = [layer for layer, _ in routers]
        if layers != list(range(self.model.config.num_layers)):
            raise ValueError(
                f"megatron rollout engine: recording the routing needs an MoE router in every "
                f"layer; the model has them in layers {layers} of {self.model.config.num_layers}"
            )
        return torch.empty(0, len(layers), routers[0][1].topk, dtype=torch.int16)

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- weights ------------------------------------------------------------------

    def sync_from(self, model_chunks: Sequence[torch.nn.Module], version: int) -> None:
        """The trainer's modules are the engine's own: nothing moves, the version is stamped."""
        if len(model_chunks) != 1 or unwrap(model_chunks[0]) is not self.model:
            raise ValueError(
                "megatron rollout engine: sync_from was given other modules than the ones it "
                "generates with; build the engine on the actor's own chunks"
            )
        self.update_weights({}, version)

    def _begin_update(self) -> None:
        self._buffer = {}

    def _load_bucket(self, weights: NamedTensors) -> None:
        self._buffer.update(iter_named_tensors(weights))

    @torch.no_grad()
    def _finish_update(self) -> None:
        if not self._buffer:
            return  # shared modules: the trainer already updated them in place
        tp = dist.get_world_size(self._tp_group)
        tp_rank = dist.get_rank(self._tp_group)
        buffer, self._buffer = self._buffer, {}

        def read(name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
            if name not in buffer:
                raise hm.MappingError(f"weight update lacks HF tensor '{name}'")
            t = buffer[name]
            return t if dim is None else t.narrow(dim, start, end - start)

        rules = hm.rules_for(self.info, "lm")
        for rule, layer, param in iter_rule_params(self.model, rules):
            padded = param.shape[0] * tp if rule.transform == hm.VOCAB else 0
            shard = hm.hf_to_megatron_shard(rule, layer, read, self.info, tp, tp_rank, padded)
            if tuple(shard.shape) != tuple(param.shape):
                raise hm.MappingError(
                    f"'{rule.megatron.format(layer=layer)}' gets shape {list(shard.shape)}, "
                    f"the model has {list(param.shape)}"
                )
            param.copy_(shard)

    # ---- memory: the actor's modules are the trainer's to move ---------------------

    def _sleep(self, level: int) -> None:
        pass

    def _wake(self, tags: list[str]) -> None:
        pass

    # ---- generation ---------------------------------------------------------------

    def _generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        output_layout: OutputLayout,
    ) -> RolloutBatch:
        # One replica per TP group: "replica" and "full" are the same rows here.
        fitted = fit_prompts(
            prompt_token_ids,
            sampling.prompt_limit(self.max_model_len),
            sampling.prompt_overflow,
            self.vocab_size,
        )
        rows: list[tuple[int, int]] = [
            (i, j) for i in range(len(fitted.token_ids)) for j in range(sampling.n)
        ]
        served = [(i, j) for i, j in rows if not fitted.rejected[i]]
        results: dict[tuple[int, int], Sample] = {
            (i, j): ([], [], FinishReason.REJECTED, self._no_routing)
            for i, j in rows
            if fitted.rejected[i]
        }
        chunks = [
            served[start : start + self.max_batch_size]
            for start in range(0, len(served), self.max_batch_size)
        ]
        self.model.eval()
        # Ranks of the expert group may have fewer batches (rejected prompts, an uneven
        # evaluation share, none at all): they join the others' forwards.
        for k in range(self._agree(len(chunks))):
            if k >= len(chunks):
                self._join_decode()
                continue
            chunk = chunks[k]
            prompts = [fitted.token_ids[i] for i, _ in chunk]
            seeds = None
            if sampling.prompt_seed(0) is not None:
                seeds = [sampling.prompt_seed(i) + j for i, j in chunk]
            caps = None
            if sampling.prompt_max_new_tokens is not None:
                caps = [sampling.prompt_max_new(i) for i, _ in chunk]
            for key, sample in zip(chunk, self._decode(prompts, sampling, seeds, caps)):
                results[key] = sample
        return RolloutBatch.from_sequences(
            prompts=[fitted.token_ids[i] for i, _ in rows],
            responses=[results[r][0] for r in rows],
            log_probs=[results[r][1] for r in rows],
            finish_reasons=[results[r][2] for r in rows],
            group_index=[i for i, _ in rows],
            prompt_truncated=[fitted.truncated[i] for i, _ in rows],
            pad_token_id=self.pad_token_id,
            routed_experts=None if self._no_routing is None else [results[r][3] for r in rows],
        )

    @torch.no_grad()
    def _decode(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int] | None,
        caps: list[int] | None = None,
    ) -> list[Sample]:
        """Generate one response per prompt row (`len(prompts)` ≤ max_batch_size).

        caps: per row, the most new tokens (≤ `sampling.max_new_tokens`); a row that reaches
            its cap stops there (finish reason "length") while the others decode on. Its
            tokens are the uncapped row's first ones: a row's draws depend on its seed and
            step only. None: `max_new_tokens` for every row.
        The loop issues no host sync except one `done.all()` per step when there are stop
        tokens or caps (and, in an expert group, the agreement on whether to go on); results
        come back to the host once, at the end. With `record_routing`, each row's routing
        too (module docstring).
        """
        device = self._device
        b, r = len(prompts), sampling.max_new_tokens
        longest = max(map(len, prompts))
        p = max(longest, min(-(-longest // PROMPT_WIDTH_STEP) * PROMPT_WIDTH_STEP,
                             self.max_model_len - r))  # fmt: skip
        p = self._sessions.width(b, p, r)
        stop_ids = sampling.resolved_stop_token_ids(self.eos_token_ids)
        stop = torch.tensor(stop_ids, dtype=torch.int64, device=device)
        # Built on the host, copied once (not one small copy per row).
        tokens = torch.full((b, p), self.pad_token_id, dtype=torch.int64)
        keep = torch.zeros((b, p), dtype=torch.bool)  # real prompt tokens
        for k, prompt in enumerate(prompts):
            tokens[k, p - len(prompt) :] = torch.as_tensor(prompt)
            keep[k, p - len(prompt) :] = True
        tokens, keep = tokens.to(device), keep.to(device)
        prompt_len = keep.sum(1)
        row_seeds = seed_tensor(seeds, device) if seeds is not None else None
        row_caps = None if caps is None else torch.tensor(caps, dtype=torch.int64, device=device)
        session = self._sessions.get(b, p, r, self.model)
        # Sequence-first routing of every forward, `[columns, b, L, k]`: the prompt block's
        # P columns, then one per decode step (step t forwards response token t).
        routing: list[torch.Tensor] = []
        recording = (
            contextlib.nullcontext() if self._no_routing is None else record_routing(self.model)
        )
        with recording as recorder:
            logits = session.prefill(tokens, keep)
            if recorder is not None:
                routing.append(recorder.take().unflatten(0, (p, b)))

            out_tokens, out_lps = [], []
            done = torch.zeros(b, dtype=torch.bool, device=device)
            length = torch.zeros(b, dtype=torch.int64, device=device)
            for step in range(r):
                tok, lp = sample_tokens(
                    logits, sampling, seeds=row_seeds, step=step, generator=self._generator
                )
                out_tokens.append(tok)
                out_lps.append(lp)
                length += (~done).long()
                if stop_ids:
                    done |= torch.isin(tok, stop)
                if row_caps is not None:
                    done |= length >= row_caps
                if stop_ids or row_caps is not None:
                    if step == r - 1 or bool(done.all()):  # the one host sync per step
                        break
                elif step == r - 1:
                    break
                self._agree(1)  # this rank decodes on (the others join if they are done)
                session.keep[:, p + step] = True
                session.tokens.copy_(tok[:, None])
                torch.add(prompt_len, step, out=session.positions[:, 0])
                logits = session.decode(step)
                if recorder is not None:
                    routing.append(recorder.take()[None])  # [1, b, L, k]
        # Outside the recorder: the join forwards' routing is nobody's.
        while self._agree(0):  # others of the expert group still decode
            self._join_forward()
        # A row stopped iff it hit a stop token before the cap (its last kept token is one).
        tok_t = torch.stack(out_tokens, 1)
        last = tok_t.gather(1, (length - 1)[:, None])[:, 0]
        stopped = torch.isin(last, stop) if stop_ids else torch.zeros_like(done)
        tok_l, lp_l = tok_t.tolist(), torch.stack(out_lps, 1).tolist()
        length_l, stopped_l = length.tolist(), stopped.tolist()
        rows_routing: list[torch.Tensor | None] = [None] * b
        if routing:
            by_row = torch.cat(routing).transpose(0, 1).cpu()  # [b, P + steps, L, k]
            # Row k: its prompt (the last len_k prompt columns), then its response but the
            # last token (decode steps 0 … n_k − 2).
            rows_routing = [
                by_row[k, p - len(prompts[k]) : p + n - 1] for k, n in enumerate(length_l)
            ]
        return [
            (
                tok_l[k][:n],
                lp_l[k][:n],
                FinishReason.STOP if stopped_l[k] else FinishReason.LENGTH,
                rows_routing[k],
            )
            for k, n in enumerate(length_l)
        ]

    # ---- the expert group's lockstep -------------------------------------------------

    def _agree(self, count: int) -> int:
        """The largest `count` over the expert group (collective there; `count` alone when
        this rank has no such group): how many decode batches, or whether any rank
        decodes another step."""
        if self._lockstep is None:
            return count
        t = torch.tensor([count], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._lockstep)
        return int(t.item())

    def _join_decode(self) -> None:
        """Stand in for a decode batch of the expert group that this rank does not have:
        its prefill, then each step any other rank still decodes."""
        self._join_forward()
        while self._agree(0):
            self._join_forward()

    @torch.no_grad()
    def _join_forward(self) -> None:
        """A one-token forward without a KV cache: the MoE layers' all-to-alls of the
        others' forward, with no token of this rank's that matters (output dropped)."""
        device = self._device
        token = torch.full((1, 1), self.pad_token_id, dtype=torch.int64, device=device)
        keep = torch.ones((1, 1), dtype=torch.bool, device=device)
        self.model(token, torch.zeros_like(token), causal_padding_mask(keep))

    # ---- decode sessions ----------------------------------------------------------

    @property
    def session_bytes(self) -> int:
        """Device memory the kept decode sessions hold (KV caches, buffers, graph pools)."""
        return self._sessions.nbytes

    def _forward(self, tokens, position_ids, mask, ctx) -> torch.Tensor:
        """Last-position logits `[b, vocab]` (fp32, padding ids cut), gathered over TP."""
        kwargs = {}
        if self._own_group is not None:
            # RoPE's table then spans the cache's positions (not × cp, nor cut per CP rank).
            length = ctx.max_sequence_length
            kwargs["packed_seq_params"] = PackedSeqParams(
                qkv_format="sbhd",
                cp_group=self._own_group,
                max_seqlen_q=length,
                max_seqlen_kv=length,
            )
        logits = self.model(
            tokens, position_ids, mask, inference_context=ctx, runtime_gather_output=True, **kwargs
        )
        return logits[:, -1, : self.vocab_size].float()
