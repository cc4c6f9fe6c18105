"""A role (actor, critic, reference, reward model): model chunks + optimizer + schedules.

`MegatronRole` wraps the chunks a builder returns (`rl_megatron.checkpoint.hf_builders`):

* `forward_only(batch)` → per-token outputs of the response tokens, on every rank:
  `log_prob` (and `entropy`) for LM heads, `values` for value heads, `[b, R]` float32;
  with `kl_to=<another LM role>` also `kl_full`, the exact KL to that role's policy, its
  logits computed on the same micro-batch beside ours (pp = 1).
* `train_step(mini_batch, loss_fn)` → one optimizer step over this rank's part of a
  mini-batch, in micro-batches; returns metrics (`train_steps`: several, one call).

Each concern reads in its own module: the micro-batches (`micro_batches.py`, `packing.py`),
megatron-core's pipeline schedules over them and the forward step (`schedule.py`),
context-parallel split and gather (`cp_split.py`), the per-token log-prob / entropy / KL /
value computations from a model output (`heads.py`), routing replay around a forward
(`routing.py`), the optimizer, its learning rate and its gated step
(`optimizer_step.py`), offload (`offload.py`).

Batches are dicts of tensors, rows first (a `RolloutBatch`'s fields, plus whatever the
loss needs):

    prompts         [b, P]      int64  left-padded
    responses       [b, R]      int64  right-padded
    attention_mask  [b, P + R]  int64  1 on real tokens
    position_ids    [b, P + R]  int64
    response_mask   [b, R]      0/1    tokens that count in the loss
    ...             [b, R] or [b]      loss inputs (old_log_prob, advantages, returns, ...)

The model reads `input_ids = [prompts | responses]`; GPTModel works sequence-first inside
(`[s, b, h]` between layers and across pipeline stages) and returns batch-first
`[b, s, V/tp]` logits (or `[b, s, 1]` values). The prediction for response token k sits
at column P - 1 + k, so outputs are read from columns P - 1 … P + R - 2. Values follow the
same convention (V(s_k) is read where token k is predicted), as in PPO's reference
implementation for language models.

Loss normalisation (see `algorithms.aggregation`): each micro-batch's loss is its share of
the mini-batch loss, normalised by `batch_totals` over the DP group. Megatron's DDP
averages gradients over DP and the schedule divides each micro-batch loss by the number
of micro-batches, so the role multiplies the loss by `dp_size * num_micro_batches` before
backward: the gradient is then that of the mini-batch loss, however the mini-batch is split.

Process groups (`parallel.ParallelGroups`) are given at construction, or taken from
megatron-core's current ones, and passed to every collective of ours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)

from rl_megatron.algorithms.aggregation import BatchTotals, batch_totals
from rl_megatron.config import OffloadConfig, OptimConfig
from rl_megatron.models.builders import ValueHead
from rl_megatron.models.router_replay import RoutingStats
from rl_megatron.parallel import ParallelGroups
from rl_megatron.trainer import micro_batches as mb
from rl_megatron.trainer import routing, schedule, step_metrics
from rl_megatron.trainer.heads import OutputHead
from rl_megatron.trainer.lr_schedule import lr_at
from rl_megatron.trainer.offload import Offloader
from rl_megatron.trainer.optimizer_step import (
    NonFiniteUpdateError,
    build_optimizer,
    set_lr,
    step_if_finite,
)

Batch = Mapping[str, torch.Tensor]
# loss_fn(outputs, micro_batch, totals) -> (loss, metrics). outputs: `log_prob` / `entropy`
# or `values`, `[b, r]` with gradient, r = the micro-batch's (trimmed) response width;
# micro_batch: the batch's rows, response-width tensors trimmed to r.
LossFn = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], BatchTotals],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]


class MegatronRole:
    """Model chunks of one role, with DDP, the distributed optimizer and an LR schedule.

    Args:
        chunks: this rank's `GPTModel` chunks, one per virtual pipeline stage (a builder's
            output); LM head or `ValueHead`.
        optim: optimizer settings; None for a frozen role (reference, reward model), which
            gets neither DDP nor an optimizer and can only run `forward_only`. With
            `cpu_offload_fraction` > 0 that share of the optimizer state lives in host
            memory and is stepped there (`optimizer_step.build_optimizer`).
        micro_batch_size: rows per micro-batch (fixed mode).
        use_dynamic_batch: token-budget micro-batches instead (`micro_batches`).
        max_tokens_per_micro_batch: the budget, in real tokens.
        temperature: divides the logits before log-probs/entropy (the rollout's).
        total_steps: optimizer steps of the run, for linear/cosine decay.
        offload: what `offload()` moves to host memory between phases.
        groups: the run's process groups (`DistributedRun.groups`); default: megatron-core's
            current ones.
        pack_sequences: run micro-batches padding-free, their rows packed into one
            sequence (`trainer/packing.py`, THD layout); needs an attention that takes
            `PackedSeqParams` (our SDPA module, Transformer Engine).
        output_at: which column a value head's output is read from for response token k:
            `prediction` (where token k is predicted: critics, V(s_k)) or `token` (token
            k's own position: reward models score a sequence at its last token).
        name: the role's name in errors ("actor", "critic", ...).
        on_nonfinite: a NaN/inf loss on any rank or gradient norm: `stop` raises
            `NonFiniteUpdateError` on every rank before the parameters change; `skip`
            leaves them unchanged, reports `skipped` = 1 and goes on
            (`optimizer_step.step_if_finite`).
        router_replay: MoE routing replay (R3, `actor.router_replay`): where a micro-batch
            carries the rollout's `routed_experts`, the routers take those experts
            (`models/router_replay.py`) and `forward_only` counts how often their own
            choice differs (`routing_mismatch_frac`); False: the routing is ignored
            (unless `compare_routing` is set: counted, not replayed).
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        *,
        optim: OptimConfig | None = None,
        micro_batch_size: int = 1,
        use_dynamic_batch: bool = False,
        max_tokens_per_micro_batch: int = 16384,
        temperature: float = 1.0,
        total_steps: int | None = None,
        offload: OffloadConfig | None = None,
        groups: ParallelGroups | None = None,
        output_at: str = "prediction",
        pack_sequences: bool = False,
        name: str = "role",
        on_nonfinite: str = "stop",
        logprob_chunk_tokens: int = 0,
        router_replay: bool = False,
    ) -> None:
        if output_at not in ("prediction", "token"):
            raise ValueError(f"output_at must be 'prediction' or 'token', got {output_at!r}")
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
        self.name, self.on_nonfinite = name, on_nonfinite
        self.output_shift = 0 if output_at == "token" else 1
        self.groups = groups or ParallelGroups.from_megatron()
        self.config = chunks[0].config
        self.device = next(chunks[0].parameters()).device
        # Only the last pipeline stage holds the head; every stage must know its kind.
        has_value_head = torch.tensor(
            [float(isinstance(getattr(c, "output_layer", None), ValueHead)) for c in chunks],
            device=self.device,
        ).max()
        dist.all_reduce(has_value_head, op=dist.ReduceOp.MAX, group=self.groups.pp)
        self.value_head = bool(has_value_head)
        self.vocab_size = getattr(chunks[-1], "true_vocab_size", None)
        self.micro_batch_size = micro_batch_size
        self.use_dynamic_batch = use_dynamic_batch
        self.max_tokens = max_tokens_per_micro_batch
        self.temperature = temperature
        # > 0: log-probs / entropy from the final hidden states, this many tokens at a
        # time, never the full logits (`models/chunked_logprobs.py`); LM heads only.
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.router_replay = router_replay
        # Without replay, still compare the routers' choices with the batch's routing
        # (`routing_mismatch_frac` of a run or test with replay off).
        self.compare_routing = False
        # Routing mismatch counts of the last `forward_only` (`routing.py`).
        self._last_routing_stats: RoutingStats | None = None
        self.optim_config = optim
        self.total_steps = total_steps
        self.step_count = 0
        # Without interleaving, micro-batches are trimmed to their own length and pipeline
        # stages exchange tensor shapes per micro-batch. megatron-core's interleaved
        # schedule deadlocks in that shape exchange (forward + backward), so there every
        # micro-batch keeps one fixed shape (`_micro_batches`).
        self.interleaved = len(chunks) > 1
        self.config.variable_seq_lengths = not self.interleaved
        self.pack = pack_sequences
        self.layout = layout = self.groups.layout
        if layout.sequence_parallel != self.config.sequence_parallel:
            raise ValueError(
                f"{name}: model built with sequence_parallel={self.config.sequence_parallel}, "
                f"its groups' layout has {layout.sequence_parallel}"
            )
        # Sequence parallelism splits the (packed) sequence over TP ranks, context
        # parallelism cuts every sequence into 2·cp chunks (`cp_split.py`).
        self.pack_multiple = layout.sequence_divisor
        self.seq_multiple = layout.cp_chunks
        self.cp_size = layout.cp
        self.is_pp_last = self.groups.is_pp_last
        self.offload_config = offload or OffloadConfig()
        if optim is None:
            self.model = list(chunks)
            self.optimizer = None
            self.offloader = Offloader(self.model)
            return
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
        )
        # Bucketing only on the first chunk, as Megatron-LM does for interleaved pipelines.
        self.model = [
            DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = build_optimizer(self.model, self.config, optim)
        set_lr(self.optimizer, lr_at(0, optim, total_steps), optim.weight_decay)
        self.offloader = Offloader(self.model, self.optimizer)

    # ---- offload -----------------------------------------------------------------------

    def offload(self) -> int:
        """Move what the role's `OffloadConfig` selects to host memory; bytes freed."""
        return self.offloader.offload(self.offload_config)

    def reload(self) -> None:
        """Bring the offloaded state back to the device (a no-op when nothing is off)."""
        self.offloader.reload()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The role reloaded for a phase; offloaded afterwards as its config says."""
        self.reload()
        try:
            yield
        finally:
            self.offload()

    # ---- forward only ------------------------------------------------------------------

    @torch.no_grad()
    def forward_only(
        self,
        batch: Batch,
        *,
        with_entropy: bool = False,
        micro_batch_size: int | None = None,
        kl_to: MegatronRole | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token outputs of the response tokens of every row, on every rank.

        batch: the dict layout of the module docstring (this rank's rows).
        with_entropy: also return `entropy` (LM heads).
        micro_batch_size: override the role's (fixed mode); None = the role's setting.
        kl_to: another LM role (the reference), on the device: also return `kl_full`, the
            exact KL(this policy || its policy) at each response token (`_check_kl_to`).
        Returns `log_prob` (+ `entropy`, `kl_full`) or `values`, each `[b, R]` float32, 0
        where `response_mask` is 0 (or on right padding), identical on all TP and PP ranks.
        """
        self._check_loaded()
        self._check_kl_to(kl_to)
        for chunk in self.model:
            chunk.eval()
        split = self._split(batch, micro_batch_size)
        micro = self._micro_batches(batch, split)
        keys = ["values"] if self.value_head else ["log_prob"] + ["entropy"] * with_entropy
        keys += ["kl_full"] * (kl_to is not None)
        head = self._head()

        def loss_func(mbatch, output, non_loss_data=False):
            return head.per_token(output, mbatch, with_entropy)

        b, r = batch["responses"].shape
        results = {k: torch.zeros(b, r, dtype=torch.float32, device=self.device) for k in keys}
        # The routers' mismatch counts of this call (`routing_mismatch_frac`).
        self._last_routing_stats = stats = RoutingStats()
        outs = self._schedule(micro, loss_func, forward_only=True, kl_to=kl_to, stats=stats)
        if self.is_pp_last:
            for key in keys:
                full = [mb.pad_responses(o[key][: len(rows)], r) for o, rows in zip(outs, split)]
                results[key] = mb.restore_order(full, split).to(self.device)
        mask = batch["response_mask"].to(self.device).bool()
        for key in keys:
            # The last stage computed them; every other stage of the pipeline needs them too.
            dist.broadcast(results[key], src=self.groups.pp_last_rank, group=self.groups.pp)
            results[key].masked_fill_(~mask, 0.0)
        return results

    def routing_mismatch_frac(self) -> float | None:
        """Of the (token, layer) pairs with a recorded routing in the last `forward_only`,
        the fraction whose recorded top-k set differs from the router's own choice (given
        the layers below as they ran); summed over pipeline stages and DP (and TP with
        sequence parallelism, which splits the tokens). None when nothing was recorded.
        Collective over this role's ranks."""
        return routing.mismatch_fraction(
            self._last_routing_stats or RoutingStats(),
            self.groups,
            self.layout.sequence_parallel,
            self.device,
        )

    # ---- training ----------------------------------------------------------------------

    def train_step(
        self,
        mini_batch: Batch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's part of a mini-batch.

        mini_batch: dict layout of the module docstring; its `response_mask` rows across all
            DP ranks make up the mini-batch that losses are normalised by.
        loss_fn: `(outputs, micro_batch, totals) -> (loss, metrics)`; the loss must be the
            micro-batch's share of the mini-batch loss (`aggregate(..., totals=totals)`).
        with_entropy: compute `entropy` for the loss (entropy bonus).
        micro_batch_size: override the role's (fixed mode).
        Returns, identical on every rank: `loss` (the mini-batch loss) and the loss_fn's
        metrics, each summed over micro-batches and DP ranks (they are shares of the
        mini-batch's value), `grad_norm` (before clipping), `lr`, `update_successful`,
        `skipped` (1 when a non-finite loss or gradient norm dropped the step).
        Raises `NonFiniteUpdateError` on every rank instead, with `on_nonfinite="stop"`.
        """
        self._check_trainable()
        self._train_mode()
        step = self._optimizer_step(mini_batch, None, loss_fn, with_entropy, micro_batch_size)
        return self._resolve([step])[0]

    def train_steps(
        self,
        batch: Batch,
        steps: Sequence[Sequence[int]],
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        micro_batch_size: int | None = None,
        kl_to: MegatronRole | None = None,
        while_last_step_runs: Callable[[], None] | None = None,
    ) -> list[dict[str, float]]:
        """One optimizer step per entry of `steps`, in order: `train_step` on those rows.

        batch: this rank's rows (module docstring layout); steps: each step's mini-batch,
        as row indices into `batch`. Returns each step's `train_step` metrics.
        kl_to: as in `forward_only`: the loss function's outputs then hold `kl_full`, with
        gradient (the exact KL loss).
        while_last_step_runs: host work to do once the last optimizer step is queued,
        before the host waits for the device (the trainer maps the engine's weights back
        there: `RolloutEngine.wake_if_room`). Called on every rank, also when the last step
        was skipped.
        The host waits for the device twice per phase rather than twice per step: the
        mask's host copy (micro-batch shapes, a token-budget split) is made once, and the
        metrics of every step are read together at the end (`step_metrics`); in between,
        the host prepares and launches the next step while the device still runs the last
        optimizer update (besides the optimizer's own gradient-norm read, `step_if_finite`
        reads one flag per step). Pinned by tests/multirank/test_update_host_work.py.
        """
        self._check_trainable()
        self._check_kl_to(kl_to)
        self._train_mode()
        # One host copy of the mask for all steps, where the host needs the rows' lengths:
        # left-aligned micro-batches' shapes, or a token-budget split.
        lengths_on_host = not (self.pack or self.interleaved) or self.use_dynamic_batch
        host_mask = batch["attention_mask"].cpu() if lengths_on_host else None
        pending = []
        for rows in steps:
            mini_batch = mb.select_rows(batch, rows)
            rows_mask = None if host_mask is None else host_mask.index_select(0, mb.row_index(rows))
            pending.append(
                self._optimizer_step(
                    mini_batch, rows_mask, loss_fn, with_entropy, micro_batch_size, kl_to
                )
            )
        if while_last_step_runs is not None:
            while_last_step_runs()
        return self._resolve(pending)

    def _optimizer_step(
        self,
        mini_batch: Batch,
        host_mask: torch.Tensor | None,
        loss_fn: LossFn,
        with_entropy: bool,
        micro_batch_size: int | None,
        kl_to: MegatronRole | None = None,
    ) -> step_metrics.PendingMetrics:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = lr_at(self.step_count, self.optim_config, self.total_steps)
        set_lr(self.optimizer, lr, self.optim_config.weight_decay)
        totals = batch_totals(mini_batch["response_mask"].to(self.device), group=self.groups.dp)
        split = self._split(mini_batch, micro_batch_size, host_mask)
        micro = self._micro_batches(mini_batch, split, host_mask)
        # The schedule turns the returned loss into loss·scale·cp/n (megatron-core's ×cp,
        # meant for a loss over a CP rank's own tokens) and DDP averages over dp·cp ranks.
        # Here every CP rank computes the same loss but back-propagates through its own
        # tokens only (`cp_split.gather_outputs`), so the cp ranks' gradients sum to that
        # loss's gradient g once: the update is scale·cp/n / (dp·cp) · Σ_dp Σ_micro g, which
        # is the mini-batch loss's gradient exactly when scale = dp·n, with or without CP.
        scale = self.layout.dp * len(micro)
        head = self._head()

        def loss_func(mbatch, output):
            outputs = head.per_token(output, mbatch, with_entropy)
            loss, metrics = loss_fn(outputs, mbatch, totals)
            # The schedule divides the returned `loss * scale` in place, a tensor of its
            # own: what is reported here needs no copy.
            reported = {"loss": loss.detach()}
            reported.update({k: v.detach().float() for k, v in metrics.items()})
            return loss * scale, reported

        per_micro = self._schedule(micro, loss_func, forward_only=False, kl_to=kl_to)
        local_loss = (
            torch.stack([m["loss"] for m in per_micro]).sum()
            if self.is_pp_last and per_micro
            else torch.zeros((), device=self.device)
        )
        # Reads the gradient norm on the host (megatron-core's step does too) and checks
        # every rank's loss before any parameter changes.
        outcome = step_if_finite(self.optimizer, local_loss)
        if outcome.nonfinite is not None and self.on_nonfinite == "stop":
            raise NonFiniteUpdateError(
                f"{self.name}: non-finite {outcome.nonfinite} at its optimizer step "
                f"{self.step_count + 1} (grad norm {outcome.grad_norm}); no parameter was "
                f"changed. trainer.on_nonfinite=skip drops such steps instead"
            )
        if outcome.stepped:
            # The LR schedule advances with the updates made, as in Megatron-LM.
            self.step_count += 1
        pending = step_metrics.reduce_step(
            per_micro if self.is_pp_last else [], self.groups.dp, self.device
        )
        pending.host.update(
            grad_norm=outcome.grad_norm,
            lr=lr,
            update_successful=float(outcome.stepped),
            skipped=float(outcome.nonfinite is not None),
        )
        return pending

    def _resolve(self, pending: list[step_metrics.PendingMetrics]) -> list[dict[str, float]]:
        return step_metrics.resolve(
            pending,
            is_pp_last=self.is_pp_last,
            pp_group=self.groups.pp,
            pp_last_rank=self.groups.pp_last_rank,
        )

    # ---- micro-batches through the schedule --------------------------------------------

    def _split(
        self, batch: Batch, micro_batch_size: int | None, host_mask: torch.Tensor | None = None
    ) -> list[list[int]]:
        """The batch's rows in micro-batches. host_mask: a host copy of the batch's
        `attention_mask`, if the caller has one (a token budget then costs no device sync)."""
        rows = batch["prompts"].shape[0]
        vpp = len(self.model) > 1
        if self.use_dynamic_batch and micro_batch_size is None:
            lens = (batch["attention_mask"] if host_mask is None else host_mask).sum(dim=-1)
            # The interleaved schedule needs a multiple of pp micro-batches.
            mult = self.layout.pp if vpp else 1
            return mb.dynamic_micro_batches(lens, self.max_tokens, multiple_of=mult)
        split = mb.fixed_micro_batches(rows, micro_batch_size or self.micro_batch_size)
        if vpp and len(split) % self.layout.pp:
            raise ValueError(
                f"the interleaved pipeline schedule needs a multiple of pp="
                f"{self.layout.pp} micro-batches; {rows} rows in micro-batches of "
                f"{micro_batch_size or self.micro_batch_size} give {len(split)}"
            )
        return split

    def _micro_batches(
        self, batch: Batch, split: list[list[int]], host_mask: torch.Tensor | None = None
    ) -> list[dict]:
        """The micro-batches of `split`, on the device, shaped for the schedule."""
        return mb.schedule_micro_batches(
            batch,
            split,
            self.device,
            pack=self.pack,
            one_shape=self.interleaved,
            multiple_of=self.pack_multiple,
            seq_multiple=self.seq_multiple,
            host_mask=host_mask,
        )

    def _schedule(
        self,
        micro: list[dict],
        loss_func: Callable,
        *,
        forward_only: bool,
        kl_to: MegatronRole | None,
        stats: RoutingStats | None = None,
    ) -> list:
        """The micro-batches through megatron-core's schedule (`schedule.py`), each forward
        in the batch's routing (`routing.py`, mismatches counted into `stats`) and, with
        `kl_to`, beside that role's model; returns what loss_func reported."""
        step = partial(
            schedule.forward_step,
            loss_func=loss_func,
            cp=self.groups.cp if self.cp_size > 1 else None,
            # The exact KL needs both models' logits at every position: those stay whole.
            from_hidden=self.logprob_chunk_tokens > 0 and not self.value_head and kl_to is None,
            routing=partial(
                routing.around_forward,
                replay=self.router_replay,
                compare=self.compare_routing,
                stats=stats,
                tp=self.groups.tp,
                sequence_parallel=self.layout.sequence_parallel,
                role=self.name,
            ),
            kl_model=None if kl_to is None else kl_to.model[0],
        )
        return schedule.run(self.model, micro, step, pack=self.pack, forward_only=forward_only)

    def _head(self) -> OutputHead:
        """How this role reads its model's output, with its settings as they are now."""
        return OutputHead(
            value_head=self.value_head,
            output_shift=self.output_shift,
            temperature=self.temperature,
            vocab_size=self.vocab_size,
            chunk_tokens=self.logprob_chunk_tokens,
            tp=self.groups.tp,
            cp=self.groups.cp if self.cp_size > 1 else None,
            device=self.device,
        )

    # ---- checks ------------------------------------------------------------------------

    def _check_loaded(self) -> None:
        if self.offloader.is_offloaded:
            raise RuntimeError("this role is offloaded: call reload() before running it")

    def _check_kl_to(self, other: MegatronRole | None) -> None:
        """The other role runs beside this one on each micro-batch: one pipeline stage,
        the same vocabulary shards; in eval mode (a constant of the loss)."""
        if other is None:
            return
        if len(self.model) != 1 or self.layout.pp != 1 or other.value_head:
            raise ValueError(
                "kl_to: the full KL needs pp=1 and an LM head on both roles (the other "
                "role's logits are computed beside this role's on each micro-batch)"
            )
        other._check_loaded()
        for chunk in other.model:
            chunk.eval()

    def _check_trainable(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen role (built with optim=None)")
        self._check_loaded()

    def _train_mode(self) -> None:
        """Training mode for the optimizer steps of one call, set once, not per step:
        `Module.train()` walks every submodule (3.3k with 16 layers of 64 experts, ~10 ms
        of host time), and nothing between two steps of a call switches it back
        (`forward_only` does, and the Megatron engine on these modules, between calls)."""
        for chunk in self.model:
            chunk.train()
