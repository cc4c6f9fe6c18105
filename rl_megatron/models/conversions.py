"""Weight layout conversions between Megatron, Hugging Face and vLLM (pure functions).

Shared by the HF checkpoint tools (HF ⇄ Megatron) and the engine weight sync
(Megatron → vLLM), so both agree bit for bit. Every function takes tensors and returns new
tensors (or views); none reads global state or communicates.

Layouts, for a weight whose output rows are split across tensor-parallel (TP) ranks
(`d` = head dim, `nq` query heads, `ng` query groups = KV heads, `f` = FFN size):

* HF: separate `q_proj [nq*d, h]`, `k_proj [ng*d, h]`, `v_proj [ng*d, h]`,
  `gate_proj [f, h]`, `up_proj [f, h]` (biases are the same minus the `h` dim).
* Megatron `linear_qkv` (one TP shard, or the whole tensor at TP=1): query groups
  interleaved, `[q_g0 (nq/ng heads), k_g0, v_g0, q_g1, k_g1, v_g1, ...]`. A TP shard holds
  whole groups, so concatenating the shards along dim 0 gives the TP=1 tensor.
* Megatron `linear_fc1`, per TP shard: `[gate_r; up_r]`. Concatenating shards does NOT give
  the TP=1 tensor (it would be `[gate_0; up_0; gate_1; up_1]`): use `merge_gated_shards`.
* vLLM, per its own TP shard: `qkv_proj = [q_r; k_r; v_r]`, `gate_up_proj = [gate_r; up_r]`.

All functions work on dim 0 (rows), so the same code handles weights `[rows, h]` and
biases `[rows]`.
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------- QKV


def _check_groups(num_heads: int, num_query_groups: int) -> None:
    if num_query_groups <= 0 or num_heads % num_query_groups != 0:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of "
            f"num_query_groups={num_query_groups}"
        )


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int
) -> torch.Tensor:
    """Fuse separate q/k/v rows into Megatron's per-group interleaved `linear_qkv` layout.

    Args:
        q: `[nq*d, ...]` query rows (whole tensor or one TP shard's heads).
        k, v: `[ng*d, ...]` key / value rows for the same query groups.
        num_query_groups: `ng`, the number of groups in these rows (local count for a shard).
    Returns:
        `[(nq + 2*ng)*d, ...]`, ordered `[q_g0, k_g0, v_g0, q_g1, ...]`.
    """
    ng = num_query_groups
    if k.shape != v.shape or k.shape[0] % ng or q.shape[0] % k.shape[0]:
        raise ValueError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} "
            f"do not fit {ng} query groups"
        )
    rest = q.shape[1:]
    qg = q.reshape(ng, q.shape[0] // ng, *rest)
    kg = k.reshape(ng, k.shape[0] // ng, *rest)
    vg = v.reshape(ng, v.shape[0] // ng, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def deinterleave_qkv(
    qkv: torch.Tensor, num_heads: int, num_query_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Megatron's interleaved `linear_qkv` rows into separate q, k, v rows.

    Args:
        qkv: `[(nq + 2*ng)*d, ...]` (whole tensor or one TP shard).
        num_heads: `nq` query heads in these rows (local count for a shard).
        num_query_groups: `ng` query groups in these rows (local count for a shard).
    Returns:
        `q [nq*d, ...]`, `k [ng*d, ...]`, `v [ng*d, ...]`.
    """
    _check_groups(num_heads, num_query_groups)
    nq, ng = num_heads, num_query_groups
    if qkv.shape[0] % (nq + 2 * ng):
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, not a multiple of {nq + 2 * ng}")
    d = qkv.shape[0] // (nq + 2 * ng)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (nq // ng + 2) * d, *rest)
    q, k, v = torch.split(grouped, [nq // ng * d, d, d], dim=1)
    return q.reshape(nq * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def megatron_qkv_to_vllm(qkv: torch.Tensor, num_heads: int, num_query_groups: int) -> torch.Tensor:
    """Megatron interleaved `linear_qkv` shard → vLLM `qkv_proj = [q; k; v]` for the same heads.

    Args:
        qkv: `[(nq + 2*ng)*d, ...]`, one TP shard; counts are local to the shard.
    Returns:
        `[(nq + 2*ng)*d, ...]` ordered `[q (all local heads); k; v]`.
    """
    return torch.cat(deinterleave_qkv(qkv, num_heads, num_query_groups), dim=0)


def vllm_qkv_to_megatron(qkv: torch.Tensor, num_heads: int, num_query_groups: int) -> torch.Tensor:
    """vLLM `qkv_proj = [q; k; v]` shard → Megatron interleaved `linear_qkv` for the same heads."""
    _check_groups(num_heads, num_query_groups)
    d = qkv.shape[0] // (num_heads + 2 * num_query_groups)
    q, k, v = torch.split(qkv, [num_heads * d, num_query_groups * d, num_query_groups * d])
    return interleave_qkv(q, k, v, num_query_groups)


# ------------------------------------------------------------------------ gate/up


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF `gate_proj`, `up_proj` rows (one TP shard each) → Megatron/vLLM `[gate; up]`."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron `linear_fc1` / vLLM `gate_up_proj` shard `[gate; up]` → `(gate, up)`."""
    if fused.shape[0] % 2:
        raise ValueError(f"gated linear_fc1 has an odd number of rows ({fused.shape[0]})")
    gate, up = fused.chunk(2, dim=0)
    return gate, up


def split_gated_shards(fused: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """TP=1 `[gate; up]` → `tp` shards, each `[gate_r; up_r]` (Megatron and vLLM layout)."""
    gate, up = split_gate_up(fused)
    return [fuse_gate_up(g, u) for g, u in zip(tp_split(gate, tp, 0), tp_split(up, tp, 0))]


def merge_gated_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """`tp` shards `[gate_r; up_r]` → the TP=1 tensor `[gate; up]`."""
    pairs = [split_gate_up(s) for s in shards]
    return fuse_gate_up(torch.cat([g for g, _ in pairs]), torch.cat([u for _, u in pairs]))


# ------------------------------------------------------------------------- vocab


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of `make_vocab_size_divisible_by * tp`."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_vocab(tensor: torch.Tensor, padded_size: int) -> torch.Tensor:
    """Append zero rows to `[vocab, ...]` up to `padded_size` rows.

    Zero rows keep export round trips exact; the logits they produce are never used
    (log-probs and sampling mask ids >= the true vocab size).
    """
    extra = padded_size - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"vocab of {tensor.shape[0]} rows exceeds padded size {padded_size}")
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])], dim=0)


def unpad_vocab(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop padding rows: `[padded_vocab, ...]` → `[vocab_size, ...]` (a view)."""
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"tensor has {tensor.shape[0]} rows, fewer than vocab {vocab_size}")
    return tensor[:vocab_size]


# ---------------------------------------------------------------- TP split/merge


def shard_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    """`[start, end)` of TP rank `rank` when `size` is split evenly in `tp` parts."""
    if size % tp:
        raise ValueError(f"size {size} is not divisible by tp={tp}")
    part = size // tp
    return rank * part, (rank + 1) * part


def tp_split(tensor: torch.Tensor, tp: int, dim: int) -> list[torch.Tensor]:
    """Split evenly along `dim` into `tp` shards (views), rank order."""
    if tensor.shape[dim] % tp:
        raise ValueError(f"dim {dim} of size {tensor.shape[dim]} is not divisible by tp={tp}")
    return list(torch.chunk(tensor, tp, dim=dim))


def tp_merge(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate TP shards along `dim` (inverse of `tp_split`)."""
    return torch.cat(shards, dim=dim)
