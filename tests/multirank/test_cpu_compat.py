"""megatron-core on CPU + gloo: TP=2·PP=2 computes what TP=1·PP=1 computes.

One 4-rank run, three phases that re-initialise Megatron's parallel state:

A. TP1·PP1·DP4: build a Llama-style GPTModel (RMSNorm, SwiGLU, RoPE, GQA, no biases),
   save its weights with dist_checkpointing, run forward/backward through DDP and the
   distributed optimizer (one sample per DP rank), take one Adam step, save the weights.
B. TP2·PP2·DP1: load A's initial weights, run the same global batch through the 1F1B
   schedule (2 micro-batches of 2), take the same step, save the weights.
C. TP1·PP1: load both stepped checkpoints and compare each tensor's update.

With the distributed optimizer each DP rank holds only its shard of the reduced
gradient, so gradients are compared through Adam's first update, lr·g/(|g|+eps), which
is invertible in g. Weights move between layouts by megatron's own dist_checkpointing,
so the comparison needs no layout code of ours.
Tolerances: the loss to 1e-5 relative, updates to 1e-4 of each tensor's largest update;
fp32 sums run in a different order under TP (and eps=1e-2 amplifies gradient error by
at most lr/eps = 1), while a layout or schedule bug shows as O(1) error.

In cuda mode (tests/spawn.py) the model runs in bf16 on the ranks' GPUs (fp32 main params
in the optimizer, as in real training). bf16 keeps 8 significant bits (each rounding within
2^-9 relative); the forward and backward of this 4-layer model round about 32 tensors in
sequence, so the two layouts' gradients may differ by up to 32 · 2^-9 = 2^-4 of their size,
and so may the updates (UPDATE_RTOL_BF16, of each tensor's largest update). The updates are
read from the optimizer's fp32 main weights: the bf16 model weights would round them away
(a norm weight near 1.0 moves by ~1e-3, under half a bf16 spacing there). The loss is a mean
of fp32 cross-entropies near ln(vocab), computed from the same bf16 logits:
LOSS_RTOL_BF16 = 2^-8, one bf16 rounding. On fewer than 4 GPUs the 4-rank case becomes two 2-rank ones: TP2·PP1 and
TP1·PP2, each against TP1·PP1·DP2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.spawn import ON_GPU, max_ranks, run_on_ranks, test_device

VOCAB, SEQ, GLOBAL_BATCH = 128, 16, 4
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
LOSS_RTOL, UPDATE_RTOL = 1e-5, 1e-4  # fp32
LOSS_RTOL_BF16, UPDATE_RTOL_BF16 = 2.0**-8, 2.0**-4  # bf16 (cuda mode), see above
# The layouts compared with TP1·PP1 (one spawn each, world = tp·pp).
LAYOUTS = [(2, 2)] if max_ranks() >= 4 else [(2, 1), (1, 2)]


def _build(tp: int, pp: int):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=DTYPE,
        params_dtype=DTYPE,
        bf16=ON_GPU,
        use_cpu_initialization=not ON_GPU,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if ON_GPU:
        # torch norms are created in fp32 on the CPU whatever the config says.
        model.to(device=test_device(), dtype=DTYPE)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        # The distributed optimizer is Adam-only. A large eps keeps Adam's first step
        # (lr·g/(|g|+eps)) a smooth function of the gradient, so tiny fp32 differences in
        # g cannot flip a sign-like update.
        OptimizerConfig(
            optimizer="adam",
            lr=0.01,
            adam_eps=1e-2,
            weight_decay=0.0,
            use_distributed_optimizer=True,
            clip_grad=0.0,
            bf16=ON_GPU,
            params_dtype=DTYPE,
        ),
        [model],
    )
    return model, optimizer


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen).to(test_device())
    return tokens[:, :-1], tokens[:, 1:]


def _loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    # clone: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)
    return output, _loss_func


def _train_step(model, optimizer) -> float:
    """One forward/backward + SGD step on this rank's share of the global batch."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    tokens, labels = _global_batch()
    per_rank = GLOBAL_BATCH // dp_size
    tokens = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    labels = labels[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    micro_batch_size = 2 if per_rank >= 2 else 1
    num_microbatches = per_rank // micro_batch_size
    micro_batches = [
        (tokens[i : i + micro_batch_size], labels[i : i + micro_batch_size])
        for i in range(0, per_rank, micro_batch_size)
    ]
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    # Mean loss of the global batch, known on every rank.
    local = torch.tensor(
        sum(float(m["loss"]) for m in losses) / max(num_microbatches, 1)
        if parallel_state.is_pipeline_last_stage()
        else 0.0,
        device=test_device(),
    )
    dist.all_reduce(local, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    loss = local.item() / dp_size
    return loss


def _hold_fp32_main_weights(model, optimizer) -> None:
    """Point each bf16 model param at the optimizer's fp32 main weight, whole on every DP rank.

    Only for saving the stepped weights: the model computes nothing afterwards. The
    distributed optimizer keeps each DP rank's shard of a main weight (none, for some
    ranks); the shards are disjoint, so a sum over the DP group assembles them.
    """
    from megatron.core import parallel_state

    owned = {}  # model param -> (its range on this rank, the fp32 shard)
    # get_megatron_optimizer chains one optimizer per parameter group (e.g. no weight decay).
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = zip(part.shard_fp32_from_float16_groups, part.model_float16_groups)
        for shard_group, param_group in groups:
            for shard, param in zip(shard_group, param_group):
                owned[param] = (part._get_model_param_range_map(param)["param"], shard)
    # Every DP rank walks the same params in the same order, whatever it owns.
    for param in model.module.parameters():
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if param in owned:
            span, shard = owned[param]
            whole[span.start : span.end] = shard
        dist.all_reduce(whole, group=parallel_state.get_data_parallel_group())
        param.data = whole.view_as(param)


def _hold_fp32(model) -> None:
    """fp32 params, so that loading a checkpoint of fp32 weights does not round them."""
    for param in model.module.parameters():
        param.data = param.data.float()


def _weights(model) -> dict:
    """Sharded state dict of the weights (Megatron's per-layer extra state left out)."""
    state = model.module.sharded_state_dict()
    return {k: v for k, v in state.items() if "_extra_state" not in k}


def _save(model, path) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_weights(model), str(path))


def _load_flat(model, path) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_weights(model), str(path))
    return {k: v.clone() for k, v in loaded.items()}


def _load_into(model, path) -> None:
    loaded = _load_flat(model, path)
    model.module.load_state_dict(loaded, strict=False)


def _body(rank: int, world_size: int, tmp_path, tp: int, pp: int) -> None:
    results = {}
    # Phase A: the reference layout.
    model, optimizer = _build(tp=1, pp=1)
    _save(model, tmp_path / "init")
    results["A"] = _train_step(model, optimizer)
    optimizer.step()
    if ON_GPU:
        _hold_fp32_main_weights(model, optimizer)
    _save(model, tmp_path / "step_A")

    # Phase B: TP=tp, PP=pp from the same weights.
    model, optimizer = _build(tp=tp, pp=pp)
    _load_into(model, tmp_path / "init")
    # The optimizer's fp32 main params were copied at construction: refresh them.
    optimizer.reload_model_params()
    results["B"] = _train_step(model, optimizer)
    optimizer.step()
    if ON_GPU:
        _hold_fp32_main_weights(model, optimizer)
    _save(model, tmp_path / "step_B")

    # Phase C: compare in the TP1·PP1 layout.
    model, _ = _build(tp=1, pp=1)
    if ON_GPU:
        _hold_fp32(model)
    loss_rtol = LOSS_RTOL_BF16 if ON_GPU else LOSS_RTOL
    assert abs(results["A"] - results["B"]) < loss_rtol * abs(results["A"]), results
    # A random model predicts ~uniformly: the loss must be near ln(vocab), else the
    # comparison above could pass on garbage.
    assert abs(results["A"] - torch.log(torch.tensor(float(VOCAB))).item()) < 1.0, results
    init = _load_flat(model, tmp_path / "init")
    step_a = _load_flat(model, tmp_path / "step_A")
    step_b = _load_flat(model, tmp_path / "step_B")
    assert init.keys() == step_a.keys() == step_b.keys() and len(init) > 10
    for key in init:
        # Adam's first update is lr·g/(|g|+eps): a smooth, invertible function of the
        # averaged gradient, so equal updates mean equal gradients.
        w0, wa, wb = init[key].float(), step_a[key].float(), step_b[key].float()
        delta_a, delta_b = wa - w0, wb - w0
        scale = delta_a.abs().max()
        assert scale > 1e-6, f"the Adam step left {key} unchanged; the test would prove nothing"
        err = (delta_a - delta_b).abs().max() / scale
        update_rtol = UPDATE_RTOL_BF16 if ON_GPU else UPDATE_RTOL
        assert err < update_rtol, (
            f"update of {key} differs between TP1·PP1 and TP{tp}·PP{pp} by {err:.2e}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}_pp{pp}" for tp, pp in LAYOUTS])
def test_tp_pp_matches_tp1_pp1(tmp_path, tp, pp):
    run_on_ranks(_body, world_size=tp * pp, tmp_path=tmp_path, tp=tp, pp=pp)
