"""The family name tables' format: what it accepts, what it refuses, how layouts read it.

That each table's shard dims match the model megatron-core builds is checked on 2 ranks
(tests/multirank/test_name_tables.py); the conversions themselves by test_conversions.py,
test_reshard_plan.py and the HF round trips.
"""

from __future__ import annotations

import pytest

from rl_megatron.models.families import FAMILIES, llama
from rl_megatron.models.families.table import COPY, GATE_UP, QKV, Family, Rule, TableError
from rl_megatron.models.hf_config import SUPPORTED_MODEL_TYPES, parse_hf_config

M, H = llama.M, llama.H
_CFG = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_the_config_parser_accepts_exactly_the_registered_families():
    assert tuple(FAMILIES) == SUPPORTED_MODEL_TYPES
    moe = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    for model_type, table in FAMILIES.items():
        extra = moe if table.moe else {}
        info = parse_hf_config(dict(_CFG, model_type=model_type, sliding_window=8, **extra))
        assert info.is_moe == table.moe
        assert info.qkv_bias == table.qkv_bias
        assert info.qk_layernorm == table.qk_norm
        assert (info.sliding_window is not None) == table.sliding_window


def test_a_per_layer_tensor_is_one_more_row():
    # Qwen3's QK-norm: Llama's rows plus one replicated [head_dim] row each for q and k.
    table = FAMILIES["qwen3"]
    assert table.layers[: len(llama.LAYERS)] == llama.LAYERS and not table.qkv_bias
    assert [(r.megatron, r.hf, r.tp_dim, r.vllm_name) for r in table.rules[-4:-2]] == [
        (M + "self_attention.q_layernorm.weight", ((H + "self_attn.q_norm.weight", ("d",)),),
         None, H + "self_attn.q_norm.weight"),
        (M + "self_attention.k_layernorm.weight", ((H + "self_attn.k_norm.weight", ("d",)),),
         None, H + "self_attn.k_norm.weight"),
    ]  # fmt: skip
    info = parse_hf_config(dict(_CFG, model_type="qwen3", head_dim=32))
    assert info.qk_layernorm and info.head_dim == 32 != _CFG["hidden_size"] // 4


@pytest.mark.parametrize(
    "rule, message",
    [
        (
            Rule(M + "mlp.experts.linear_fc1.weight",
                 ((H + "mlp.experts.{expert}.gate_proj.weight", ("F", "h")),
                  (H + "mlp.experts.{expert}.up_proj.weight", ("F", "h"))), GATE_UP, 0,
                 vllm=H + "mlp.experts.w13_weight"),
            "fused expert tensors",
        ),
        (
            Rule(M + "self_attention.linear_qkv.weight",
                 ((H + "self_attn.q_proj.weight", ("Q", "h")),), QKV, 0),
            "qkv takes 3 HF tensor",
        ),
        (
            Rule(M + "mlp.linear_fc1.weight",
                 ((H + "mlp.gate_proj.weight", ("F", "h")),
                  (H + "mlp.up_proj.weight", ("F", "h"))), GATE_UP, 0),
            "needs its vLLM name",
        ),
        (Rule(M + "x.weight", (("model.x.weight", ("h",)),), COPY, None), "`{layer}`"),
        (Rule(M + "x.weight", ((H + "x.weight", ("h",)),), COPY, 1), "tp_dim 1 is not a dim"),
        (Rule(M + "x.weight", ((H + "x.weight", ("z",)),), COPY, None), "unknown shape symbols"),
    ],
)  # fmt: skip
def test_a_malformed_row_is_refused_in_one_line(rule, message):
    with pytest.raises(TableError, match=message) as err:
        Family("broken", "Broken", llama.LAYERS + (rule,))
    assert "\n" not in str(err.value)


def test_the_qkv_bias_flag_must_match_the_rows():
    with pytest.raises(TableError, match="qkv_bias=True but the table lacks"):
        Family("broken", "Broken", llama.LAYERS, qkv_bias=True)


def test_the_qk_norm_flag_must_match_the_rows():
    qwen3 = FAMILIES["qwen3"].layers
    with pytest.raises(TableError, match="qk_norm=True but the table has no q/k"):
        Family("broken", "Broken", llama.LAYERS, qk_norm=True)
    with pytest.raises(TableError, match=r"qk_norm=True but the table has \['q_layernorm'\]"):
        Family("broken", "Broken", qwen3[:-1], qk_norm=True)  # the k-norm row dropped
    with pytest.raises(TableError, match="qk_norm=False but"):
        Family("broken", "Broken", qwen3)


def test_vllm_reads_the_same_rows_a_bias_right_after_its_weight():
    from rl_megatron.resharding import shards
    from rl_megatron.rollout.vllm import specs as vllm_layout

    info = parse_hf_config(dict(_CFG, model_type="qwen2", tie_word_embeddings=True))
    names = [r.name.removeprefix(H) for r in vllm_layout.vllm_rules(info)]
    assert names == [
        "model.embed_tokens.weight",
        "input_layernorm.weight",
        "self_attn.qkv_proj.weight",
        "self_attn.qkv_proj.bias",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
        "model.norm.weight",  # tied: no lm_head
    ]
    # Megatron keeps the table's order, where qwen2's bias row follows llama's rows.
    assert [r.name for r in shards.megatron_rules(info)][7] == M + "self_attention.linear_qkv.bias"


def test_expert_rows_expand_one_per_expert_with_the_stored_key():
    from rl_megatron.checkpoint import hf_mapping as hm

    cfg = dict(_CFG, model_type="mixtral", num_local_experts=3, num_experts_per_tok=2)
    info = parse_hf_config(cfg)
    rules = hm.rules_for(info)
    fc1 = [r for r in rules if r.megatron.endswith("linear_fc1.weight")]
    assert [r.expert for r in fc1] == [0, 1, 2]
    assert fc1[2].megatron == M + "mlp.experts.experts.2.linear_fc1.weight"
    assert fc1[2].hf[1][0] == H + "block_sparse_moe.experts.2.w3.weight"
    assert hm.stored_layer_key(fc1[2]) == "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    shapes = hm.expected_hf_tensors(rules, info)
    assert shapes["model.layers.1.block_sparse_moe.experts.2.w2.weight"] == (64, 96)
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == (3, 64)
    # Module names of both expert implementations map to the global expert's row.
    names = {r.megatron for r in rules}
    for module in ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
                   "decoder.layers.0.mlp.experts.linear_fc2.weight1"):  # fmt: skip
        got = hm.canonical_param_name(module, lambda i: i + 1, lambda i: i + 1, names)
        assert got == (M + "mlp.experts.experts.2.linear_fc2.weight", 1)
    # An MoE layer's pre-MLP norm keeps its name; a dense layer's is TE's fused one.
    norm = "decoder.layers.0.pre_mlp_layernorm.weight"
    assert hm.canonical_param_name(norm, int, None, names)[0] == M + "pre_mlp_layernorm.weight"
    assert hm.canonical_param_name(norm, int)[0] == M + "mlp.linear_fc1.layer_norm_weight"
