"""HF config.json → Megatron config: supported fields map exactly, the rest are refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rl_megatron.models import hf_config as hc


def _llama(**kw) -> dict:
    from transformers import LlamaConfig

    base = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    )
    base.update(kw)
    return LlamaConfig(**base).to_dict()


def test_llama31_rope_scaling_both_spellings():
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    new = hc.parse_hf_config(
        _llama(max_position_embeddings=131072, rope_scaling=rope, rope_theta=500000.0)
    )
    assert "rope_parameters" in _llama()  # transformers 5 writes the new spelling
    old = dict(
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(rope, type="llama3"),
        max_position_embeddings=131072,
    )
    for info in (new, hc.parse_hf_config(old)):
        assert (info.rope_type, info.rope_factor, info.rope_theta) == ("llama3", 8.0, 500000.0)
        kw = hc.gpt_model_kwargs(info, tp=2)
        assert kw["rope_scaling"] and kw["rope_scaling_factor"] == 8.0
        assert kw["rotary_base"] == 500000.0
    assert new.num_key_value_heads == 2 and new.head_dim == 16 and new.rms_norm_eps == 1e-5


def test_qwen2_bias_and_tied_embeddings():
    from transformers import Qwen2Config

    info = hc.parse_hf_config(
        Qwen2Config(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ).to_dict()
    )
    assert info.qkv_bias and info.tie_word_embeddings
    assert hc.gpt_model_kwargs(info)["share_embeddings_and_output_weights"]


def test_mistral_sliding_window_and_transformer_config():
    from transformers import MistralConfig

    info = hc.parse_hf_config(
        MistralConfig(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
        ).to_dict()
    )
    assert info.sliding_window == 8 and info.head_dim == 32
    cfg = hc.transformer_config_from_hf(
        info, tp=2, pp=2, dtype=torch.float32, use_cpu_initialization=True
    )
    assert cfg.window_size == (7, 0)  # 7 keys before the query, plus itself = HF's 8
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.ffn_hidden_size) == (2, 32, 96)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.layernorm_epsilon == info.rms_norm_eps and not cfg.add_qkv_bias


def _qwen3(**kw) -> dict:
    from transformers import Qwen3Config

    base = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    )
    return Qwen3Config(**{**base, **kw}).to_dict()


def test_qwen3_qk_norm_head_dim_and_tied_embeddings():
    info = hc.parse_hf_config(_qwen3(rope_theta=1e6))
    assert info.qk_layernorm and not info.qkv_bias and info.tie_word_embeddings
    assert info.head_dim == 32 and info.rope_theta == 1e6  # head_dim != hidden / heads (16)
    cfg = hc.transformer_config_from_hf(info, tp=2, dtype=torch.float32)
    assert cfg.qk_layernorm and cfg.kv_channels == 32 and not cfg.add_qkv_bias
    assert hc.gpt_model_kwargs(info)["share_embeddings_and_output_weights"]
    assert not hc.transformer_config_from_hf(hc.parse_hf_config(_llama())).qk_layernorm


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(attention_bias=True), "attention_bias=true is not supported for qwen3"),
        (dict(use_sliding_window=True), "use_sliding_window=true is not supported for qwen3"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "use_sliding_window"),
    ],
)
def test_qwen3_refusals(change, field):
    with pytest.raises(hc.HFConfigError, match=field) as err:
        hc.parse_hf_config({**_qwen3(), **change})
    assert "\n" not in str(err.value)


def test_vocab_padding_follows_tp():
    info = hc.parse_hf_config(_llama())
    assert hc.gpt_model_kwargs(info, tp=1)["vocab_size"] == 128
    assert hc.gpt_model_kwargs(info, tp=2)["vocab_size"] == 256
    assert hc.gpt_model_kwargs(info, tp=2, padded_vocab=128)["vocab_size"] == 128
    with pytest.raises(hc.HFConfigError, match="padded vocab 96"):
        hc.gpt_model_kwargs(info, padded_vocab=96)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(model_type="gpt2"), "model_type='gpt2'"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(attention_bias=True), "attention_bias"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
            "rope_parameters.rope_type='yarn'",
        ),
        (
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "rope_theta": 1e4,
                }
            ),
            "rope_parameters.low_freq_factor",
        ),
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(hidden_size=None), "'hidden_size' is missing"),
    ],
)
def test_refusals_name_the_field(change, field):
    cfg = _llama()
    cfg.update(change)
    with pytest.raises(hc.HFConfigError) as err:
        hc.parse_hf_config(cfg)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_qwen2_sliding_window_refused():
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=100, hidden_size=64, num_attention_heads=4, num_hidden_layers=2
    ).to_dict()
    cfg["use_sliding_window"] = True
    with pytest.raises(hc.HFConfigError, match="use_sliding_window"):
        hc.parse_hf_config(cfg)


def test_parallel_layout_errors():
    info = hc.parse_hf_config(_llama())
    with pytest.raises(hc.HFConfigError, match="num_key_value_heads=2 is not divisible by tp=4"):
        hc.check_parallel_layout(info, tp=4, pp=1)
    with pytest.raises(hc.HFConfigError, match="num_hidden_layers=4 is not divisible by pp"):
        hc.check_parallel_layout(info, tp=1, pp=3)
    hc.check_parallel_layout(info, tp=2, pp=2, vpp=2)


def test_missing_config_and_tokenizer_vocab(tmp_path):
    with pytest.raises(hc.HFConfigError, match="config.json: not found"):
        hc.load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_llama()))
    info = hc.load_hf_config(tmp_path)
    assert hc.tokenizer_vocab_size(tmp_path) is None
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(120)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    assert hc.tokenizer_vocab_size(tmp_path) == 120
    with pytest.raises(
        hc.HFConfigError, match="tokenizer has 120 tokens but config.json vocab_size=100"
    ):
        hc.check_tokenizer_vocab(tmp_path, info)


_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)


def test_moe_router_settings_follow_hf():
    qwen = hc.parse_hf_config(_QWEN3_MOE)
    assert (qwen.num_experts, qwen.moe_topk, qwen.moe_ffn_hidden_size) == (8, 2, 48)
    cfg = hc.transformer_config_from_hf(qwen, dtype=torch.float32, ep=2)
    assert cfg.num_moe_experts == 8 and cfg.moe_router_topk == 2 and cfg.moe_ffn_hidden_size == 48
    # renormalised top-k = softmax over the top-k logits: megatron-core's default
    assert cfg.moe_router_pre_softmax is False and cfg.moe_router_score_function == "softmax"
    assert cfg.moe_aux_loss_coeff == 0 and cfg.moe_z_loss_coeff is None
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.moe_grouped_gemm is False
    assert cfg.expert_model_parallel_size == 2 and cfg.expert_tensor_parallel_size == 1
    unnormed = hc.parse_hf_config(dict(_QWEN3_MOE, norm_topk_prob=False))
    assert hc.transformer_config_from_hf(unnormed, dtype=torch.float32).moe_router_pre_softmax
    mixtral = hc.parse_hf_config(
        dict(_QWEN3_MOE, model_type="mixtral", num_local_experts=8, intermediate_size=40)
    )
    assert mixtral.moe_ffn_hidden_size == 40 and mixtral.moe_norm_topk_prob


@pytest.mark.parametrize(
    "change, field",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
        ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ],
)
def test_moe_refusals_name_the_key(change, field):
    cfg = dict(_QWEN3_MOE, num_local_experts=8, **change)
    with pytest.raises(hc.HFConfigError, match=re.escape(f"config.json: {field}")) as err:
        hc.parse_hf_config(cfg)
    assert "\n" not in str(err.value)


def test_moe_parallel_layout_errors():
    info = hc.parse_hf_config(_QWEN3_MOE)
    with pytest.raises(hc.HFConfigError, match="num_experts=8 is not divisible by ep=3"):
        hc.check_parallel_layout(info, 1, 1, ep=3)
    with pytest.raises(
        hc.HFConfigError, match="moe_intermediate_size=48 is not divisible by etp=5"
    ):
        hc.check_parallel_layout(info, 1, 1, etp=5)
    dense = hc.parse_hf_config(dict(_QWEN3_MOE, model_type="qwen3"))
    with pytest.raises(hc.HFConfigError, match="has no experts to split over ep=2"):
        hc.check_parallel_layout(dense, 1, 1, ep=2)
