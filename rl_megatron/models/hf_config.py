"""Hugging Face `config.json` → Megatron `TransformerConfig` and `GPTModel` arguments.

Supported: Llama 2 / 3 / 3.1 / 3.2 (`rope_scaling` of type `llama3` or `linear`), Qwen2 /
Qwen2.5 (QKV bias, tied embeddings on the small models), Mistral (GQA, optional sliding
window) and Qwen3 dense (QK-norm, an explicit head_dim, tied embeddings on the small
models). Anything else is refused with a one-line `HFConfigError` naming the field, before a
model is built. Both config spellings are read: transformers ≥ 5 (`rope_parameters`) and
older (`rope_theta` + `rope_scaling`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from rl_megatron.models.conversions import padded_vocab_size
from rl_megatron.models.families import FAMILIES

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# Megatron's RotaryEmbedding implements Llama 3 scaling with these three constants fixed;
# every released Llama 3.x uses them, so a config with other values is refused, not
# silently mis-rotated.
_MEGATRON_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class HFConfigError(ValueError):
    """An HF config the converters cannot represent exactly; the message is one line."""


@dataclasses.dataclass(frozen=True)
class HFModelInfo:
    """The architecture facts of an HF checkpoint that the Megatron model must reproduce."""

    model_type: str  # a family of `models/families/` ("llama" | "qwen2" | "mistral" | "qwen3")
    vocab_size: int  # true vocabulary (embedding rows in the HF checkpoint)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str  # "default" | "llama3" | "linear"
    rope_factor: float  # scaling factor for llama3 / linear, 1.0 otherwise
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_layernorm: bool  # RMSNorm on each head's q and k before RoPE (Qwen3)
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None  # keys a query may see, itself included (Mistral v0.1)
    initializer_range: float
    num_labels: int  # rows of `score.weight` in *ForSequenceClassification checkpoints
    torch_dtype: str | None  # dtype the checkpoint was saved in, as in config.json
    sequence_classifier: bool  # architectures name a *ForSequenceClassification (reward model)

    @property
    def head(self) -> str:
        """The checkpoint's own head: "value" (`score.weight`) or "lm" (`lm_head.weight`)."""
        return "value" if self.sequence_classifier else "lm"


def _need(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise HFConfigError(f"config.json: required field '{key}' is missing")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[float, str, float]:
    """(theta, type, factor) from either config spelling; refuses unknown scaling types."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if params:  # transformers >= 5: theta and scaling in one dict
        scaling, field = params, "rope_parameters"
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        field = "rope_scaling"
        theta = cfg.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), "default", 1.0
    if rope_type == "linear":
        return float(theta), "linear", float(scaling["factor"])
    if rope_type == "llama3":
        for key, want in _MEGATRON_LLAMA3_FIXED.items():
            if float(scaling.get(key, want)) != float(want):
                raise HFConfigError(
                    f"config.json: {field}.{key}={scaling.get(key)} is not supported "
                    f"(Megatron's llama3 rope scaling fixes it to {want})"
                )
        return float(theta), "llama3", float(scaling["factor"])
    raise HFConfigError(
        f"config.json: {field}.rope_type='{rope_type}' is not supported "
        "(supported: default, linear, llama3)"
    )


def parse_hf_config(cfg: dict[str, Any]) -> HFModelInfo:
    """Validate an HF config dict (the contents of `config.json`) and extract what we need."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(
            f"config.json: model_type='{model_type}' is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFConfigError(
            f"config.json: hidden_act='{cfg['hidden_act']}' is not supported (silu)"
        )
    if cfg.get("mlp_bias"):
        raise HFConfigError("config.json: mlp_bias=true is not supported")
    if model_type in ("llama", "qwen3") and cfg.get("attention_bias"):
        # Their attention_bias also biases o_proj, which Megatron can only express by
        # biasing every linear layer.
        raise HFConfigError(f"config.json: attention_bias=true is not supported for {model_type}")
    if cfg.get("pretraining_tp", 1) != 1:
        raise HFConfigError(f"config.json: pretraining_tp={cfg['pretraining_tp']} is not supported")
    if model_type in ("qwen2", "qwen3") and (
        cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or [])
    ):
        raise HFConfigError(
            f"config.json: use_sliding_window=true is not supported for {model_type}"
        )
    if model_type == "llama" and "sliding_attention" in (cfg.get("layer_types") or []):
        raise HFConfigError("config.json: layer_types with sliding_attention is not supported")

    hidden = int(_need(cfg, "hidden_size"))
    heads = int(_need(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise HFConfigError(
            f"config.json: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, rope_type, factor = _rope(cfg)
    table = FAMILIES[model_type]
    window = cfg.get("sliding_window") if table.sliding_window else None
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if window is not None and window >= max_pos:
        window = None  # a window as long as the context never masks anything
    num_labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1
    return HFModelInfo(
        model_type=model_type,
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_need(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        ffn_hidden_size=int(_need(cfg, "intermediate_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_factor=factor,
        qkv_bias=table.qkv_bias,
        qk_layernorm=table.qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        sliding_window=int(window) if window else None,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        num_labels=int(num_labels),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        sequence_classifier=any(
            a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or []
        ),
    )


def load_hf_config(hf_dir: str | Path) -> HFModelInfo:
    """Read and validate `<hf_dir>/config.json`."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: not found (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HFConfigError(f"{path}: unreadable ({exc})") from None
    return parse_hf_config(cfg)


def check_parallel_layout(info: HFModelInfo, tp: int, pp: int, vpp: int | None = None) -> None:
    """Refuse TP/PP/VPP sizes the model cannot be split into, naming the field."""
    for field, value in (
        ("num_attention_heads", info.num_attention_heads),
        ("num_key_value_heads", info.num_key_value_heads),
        ("intermediate_size", info.ffn_hidden_size),
    ):
        if value % tp:
            raise HFConfigError(f"config.json: {field}={value} is not divisible by tp={tp}")
    stages = pp * (vpp or 1)
    if info.num_layers % stages:
        raise HFConfigError(
            f"config.json: num_hidden_layers={info.num_layers} is not divisible by pp*vpp={stages}"
        )


def transformer_config_from_hf(
    info: HFModelInfo,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    use_cpu_initialization: bool | None = None,
    perform_initialization: bool = True,
    **overrides: Any,
):
    """Build the Megatron `TransformerConfig` that computes what the HF model computes.

    Args:
        info: parsed HF config.
        tp, pp, vpp: tensor / pipeline / virtual-pipeline sizes (vpp None or 1 = none).
        dtype: parameter and activation dtype (fp32, bf16 or fp16).
        use_cpu_initialization: default True when CUDA is absent.
        perform_initialization: False skips random init (weights are loaded right after).
        overrides: any other `TransformerConfig` field (fusions, recompute, ...).
    """
    from megatron.core.transformer import TransformerConfig

    check_parallel_layout(info, tp, pp, vpp)
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        num_attention_heads=info.num_attention_heads,
        num_query_groups=info.num_key_value_heads,
        kv_channels=info.head_dim,
        ffn_hidden_size=info.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=info.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=info.qkv_bias,
        # q_layernorm / k_layernorm in the layer spec (models/specs.py), and the sum of
        # their gradients over TP in megatron-core's finalize_model_grads.
        qk_layernorm=info.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # HF computes the attention softmax in fp32 whatever the weights' dtype.
        attention_softmax_in_fp32=True,
        init_method_std=info.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        # Megatron's window (left, right) counts keys besides the query itself.
        window_size=(info.sliding_window - 1, 0) if info.sliding_window else None,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model_kwargs(
    info: HFModelInfo,
    *,
    tp: int = 1,
    make_vocab_size_divisible_by: int = 128,
    padded_vocab: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `GPTModel(...)` besides config, layer spec and pre/post_process.

    `padded_vocab` overrides the computed padding (a checkpoint fixes its own padding); it
    must be divisible by `tp` and at least the true vocabulary.
    """
    vocab = padded_vocab or padded_vocab_size(info.vocab_size, make_vocab_size_divisible_by, tp)
    if vocab < info.vocab_size or vocab % tp:
        raise HFConfigError(
            f"padded vocab {vocab} must be >= vocab_size={info.vocab_size} and divisible by tp={tp}"
        )
    return dict(
        vocab_size=vocab,
        max_sequence_length=info.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=info.rope_theta,
        rope_scaling=info.rope_type == "llama3",
        rope_scaling_factor=info.rope_factor if info.rope_type == "llama3" else 8.0,
        seq_len_interpolation_factor=info.rope_factor if info.rope_type == "linear" else None,
        share_embeddings_and_output_weights=info.tie_word_embeddings,
    )


def tokenizer_vocab_size(hf_dir: str | Path) -> int | None:
    """Number of token ids the tokenizer next to a checkpoint can emit, or None if absent.

    Reads `tokenizer.json` with `tokenizers` (added tokens included) or `tokenizer.model`
    with `sentencepiece`; used to refuse a tokenizer that emits ids the embedding lacks.
    """
    hf_dir = Path(hf_dir)
    if (hf_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).get_vocab(
            with_added_tokens=True
        )
        # Ids need not be contiguous: what must fit the embedding is the largest one.
        return max(vocab.values()) + 1 if vocab else 0
    if (hf_dir / "tokenizer.model").is_file():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
        return sp.vocab_size()
    return None


def check_tokenizer_vocab(hf_dir: str | Path, info: HFModelInfo) -> None:
    """Refuse a tokenizer that can emit ids >= the embedding's `vocab_size`."""
    n = tokenizer_vocab_size(hf_dir)
    if n is not None and n > info.vocab_size:
        raise HFConfigError(
            f"{Path(hf_dir)}: tokenizer has {n} tokens but config.json vocab_size="
            f"{info.vocab_size} (the embedding has no row for the extra ids)"
        )
