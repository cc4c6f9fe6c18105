"""A tiny GPTModel's hidden states → chunked log-probs equal its logits → vocab_parallel.

Two ranks (TP=2), an untied and a tied LM head, with and without sequence parallelism.
Path A is what the roles compute today: the model's `[b, s, V/tp]` logits, the response
columns gathered, `vocab_parallel_log_probs_and_entropy`. Path B: the same model inside
`output_hidden_states` returns `[b, s, h]`, the same columns gathered, then
`chunked_log_probs_and_entropy` with `output_weight(model)` and a chunk size that does
not divide the tokens. Both backward the same loss (upstream gradients N(0, 1) on
log-probs and entropy); the log-probs, entropies and every parameter's gradient on each
rank must agree (with sequence parallelism the norms' gradients are each rank's partial
sums, before megatron's finalize_model_grads: compared as they are).

Tolerance: fp32 model, 2e-5 absolute + 1e-4 relative. The two paths differ only in fp32
summation order: the output-layer GEMM per chunk instead of whole, the weight gradient
summed over chunks, and the TP statistics re-based from each rank's max instead of
shifted by the group's max.
"""

from __future__ import annotations

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.spawn import run_on_ranks

TP = 2
B, PROMPT, RESPONSE = 2, 5, 7  # sequence P + R = 12, divisible by TP for sequence parallel
TEMPERATURE = 0.8


def _backward(lp, ent, g_lp, g_ent) -> None:
    """Backward of sum(g_lp * lp + g_ent * ent), under the CPU shim's device mode.

    `loss.backward()` enters the shim's TorchFunctionMode (`cpu_compat`), which calls the
    real backward with the mode popped, so the autograd graph task runs without it; the
    sequence-parallel backward of megatron's ColumnParallelLinear then allocates on
    `torch.cuda.current_device()` and fails on a CPU. Calling the engine directly keeps
    the mode on for the backward. Nothing else differs from `loss.backward()`.
    """
    import torch

    from tests.spawn import ON_GPU

    loss = (lp * g_lp).sum() + (ent * g_ent).sum()
    if ON_GPU:
        loss.backward()
        return
    torch.autograd.graph._engine_run_backward(
        (loss,),
        (torch.ones_like(loss),),
        False,
        False,
        (),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _build(info, sequence_parallel: bool):
    """The builder's model; with sequence parallelism a local spec whose norms accept it.

    Without Transformer Engine or apex, megatron-core's torch norm refuses
    `sequence_parallel` (torch_norm.py asserts), though an RMSNorm is per token and
    runs unchanged on a sequence shard: the test swaps in torch's RMSNorm, marked as
    megatron marks sequence-parallel norm weights.
    """
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.hf_config import gpt_model_kwargs, transformer_config_from_hf
    from rl_megatron.models.specs import local_sdpa_layer_spec
    from tests.spawn import test_device

    if not sequence_parallel:
        (model,) = build_gpt_chunks(
            info,
            ParallelLayout.from_megatron(),
            dtype=torch.float32,
            make_vocab_size_divisible_by=8,
        )
        return model

    class Norm(torch.nn.RMSNorm):
        def __init__(self, config, hidden_size, eps=1e-5, **_):
            super().__init__(hidden_size, eps=eps)
            self.weight.sequence_parallel = config.sequence_parallel

    config = transformer_config_from_hf(
        info, tp=TP, pp=1, dtype=torch.float32, sequence_parallel=True
    )
    layer = local_sdpa_layer_spec()
    layer.submodules.input_layernorm = Norm
    layer.submodules.pre_mlp_layernorm = Norm
    block = TransformerBlockSubmodules(layer_specs=[layer] * info.num_layers, layer_norm=Norm)
    kwargs = gpt_model_kwargs(info, tp=TP, make_vocab_size_divisible_by=8)
    model = GPTModel(config, block, pre_process=True, post_process=True, **kwargs)
    model.true_vocab_size = info.vocab_size
    return model.to(device=test_device(), dtype=torch.float32)  # the norms start on the CPU


def _check(sequence_parallel: bool, tied: bool) -> None:
    import torch
    from megatron.core import parallel_state as ps

    from rl_megatron.models.chunked_logprobs import (
        chunked_log_probs_and_entropy,
        output_hidden_states,
        output_weight,
    )
    from rl_megatron.models.hf_config import parse_hf_config
    from rl_megatron.models.vocab_parallel import vocab_parallel_log_probs_and_entropy
    from tests.spawn import test_device

    info = parse_hf_config(
        dict(
            model_type="llama",
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
        )
    )
    # Padded to 112: rank 1 holds ids 56..111, of which 100..111 are padding.
    model = _build(info, sequence_parallel)
    assert model.share_embeddings_and_output_weights == tied
    assert model.output_layer.sequence_parallel == sequence_parallel
    tp_group = ps.get_tensor_model_parallel_group()
    device = test_device()
    gen = torch.Generator().manual_seed(1)  # the same inputs on both ranks
    ids = torch.randint(0, 100, (B, PROMPT + RESPONSE), generator=gen).to(device)
    pos = torch.arange(PROMPT + RESPONSE).expand(B, -1).to(device)
    labels = ids[:, PROMPT:]
    cols = slice(PROMPT - 1, PROMPT + RESPONSE - 1)  # the columns predicting the responses
    g_lp, g_ent = torch.randn(2, B, RESPONSE, generator=gen).to(device).unbind()

    logits = model(ids, pos, None)
    assert logits.shape == (B, PROMPT + RESPONSE, 56)
    lp, ent = vocab_parallel_log_probs_and_entropy(
        logits[:, cols], labels, tp_group, TEMPERATURE, info.vocab_size
    )
    _backward(lp, ent, g_lp, g_ent)
    want = _grads(model)
    model.zero_grad(set_to_none=True)

    with output_hidden_states(model):
        hidden = model(ids, pos, None)
    assert hidden.shape == (B, PROMPT + RESPONSE, 64)
    c_lp, c_ent = chunked_log_probs_and_entropy(
        hidden[:, cols],
        output_weight(model),
        labels,
        tp_group,
        temperature=TEMPERATURE,
        vocab_size=info.vocab_size,
        chunk_tokens=4,  # 14 tokens: chunks of 4, 4, 4, 2
    )
    _backward(c_lp, c_ent, g_lp, g_ent)
    got = _grads(model)

    tol = dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(c_lp, lp.detach(), **tol)
    torch.testing.assert_close(c_ent, ent.detach(), **tol)
    assert got.keys() == want.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, **tol, msg=lambda m, n=name: f"{n}: {m}")
    # Restored on exit: logits again.
    assert model(ids, pos, None).shape == logits.shape


def _body(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(TP, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    for sequence_parallel in (False, True):
        for tied in (False, True):
            try:
                _check(sequence_parallel, tied)
            except AssertionError as e:
                raise AssertionError(
                    f"rank {rank}, sequence_parallel={sequence_parallel}, tied={tied}: {e}"
                ) from e


def test_hidden_path_matches_logits_path_tp2():
    run_on_ranks(_body, world_size=TP)


def _refusals(rank: int, world_size: int) -> None:
    import pytest
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.chunked_logprobs import output_hidden_states
    from rl_megatron.models.hf_config import parse_hf_config

    ps.initialize_model_parallel(1, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    info = parse_hf_config(
        dict(
            model_type="llama",
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    (critic,) = build_gpt_chunks(
        info, ParallelLayout.from_megatron(), dtype=torch.float32, value_head=True
    )
    with pytest.raises(ValueError, match="value heads"), output_hidden_states(critic):
        pass
    (lm,) = build_gpt_chunks(info, ParallelLayout.from_megatron(), dtype=torch.float32)
    with output_hidden_states(lm), pytest.raises(RuntimeError, match="already active"):  # noqa: SIM117
        with output_hidden_states(lm):
            pass
    assert "forward" not in vars(lm.output_layer)  # the outer block restored it


def test_refusals_one_rank():
    run_on_ranks(_refusals, world_size=1)
