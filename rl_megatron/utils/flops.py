"""FLOPs and MFU for decoder-only transformers, dense or mixture-of-experts.

Training FLOPs per token = 6·N (forward 2·N, backward 4·N, N = non-embedding matmul
parameters a token passes through, plus the output layer) + the attention score/value matmuls,
6 · 2 · layers · heads · head_dim · seq_len per token (heads · head_dim = hidden unless the
model sets its own head_dim, as Qwen3 and some Mistrals do) for full (non-causal-skipping)
attention kernels; causal kernels do half, which is what `causal=True` counts (Chinchilla,
Hoffmann et al. 2022, App. F; PaLM, Chowdhery et al. 2022, App. B).

Mixture of experts: a token passes through the router (hidden × experts) and its top-k
experts only, so N counts k expert FFNs per layer, not all of them (an MoE model's "active
parameters"). Token dispatch (permutation, all-to-all) does no matmul work and is not
counted.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 peak of common accelerators (TFLOP/s, without sparsity).
PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


@dataclass(frozen=True)
class TransformerShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU: three FFN matrices instead of two
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    # Mixture of experts (0 = dense): routed experts per layer and experts per token; an
    # expert's FFN width is then `ffn_hidden_size` (HFModelInfo's moe_ffn_hidden_size).
    num_experts: int = 0
    moe_topk: int = 0

    @classmethod
    def of(cls, info) -> TransformerShape:
        """The shape of a model's HF facts (`models.hf_config.HFModelInfo`)."""
        return cls(
            info.num_layers,
            info.hidden_size,
            info.ffn_hidden_size,
            info.num_attention_heads,
            info.num_key_value_heads,
            info.vocab_size,
            head_dim=info.head_dim,
            num_experts=getattr(info, "num_experts", 0),
            moe_topk=getattr(info, "moe_topk", 0),
        )

    @property
    def q_width(self) -> int:
        """heads · head_dim: the width of q, of attention's output and of o_proj's input."""
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        return self.num_attention_heads * head_dim

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (embedding lookup excluded);
        with experts, the router and the top-k experts a token is routed to."""
        q = self.q_width
        kv = 2 * self.num_query_groups * (q // self.num_attention_heads)
        attention = self.hidden_size * (q + kv) + q * self.hidden_size  # QKV + o_proj
        ffn = (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size
        if self.num_experts:
            ffn = self.moe_topk * ffn + self.hidden_size * self.num_experts  # + router
        return self.num_layers * (attention + ffn) + self.hidden_size * self.vocab_size


def flops_per_token(
    shape: TransformerShape, seq_len: int, training: bool = True, causal: bool = True
) -> float:
    """FLOPs per token: forward only (2·N + attn) or forward+backward (3× that)."""
    attention = 2 * 2 * shape.num_layers * shape.q_width * seq_len
    if causal:
        attention /= 2
    forward = 2 * shape.matmul_params() + attention
    return 3 * forward if training else forward


def mfu(
    tokens_per_s: float,
    shape: TransformerShape,
    seq_len: int,
    peak_tflops: float,
    training: bool = True,
) -> float:
    """Model FLOPs utilisation in [0, 1] for `tokens_per_s` on one device."""
    return tokens_per_s * flops_per_token(shape, seq_len, training) / (peak_tflops * 1e12)


def device_peak_tflops() -> float | None:
    """Dense bf16 peak of this process's GPU, if it is one we know (None on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)
