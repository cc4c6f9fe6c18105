"""Hugging Face `config.json` → Megatron `TransformerConfig` and `GPTModel` arguments.

Supported: Llama 2 / 3 / 3.1 / 3.2 (`rope_scaling` of type `llama3` or `linear`), Qwen2 /
Qwen2.5 (QKV bias, tied embeddings on the small models), Mistral (GQA, optional sliding
window), Qwen3 dense (QK-norm, an explicit head_dim, tied embeddings on the small
models), and the mixtures of experts Qwen3-MoE and Mixtral (megatron-core's `MoELayer`:
softmax router, top-k, no shared experts, every layer sparse; `_moe`). Anything else is refused with a one-line `HFConfigError` naming the field, before a
model is built. Both config spellings are read: transformers ≥ 5 (`rope_parameters`) and
older (`rope_theta` + `rope_scaling`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from rl_megatron.config import DTYPE_NAMES, Config, ModelConfig
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
    # Mixture of experts (Qwen3-MoE, Mixtral); 0 experts = a dense model.
    num_experts: int = 0  # routed experts per layer
    moe_topk: int = 0  # experts per token (num_experts_per_tok)
    moe_ffn_hidden_size: int = 0  # one expert's FFN width
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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


def _moe(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of HFModelInfo from a Qwen3-MoE / Mixtral config (refusals name the key).

    Qwen3-MoE: `num_experts` (or `num_local_experts`), `moe_intermediate_size`, `norm_topk_prob`; every layer must be
    sparse (`decoder_sparse_step` 1, no `mlp_only_layers`). Mixtral: `num_local_experts`,
    `intermediate_size` is the expert's width and the top-k is always renormalised; its
    training-time `router_jitter_noise` is not reproduced, so it must be 0.
    """
    if model_type == "qwen3_moe":
        # Released configs say num_experts; transformers >= 5 writes num_local_experts.
        experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        ffn_key = "moe_intermediate_size"
        norm_topk = bool(cfg.get("norm_topk_prob", False))
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise HFConfigError(
                f"config.json: decoder_sparse_step={cfg['decoder_sparse_step']} is not supported "
                "(dense layers between MoE layers); only 1, every layer sparse"
            )
        if cfg.get("mlp_only_layers"):
            raise HFConfigError(
                f"config.json: mlp_only_layers={cfg['mlp_only_layers']} is not supported "
                "(dense layers among MoE layers); only []"
            )
    else:  # mixtral
        experts_key, ffn_key = "num_local_experts", "intermediate_size"
        norm_topk = True
        if cfg.get("router_jitter_noise"):
            raise HFConfigError(
                f"config.json: router_jitter_noise={cfg['router_jitter_noise']} is not "
                "supported (only 0)"
            )
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if cfg.get(key):
            raise HFConfigError(
                f"config.json: {key}={cfg[key]} is not supported (no shared experts)"
            )
    experts = int(_need(cfg, experts_key))
    topk = int(_need(cfg, "num_experts_per_tok"))
    if experts < 1:
        raise HFConfigError(f"config.json: {experts_key}={experts} must be >= 1")
    if not 1 <= topk <= experts:
        raise HFConfigError(
            f"config.json: num_experts_per_tok={topk} must be in [1, {experts_key}={experts}]"
        )
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=int(_need(cfg, ffn_key)),
        moe_norm_topk_prob=norm_topk,
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
    if model_type in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        # Their attention_bias also biases o_proj, which Megatron can only express by
        # biasing every linear layer.
        raise HFConfigError(f"config.json: attention_bias=true is not supported for {model_type}")
    if cfg.get("pretraining_tp", 1) != 1:
        raise HFConfigError(f"config.json: pretraining_tp={cfg['pretraining_tp']} is not supported")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and (
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
    moe = _moe(cfg, model_type) if table.moe else {}
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
        # A MoE model has no dense MLP (Qwen3-MoE's intermediate_size would size the dense
        # layers this parser refuses): its experts' width stands in.
        ffn_hidden_size=moe["moe_ffn_hidden_size"] if moe else int(_need(cfg, "intermediate_size")),
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
        **moe,
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


def config_model_fields(info: HFModelInfo) -> dict[str, Any]:
    """The `model.*` fields of the run's config that a checkpoint fixes, as it is built.

    One mapping from what the builders build from (`HFModelInfo`) to the config's names, so
    that the run's record (`config.resolved.yaml`) cannot say other than the model. Left
    out: `max_position_embeddings` (the config's is the run's prompt + response budget,
    checked by config_checks) and, for a mixture of experts, `ffn_hidden_size` (the model
    has no dense MLP; its experts' width is `moe_ffn_hidden_size`).
    """
    fields: dict[str, Any] = {
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "num_attention_heads": info.num_attention_heads,
        "num_query_groups": info.num_key_value_heads,
        "vocab_size": info.vocab_size,
        "rope_theta": info.rope_theta,
        "norm_epsilon": info.rms_norm_eps,
        "tie_word_embeddings": info.tie_word_embeddings,
    }
    if info.is_moe:
        fields["num_experts"] = info.num_experts
        fields["moe_router_topk"] = info.moe_topk
        fields["moe_ffn_hidden_size"] = info.moe_ffn_hidden_size
    else:
        fields["ffn_hidden_size"] = info.ffn_hidden_size
    return fields


def resolve_model_config(config: Config) -> tuple[Config, list[str]]:
    """`config` with its `model.*` fields as the model is built, and a warning per value of
    the user's that config.json replaced.

    With `model.hf_path` the builders read its config.json (`load_hf_config`), whatever
    the config says; this reads it the same way, without the weights, so that what is
    printed at start and saved as `config.resolved.yaml` is what runs. A given
    architecture size that disagrees was already refused by `load_config`; a given
    rope_theta / norm_epsilon / tie_word_embeddings is replaced, as the builders always
    did, and named in the warnings. Without `model.hf_path` the config is the model's
    description (`random_init_hf_config`) and is returned as is.
    """
    if config.model.hf_path is None:
        return config, []
    fields = config_model_fields(load_hf_config(config.model.hf_path))
    defaults = ModelConfig()
    warnings = []
    for name, value in fields.items():
        given = getattr(config.model, name)
        if given != value and given != getattr(defaults, name):
            warnings.append(
                f"model.{name}: {given} given, but the model is built with {value} from "
                f"{Path(config.model.hf_path) / 'config.json'}"
            )
    model = dataclasses.replace(config.model, **fields)
    return dataclasses.replace(config, model=model), warnings


def check_parallel_layout(
    info: HFModelInfo, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int = 1
) -> None:
    """Refuse TP/PP/VPP/EP/ETP sizes the model cannot be split into, naming the field."""
    fields = [
        ("num_attention_heads", info.num_attention_heads),
        ("num_key_value_heads", info.num_key_value_heads),
    ]
    if not info.is_moe:
        fields.append(("intermediate_size", info.ffn_hidden_size))
    for field, value in fields:
        if value % tp:
            raise HFConfigError(f"config.json: {field}={value} is not divisible by tp={tp}")
    if not info.is_moe and (ep > 1 or etp > 1):
        raise HFConfigError(
            f"config.json: model_type='{info.model_type}' has no experts to split over "
            f"ep={ep} / etp={etp}; use 1"
        )
    if info.is_moe:
        experts_key = "num_local_experts" if info.model_type == "mixtral" else "num_experts"
        ffn_key = "intermediate_size" if info.model_type == "mixtral" else "moe_intermediate_size"
        if info.num_experts % ep:
            raise HFConfigError(
                f"config.json: {experts_key}={info.num_experts} is not divisible by ep={ep}"
            )
        if info.moe_ffn_hidden_size % etp:
            raise HFConfigError(
                f"config.json: {ffn_key}={info.moe_ffn_hidden_size} is not divisible by etp={etp}"
            )
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
    ep: int = 1,
    etp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    use_cpu_initialization: bool | None = None,
    perform_initialization: bool = True,
    **overrides: Any,
):
    """Build the Megatron `TransformerConfig` that computes what the HF model computes.

    Args:
        info: parsed HF config.
        tp, pp, vpp: tensor / pipeline / virtual-pipeline sizes (vpp None or 1 = none).
        ep, etp: expert-parallel and expert-tensor-parallel sizes (MoE models only).
        dtype: parameter and activation dtype (fp32, bf16 or fp16).
        use_cpu_initialization: default True when CUDA is absent.
        perform_initialization: False skips random init (weights are loaded right after).
        overrides: any other `TransformerConfig` field (fusions, recompute, ...).
    """
    from megatron.core.transformer import TransformerConfig

    check_parallel_layout(info, tp, pp, vpp, ep, etp)
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
    if info.is_moe:
        kwargs.update(moe_transformer_config(info, ep=ep, etp=etp))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_transformer_config(info: HFModelInfo, *, ep: int = 1, etp: int = 1) -> dict[str, Any]:
    """The `TransformerConfig` fields of a mixture of experts that routes as HF does.

    HF's router (Qwen3-MoE, Mixtral): logits in the activations' dtype, softmax over all
    experts in fp32, top-k; with `norm_topk_prob` (always for Mixtral) the k probabilities
    are renormalised, which equals megatron-core's default (top-k of the logits, softmax
    over those k, in fp32); without it the probabilities stay unnormalised: megatron-core's
    `moe_router_pre_softmax`. The load-balancing and z losses are off here (the trainer
    sets `moe_aux_loss_coeff` / `moe_z_loss_coeff` from `model.*`); no token dropping.
    Grouped GEMM (TEGroupedMLP) only with Transformer Engine; one MLP per expert otherwise.
    """
    from rl_megatron.models.specs import have_transformer_engine

    return dict(
        num_moe_experts=info.num_experts,
        moe_router_topk=info.moe_topk,
        moe_ffn_hidden_size=info.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not info.moe_norm_topk_prob,
        moe_router_dtype=None,  # logits in the activations' dtype, as HF's `gate`
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=have_transformer_engine(),
        moe_shared_expert_intermediate_size=None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def moe_loss_overrides(aux_loss_coeff: float, z_loss_coeff: float) -> dict[str, Any]:
    """`TransformerConfig` overrides turning on the router's auxiliary losses (0 = off)."""
    return dict(
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_z_loss_coeff=z_loss_coeff if z_loss_coeff > 0 else None,
    )


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


def random_init_hf_config(config: Config) -> dict[str, Any]:
    """The HF `config.json` of a randomly initialised model (`model.hf_path` unset)."""
    m = config.model
    if m.num_experts:  # a Qwen3-MoE shape (QK-norm, every layer sparse)
        arch = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": m.hidden_size // m.num_attention_heads,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            "norm_topk_prob": True,
        }
    else:
        arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return {
        **arch,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "intermediate_size": m.ffn_hidden_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": m.tie_word_embeddings,
        "torch_dtype": DTYPE_NAMES[m.dtype],
    }
