"""The plain megatron-core training loop `trainer_bench.py` compares the trainer's actor
update against: the same model shape, builder and parallel layout, none of our role code.
A mixture of experts (`model.num_experts`) is built as the actor is (megatron-core's
`MoELayer`, the same router and expert settings); its MFU counts the FLOPs of the router and
the top-k experts a token passes through (`utils.flops`), as the trainer's does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from bench_utils import (
    allocated_gb,
    gib,
    sync,
    trainer_gc_policy,
)  # benchmarks/, on sys.path in the scripts
from phase_probes import GC_PAUSES
from update_traces import device_idle_of, profiled, sync_sites_of

from rl_megatron.parallel import ParallelLayout
from rl_megatron.utils.flops import TransformerShape, device_peak_tflops, flops_per_token


class PlainLoop:
    """A plain megatron-core model, optimizer and fixed batch; `iteration()` is one
    optimizer step (forward/backward over `num_micro` micro-batches + Adam), and
    `iteration(micro_batches)` one over the given micro-batches instead (`plain_micro_batches`).

    masked: pass an explicit causal `[b, 1, s, s]` mask (no padding in it) instead of None,
        which is what the trainer's micro-batches pass whenever a row is left-padded:
        it takes SDPA off the causal fast path (explicit mask, K/V expanded for GQA).
    role: a trained `MegatronRole` whose DDP chunks, optimizer and TransformerConfig to use
        instead of building them (`trainer_bench.py --update-diagnostics`: the plain loop on
        the actor's own model); its steps then change the role's weights.
    """

    def __init__(self, config, info, args, masked: bool = False, role=None) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from rl_megatron.trainer.build import DTYPES

        p = config.parallel
        dtype = DTYPES[config.model.dtype]
        micro_batch = args.plain_micro_batch or config.actor.micro_batch_size
        seq = args.plain_seq or (
            config.rollout.max_prompt_length + config.rollout.max_response_length
        )
        dp = dist.get_world_size() // (p.tp * p.pp)
        num_micro = args.plain_micro_batches or (
            config.actor.mini_batch_size // (config.actor.micro_batch_size * dp)
        )
        before_gb = allocated_gb()
        self.owns_model = role is None
        if role is None:
            model, optimizer = self._build(config, info, dtype)
            model_config = model[0].config
        else:
            model, optimizer, model_config = role.model, role.optimizer, role.config
        device = next(model[0].parameters()).device
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, info.vocab_size, (micro_batch, seq + 1), generator=gen).to(device)
        batch = {
            "input_ids": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq, device=device).expand(micro_batch, seq).contiguous(),
            "attention_mask": None,
        }
        if masked:
            from rl_megatron.models.sdpa_attention import causal_padding_mask

            ones = torch.ones(micro_batch, seq, dtype=torch.bool, device=device)
            batch["attention_mask"] = causal_padding_mask(ones)

        def loss_func(per_token_loss: torch.Tensor):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        def forward_step(data_iterator, chunk):
            b = next(data_iterator)
            # attention_mask None: the causal fast path of SDPAttention. With labels, GPTModel
            # returns the per-token vocab-parallel cross-entropy `[b, s]`.
            out = chunk(b["input_ids"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            return out, loss_func

        forward_backward = get_forward_backward_func()
        fixed = [batch] * num_micro

        def iteration(micro_batches: list[dict] | None = None) -> float:
            micro, rows, width = fixed, micro_batch, seq
            if micro_batches is not None:
                micro = micro_batches
                rows = max(m["input_ids"].shape[0] for m in micro)
                width = max(m["input_ids"].shape[1] for m in micro)
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=model,
                num_microbatches=len(micro),
                seq_length=width,
                micro_batch_size=rows,
                forward_only=False,
            )
            optimizer.step()
            return float(torch.stack([x["loss"] for x in losses]).mean())

        for chunk in model:
            chunk.train()
        self.iteration = iteration
        self.model, self.optimizer, self.model_config = model, optimizer, model_config
        self.micro_batch, self.seq, self.num_micro = micro_batch, seq, num_micro
        self.before_gb = before_gb

    @staticmethod
    def _build(config, info, dtype) -> tuple[list, object]:
        """This rank's chunks under Megatron DDP and the distributed Adam, as the roles
        build them."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from rl_megatron.models.builders import build_gpt_chunks
        from rl_megatron.models.hf_config import moe_loss_overrides

        p, m = config.parallel, config.model
        # The actor's TransformerConfig extras (trainer/build.py, `build_roles`): the actor's
        # recompute and, with experts, its router losses (off unless model.moe_*_loss_coeff
        # say otherwise). The rest of an MoE layer (alltoall dispatcher, no token dropping,
        # every degree from the layout) is the builder's, as for the actor.
        extra = {
            "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
            **config.actor.recompute.transformer_config(),
        }
        if m.num_experts:
            extra.update(moe_loss_overrides(m.moe_aux_loss_coeff, m.moe_z_loss_coeff))
        layout = ParallelLayout.from_megatron(sequence_parallel=p.sequence_parallel)
        chunks = build_gpt_chunks(info, layout, dtype=dtype, **extra)
        model_config = chunks[0].config
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
        )
        model = [DistributedDataParallel(model_config, ddp_config, c) for c in chunks]
        model_config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-6,
                weight_decay=0.0,
                clip_grad=1.0,
                bf16=dtype == torch.bfloat16,
                params_dtype=dtype,
                use_distributed_optimizer=True,
            ),
            model,
        )
        return model, optimizer

    def close(self) -> None:
        """Unhook megatron-core's grad finalisation from the model config of a model built
        here (the model and optimizer go with this object); a role's stays as it is."""
        if self.owns_model:
            self.model_config.finalize_model_grads_func = None


def plain_micro_batches(micro_batches: list[dict]) -> list[dict]:
    """A trainer role's left-aligned micro-batches (`MegatronRole._micro_batches`) as the
    plain loop's: the same `input_ids` / `position_ids` `[b, s]`, attention mask None (as the
    role passes them: padding only at the ends of rows, plain causal attention), labels the
    next tokens (the last column's wraps around; its loss counts like any other)."""
    if any("input_ids" not in m for m in micro_batches):
        raise ValueError(
            "plain_micro_batches: needs left-aligned micro-batches (input_ids), not packed "
            "ones (model.pack_sequences=false)"
        )
    return [
        {
            "input_ids": m["input_ids"],
            "position_ids": m["position_ids"],
            "labels": m["input_ids"].roll(-1, dims=1),
            "attention_mask": None,
        }
        for m in micro_batches
    ]


def plain_loop(config, info, args, masked: bool = False, profile: bool = True) -> dict:
    """Megatron-core forward/backward + Adam on fixed batches; tokens/s, MFU, peak memory
    (`PlainLoop`; masked: its explicit-mask variant)."""
    loop = PlainLoop(config, info, args, masked=masked)
    iteration = loop.iteration
    micro_batch, seq, num_micro = loop.micro_batch, loop.seq, loop.num_micro
    before_gb = loop.before_gb
    first_loss = iteration()  # warm-up: kernel selection, optimizer state allocation
    for _ in range(args.plain_warmup - 1):
        iteration()
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # The trainer's garbage-collection policy (`trainer.manual_gc`) holds here too.
    with trainer_gc_policy(config.trainer.manual_gc):
        GC_PAUSES.reset()
        start = time.perf_counter()
        last_loss = 0.0
        for _ in range(args.plain_iters):
            last_loss = iteration()
        sync()
        gc_pauses = {"count": GC_PAUSES.count, "seconds": GC_PAUSES.seconds}
    seconds = time.perf_counter() - start
    peak_gb = gib(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0.0
    profile_path, device_idle, sync_sites = None, None, None
    if profile and args.profile_update and args.profile_dir is not None:
        profile_path = args.profile_dir / f"profile_{'plain_masked' if masked else 'plain'}.txt"
        iterations = config.actor.ppo_epochs * config.data.train_batch_size * config.rollout.n
        iterations //= config.actor.mini_batch_size  # the actor's optimizer steps per phase
        profiled(
            lambda: [iteration() for _ in range(iterations)], profile_path, dist.get_rank() == 0
        )
        # Two iterations traced like the actor-update phase (`trace_actor_update`, two
        # optimizer steps), so that their device idle times compare directly.
        device_idle = device_idle_of(lambda: [iteration() for _ in range(2)])
        sync_sites = sync_sites_of(lambda: [iteration() for _ in range(2)])
    tokens_total = args.plain_iters * num_micro * micro_batch * seq
    tok_s = tokens_total / seconds / dist.get_world_size()
    peak = device_peak_tflops()
    mfu = tok_s * flops_per_token(TransformerShape.of(info), seq) / (peak * 1e12) if peak else None
    out = {
        "attention_mask": "explicit causal [b,1,s,s]" if masked else "None (is_causal)",
        "micro_batch_size": micro_batch,
        "seq_length": seq,
        "micro_batches_per_step": num_micro,
        "warmup_iters": args.plain_warmup,
        "timed_iters": args.plain_iters,
        "seconds": seconds,
        "seconds_per_iter": seconds / args.plain_iters,
        "tokens_per_s_per_gpu": tok_s,
        "mfu": mfu,
        "flops_per_token": flops_per_token(TransformerShape.of(info), seq),
        "peak_memory_gb": peak_gb,
        "allocated_before_gb": before_gb,
        "loss_first": first_loss,
        "loss_last": last_loss,
        "profile": str(profile_path) if profile_path else None,
        "device_idle": device_idle,
        "sync_sites": sync_sites,
        "gc_pauses": gc_pauses,
    }
    loop.close()
    return out  # the model and optimizer go with this frame (the caller measures that)
