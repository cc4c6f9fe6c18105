"""Tiny Llama checkpoints and `transformers` reference generation for the rollout tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, PAD, EOS_CONFIG = 128, 0, 2


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """2 layers, hidden 64, GQA (4 heads, 2 KV heads, head_dim 32: the vLLM CPU kernels'
    minimum), untied head, fp32.

    initializer_range 0.1 (not 0.02) so that logits are peaked enough for greedy parity.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=EOS_CONFIG,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Stop only where a test asks (generate(eos_token_id=...)), never by default.
    model.generation_config.eos_token_id = None
    return model


@torch.no_grad()
def hf_greedy(
    model: LlamaForCausalLM, prompt: list[int], max_new: int, eos: int | None = None
) -> tuple[list[int], float]:
    """transformers greedy generation; returns the tokens and the smallest top-1 lead."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        output_scores=True,
        return_dict_in_generate=True,
    )
    scores = torch.stack(out.scores, 1)[0]
    top2 = scores.topk(2, dim=-1).values
    return out.sequences[0, len(prompt) :].tolist(), (top2[:, 0] - top2[:, 1]).min().item()


@torch.no_grad()
def hf_log_probs(
    model: LlamaForCausalLM, prompt: list[int], response: list[int], temperature: float
) -> list[float]:
    """log softmax(logits / T) of each response token, from one forward pass."""
    logits = model(torch.tensor([prompt + response])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def pick_mid_batch_eos(greedy_rows: list[list[int]]) -> int:
    """A token that some row reaches mid-way (first at step >= 1, before the last 2 steps)
    and some other row never produces: stopping on it ends one response early, not all."""
    for row in greedy_rows:
        for t in row[1:-2]:
            if row.index(t) >= 1 and any(t not in other for other in greedy_rows):
                return t
    raise AssertionError("no token suits a mid-batch EOS; change the prompts' seed")
