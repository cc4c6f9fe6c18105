"""Per-token outputs of the response tokens from a model's output: the heads' math.

A role's model returns batch-first `[b, s, V/tp]` logits (an LM head), `[b, s, h]` final
hidden states (an LM head whose log-probs are made chunk by chunk, `logprob_chunk_tokens`),
or `[b, s, 1]` values (a `ValueHead`); a packed micro-batch (THD) is one `[1, T, ...]` row.
`OutputHead.per_token` turns that into `[b, r]` outputs of the response tokens:

* `log_prob` of each response token (and `entropy`), at temperature `temperature`;
* `kl_full`, the exact KL to another policy whose logits the micro-batch carries
  (`kl_ref_logits`, computed beside ours: `MegatronRole.forward_only(kl_to=...)`);
* `values` of a value head.

The micro-batch's `gather_index` `[b, r]` is the column predicting response token k (P − 1
+ k before left-alignment, `micro_batches.left_align`); a value head read at the token
itself (a reward model, `output_at="token"`) is read one column further on. Under context
parallelism the output holds this rank's tokens only: each output is computed at every
local position, gathered over CP (`cp_split.gather_outputs`), and the response columns
read from the full sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_megatron.models.chunked_logprobs import chunked_log_probs_and_entropy
from rl_megatron.models.vocab_parallel import (
    vocab_parallel_kl,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from rl_megatron.trainer import cp_split


def response_columns(x: torch.Tensor, index: torch.Tensor, packed: bool) -> torch.Tensor:
    """`x` `[b, s, n]` (packed: `[1, T, n]`) at the columns `index` `[b, r]` → `[b, r, n]`."""
    if packed:  # one [1, T, ...] row holds every sequence
        return x[0].index_select(0, index.view(-1)).view(*index.shape, -1)
    # gather, not x[rows, index]: advanced indexing is a slow host op.
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


@dataclass(frozen=True)
class OutputHead:
    """How a role reads its model's output (made per call: the role's settings may change)."""

    value_head: bool  # the model ends in a `ValueHead`: `values`; else log-probs
    output_shift: int  # 1: a value is read where token k is predicted; 0: at token k
    temperature: float  # divides the logits before log-probs / entropy / KL
    vocab_size: int | None  # the true vocabulary (the logits' padding columns excluded)
    chunk_tokens: int  # tokens per chunk of log-probs made from the hidden states
    tp: dist.ProcessGroup  # the vocabulary shards' group
    cp: dist.ProcessGroup | None  # the context-parallel group, None without CP
    device: torch.device

    def per_token(
        self, output: torch.Tensor, batch: Mapping[str, torch.Tensor], with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """`[b, s, V/tp]` logits (or `[b, s, h]` hidden states, see `log_probs`) or
        `[b, s, 1]` values → `[b, r]` response-token outputs."""
        if self.cp is not None:
            return self._per_token_cp(output, batch, with_entropy)
        packed = "cu_seqlens" in batch
        index = self._response_index(batch, output.shape[1])
        cols = response_columns(output, index, packed)
        if self.value_head:
            return {"values": cols[..., 0].float()}
        labels = batch["responses"].to(self.device)
        out = {}
        if "kl_ref_logits" in batch:
            ref_cols = response_columns(batch["kl_ref_logits"], index, packed)
            out["kl_full"] = vocab_parallel_kl(
                cols, ref_cols, self.tp, self.temperature, self.vocab_size
            )
        out.update(self.log_probs(cols, labels, batch, with_entropy))
        return out

    def _response_index(self, batch: Mapping[str, torch.Tensor], width: int) -> torch.Tensor:
        """The column of each response token's output, `[b, r]` (module docstring)."""
        index = batch["gather_index"] + (1 - self.output_shift) * self.value_head
        return index.clamp(max=width - 1)

    def _per_token_cp(
        self, output: torch.Tensor, batch: Mapping[str, torch.Tensor], with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """`per_token` under context parallelism: output `[b, s/cp, V/tp]` (or values) of
        this rank's tokens.

        Each output is computed once per local position (labels from
        `cp_split.split_micro_batch`), all of them gathered over CP in one collective into
        `[b, s]` (packed: `[1, T]`), and the response columns read from that as without CP.
        The gather's backward keeps each rank's own positions: every CP rank computes the
        same loss.
        """
        local = self._per_position(output, batch, with_entropy)
        full = cp_split.gather_outputs(local, self.cp, batch.get("cu_seqlens"))  # [b, s, k]
        index = self._response_index(batch, full.shape[1])
        cols = response_columns(full, index, "cu_seqlens" in batch)
        return {name: cols[..., i] for i, name in enumerate(local)}

    def _per_position(
        self, output: torch.Tensor, batch: Mapping[str, torch.Tensor], with_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """`[b, s, V/tp]` logits or `[b, s, 1]` values → `[b, s]` outputs at every position,
        each against `batch["cp_labels"]` `[b, s]`."""
        if self.value_head:
            return {"values": output[..., 0].float()}
        out = {}
        if "kl_ref_logits" in batch:
            out["kl_full"] = vocab_parallel_kl(
                output, batch["kl_ref_logits"], self.tp, self.temperature, self.vocab_size
            )
        out.update(self.log_probs(output, batch["cp_labels"], batch, with_entropy))
        return out

    def log_probs(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        with_entropy: bool,
    ) -> dict[str, torch.Tensor]:
        """`log_prob` of `labels` (and `entropy`) from `x`: logits `[..., V/tp]`, or the
        final hidden states `[..., h]` where the forward returned those (the batch then
        carries `output_weight`, and the logits are made chunk by chunk)."""
        if "output_weight" in batch:
            weight = batch["output_weight"]
            log_prob, entropy = chunked_log_probs_and_entropy(
                x.to(weight.dtype),  # Float16Module hands the last stage's output up in fp32
                weight,
                labels,
                self.tp,
                temperature=self.temperature,
                vocab_size=self.vocab_size,
                chunk_tokens=self.chunk_tokens,
                with_entropy=with_entropy,
            )
            return {"log_prob": log_prob, **({"entropy": entropy} if with_entropy else {})}
        if not with_entropy:
            # The entropy costs another pass over the vocabulary (and its backward).
            return {
                "log_prob": vocab_parallel_log_probs(
                    x, labels, self.tp, self.temperature, self.vocab_size
                )
            }
        log_prob, entropy = vocab_parallel_log_probs_and_entropy(
            x, labels, self.tp, self.temperature, self.vocab_size
        )
        return {"log_prob": log_prob, "entropy": entropy}
