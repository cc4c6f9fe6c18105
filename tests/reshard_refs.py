"""Tiny models and HF-slicing references for the resharding tests.

The references build each engine's shard straight from the HF tensors with the pure
conversions of `models.conversions` (and, for Megatron, the checkpoint loader's
`hf_to_megatron_shard`) — a different code path from the plan's row arithmetic.
"""

from __future__ import annotations

import torch

from rl_megatron.checkpoint import hf_mapping as hm
from rl_megatron.models import conversions as cv
from rl_megatron.models.hf_config import HFModelInfo, parse_hf_config

# 4 layers (pp=4, or pp=2 × vpp=2); 8 query heads in 4 KV groups, so tp ≤ 4 splits them.
_BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
MODELS: dict[str, dict] = {
    # GQA, untied head, vocabulary a multiple of every padding (512 = 128·4 = 64·8).
    "llama_gqa": dict(_BASE, model_type="llama", vocab_size=512, tie_word_embeddings=False),
    # QKV bias, tied embeddings.
    "qwen2_tied": dict(_BASE, model_type="qwen2", vocab_size=512, tie_word_embeddings=True),
    # Vocabulary padded differently by Megatron (128·t) and vLLM (64); tied as well, so
    # the last PP stage holds its own padded copy of the embedding. Qwen3: QK-norm
    # (replicated [head_dim] rows in every layout) and head_dim 16 != hidden / heads, so q
    # and o_proj are wider than hidden.
    "qwen3_padded_vocab": dict(
        _BASE, model_type="qwen3", vocab_size=100, head_dim=16, tie_word_embeddings=True
    ),
}

LAYOUTS = [(1, 1, 4), (2, 1, 2), (4, 1, 1), (2, 2, 1), (1, 2, 2), (1, 4, 1)]
ROLLOUT_TPS = (1, 2, 4)
# Every (t, p, d) of 2 ranks: what a 2-GPU machine can run (tests/spawn.py, cuda mode).
LAYOUTS_2 = [(1, 1, 2), (2, 1, 1), (1, 2, 1)]


def layouts_for(world: int) -> list[tuple[int, int, int]]:
    """The training layouts (t, p, d) of `world` ranks that the multi-rank tests cover."""
    return {4: LAYOUTS, 2: LAYOUTS_2}[world]


def model_info(name: str) -> HFModelInfo:
    return parse_hf_config(MODELS[name])


def random_hf_state(info: HFModelInfo, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under every HF name the model has, distinct values everywhere."""
    g = torch.Generator().manual_seed(seed)
    shapes = hm.expected_hf_tensors(hm.rules_for(info, "lm"), info)
    return {name: torch.randn(shape, generator=g) for name, shape in sorted(shapes.items())}


def hf_reader(state: dict[str, torch.Tensor]):
    def read(name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
        t = state[name]
        return t if dim is None else t.narrow(dim, start, end - start)

    return read


def megatron_reference(
    state: dict[str, torch.Tensor], info: HFModelInfo, tp: int, tp_rank: int, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """What a Megatron model at TP `tp`, PP 1 holds on `tp_rank` after loading HF itself."""
    out = {}
    read = hf_reader(state)
    for rule in hm.rules_for(info, "lm"):
        if rule.megatron == "output_layer.weight" and info.tie_word_embeddings:
            continue  # pp = 1: the head is the embedding
        layers = range(info.num_layers) if "{layer}" in rule.megatron else [None]
        for layer in layers:
            out[rule.megatron.format(layer=layer)] = hm.hf_to_megatron_shard(
                rule, layer, read, info, tp, tp_rank, padded_vocab
            )
    return out


def vllm_reference(
    state: dict[str, torch.Tensor], info: HFModelInfo, tp: int, tp_rank: int, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """What vLLM at TP `tp` holds on `tp_rank` after loading HF itself (checkpoint format)."""
    d, ng = info.head_dim, info.num_key_value_heads

    def rank_of(t: torch.Tensor, dim: int) -> torch.Tensor:
        return cv.tp_split(t, tp, dim)[tp_rank]

    def kv(t: torch.Tensor) -> torch.Tensor:
        if tp <= ng:
            return rank_of(t, 0)
        head = tp_rank // (tp // ng)  # vLLM replicates KV heads beyond tp = ng
        return t[head * d : (head + 1) * d]

    out = {
        "model.embed_tokens.weight": rank_of(
            cv.pad_vocab(state["model.embed_tokens.weight"], padded_vocab), 0
        ),
        "model.norm.weight": state["model.norm.weight"],
    }
    if not info.tie_word_embeddings:
        out["lm_head.weight"] = rank_of(cv.pad_vocab(state["lm_head.weight"], padded_vocab), 0)
    for i in range(info.num_layers):
        hf = f"model.layers.{i}."
        for leaf in ("weight", "bias") if info.qkv_bias else ("weight",):
            q, k, v = (state[f"{hf}self_attn.{x}_proj.{leaf}"] for x in "qkv")
            out[f"{hf}self_attn.qkv_proj.{leaf}"] = torch.cat([rank_of(q, 0), kv(k), kv(v)])
        out[f"{hf}self_attn.o_proj.weight"] = rank_of(state[f"{hf}self_attn.o_proj.weight"], 1)
        fused = cv.fuse_gate_up(
            state[f"{hf}mlp.gate_proj.weight"], state[f"{hf}mlp.up_proj.weight"]
        )
        out[f"{hf}mlp.gate_up_proj.weight"] = cv.split_gated_shards(fused, tp)[tp_rank]
        out[f"{hf}mlp.down_proj.weight"] = rank_of(state[f"{hf}mlp.down_proj.weight"], 1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{hf}{norm}.weight"] = state[f"{hf}{norm}.weight"]
        if info.qk_layernorm:  # vLLM's Qwen3: whole on every rank
            for norm in ("self_attn.q_norm", "self_attn.k_norm"):
                out[f"{hf}{norm}.weight"] = state[f"{hf}{norm}.weight"]
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str):
    """Same names, shapes, dtypes and bits (NaN never equals: unwritten rows fail)."""
    assert set(got) == set(want), f"{where}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    for name, expect in want.items():
        have = got[name]
        assert have.shape == expect.shape, f"{where} {name}: {have.shape} != {expect.shape}"
        assert have.dtype == expect.dtype, f"{where} {name}: {have.dtype} != {expect.dtype}"
        same = torch.equal(have, expect)
        assert same, f"{where} {name}: {(have != expect).sum().item()} elements differ"


# Mixtures of experts (tests/unit/test_reshard_moe.py, tests/multirank/test_reshard_moe.py):
# 4 layers, 4 experts of width 64 (Fe/4 = 16 rows per TP-4 shard), top-2.
_MOE_BASE = dict(_BASE, num_experts_per_tok=2, moe_intermediate_size=64)
MOE_MODELS: dict[str, dict] = {
    "qwen3_moe": dict(
        _MOE_BASE, model_type="qwen3_moe", vocab_size=100, head_dim=16, num_experts=4,
        norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "mixtral": dict(
        _MOE_BASE, model_type="mixtral", vocab_size=512, num_local_experts=4,
        intermediate_size=64, tie_word_embeddings=False,
    ),
}  # fmt: skip
# HF names of one layer's MoE block: router, then expert e's gate, up and down projections.
MOE_HF_NAMES = {
    "qwen3_moe": ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
}


def moe_vllm_reference(
    state: dict[str, torch.Tensor], info: HFModelInfo, tp: int, tp_rank: int, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """vLLM at TP `tp` (no expert parallelism) on `tp_rank` after loading HF itself: every
    expert on every rank, `w13_weight [E, 2·Fe/tp, h]` (expert e's [gate_r; up_r]) and
    `w2_weight [E, h, Fe/tp]` (its down_proj columns of r) under `<moe>.experts.routed_experts`
    (vllm/model_executor/layers/fused_moe/routed_experts.py, `_load_w13` / `_load_w2`)."""
    router, expert, (gate, up, down) = MOE_HF_NAMES[info.model_type]
    dense = {k: v for k, v in state.items() if ".experts." not in k and router not in k}
    out = vllm_reference(_with_dense_mlp(dense, info), info, tp, tp_rank, padded_vocab)
    for i in range(info.num_layers):
        hf = f"model.layers.{i}."
        for leaf in ("mlp.gate_up_proj.weight", "mlp.down_proj.weight"):
            out.pop(hf + leaf)
        out[f"{hf}{router}.weight"] = state[f"{hf}{router}.weight"]
        w13, w2 = [], []
        for e in range(info.num_experts):
            x = hf + expert.format(e=e)
            g = cv.tp_split(state[f"{x}{gate}.weight"], tp, 0)[tp_rank]
            u = cv.tp_split(state[f"{x}{up}.weight"], tp, 0)[tp_rank]
            w13.append(torch.cat([g, u]))
            w2.append(cv.tp_split(state[f"{x}{down}.weight"], tp, 1)[tp_rank])
        moe = hf + router.rsplit(".", 1)[0] + ".experts.routed_experts."
        out[moe + "w13_weight"] = torch.stack(w13)
        out[moe + "w2_weight"] = torch.stack(w2)
    return out


def _with_dense_mlp(state: dict[str, torch.Tensor], info: HFModelInfo) -> dict:
    """`state` plus placeholder dense-MLP tensors, so `vllm_reference` runs on an MoE model
    (the caller drops what it makes of them)."""
    out = dict(state)
    for i in range(info.num_layers):
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.{leaf}.weight"] = torch.zeros(4 * 16, 4 * 16)
    return out
