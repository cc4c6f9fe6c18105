"""Sampling parameters shared by every rollout engine, and the prompt-overflow policy.

One `SamplingParams` describes a whole `generate` call: every prompt gets `n` responses
drawn with the same temperature / top-p / top-k and at most `max_new_tokens` tokens each
(or fewer, `prompt_max_new_tokens`: a cap per prompt).
Engines translate it to their own knobs (`vllm_io.to_vllm_sampling_params`).
Engines that sample themselves (the Megatron engine) use `sample_tokens`: batched,
and with per-row seeds a pure function of (row seed, decode step, logits).

A prompt *overflows* when it leaves less than `max_new_tokens` of room in the engine's
context (`prompt_len + max_new_tokens > context_len`), or when it is longer than
`max_prompt_len`. Overflowing prompts are never dropped silently: `truncate_left` keeps
their last tokens, `reject` keeps their row in the `RolloutBatch` with an empty response and
finish reason `rejected`; both are counted in the batch's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

PromptOverflow = Literal["truncate_left", "reject"]
PROMPT_OVERFLOW_POLICIES: tuple[str, ...] = ("truncate_left", "reject")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; validated once, on construction (errors name the key)."""

    temperature: float = 1.0  # softmax temperature; 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1 keeps every token
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) keeps every token
    max_new_tokens: int = 256  # cap on generated tokens per response (EOS included)
    n: int = 1  # responses per prompt (the GRPO group size)
    # Tokens that end a response (kept as its last token). None: the model's EOS id(s).
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False  # never stop early: exactly max_new_tokens (benchmarks)
    # Per-request seed: prompt i's sample j uses seed + i*n + j, so results do not
    # depend on how prompts are split over generation replicas. None: engine's RNG.
    seed: int | None = None
    # Per-prompt seeds instead (prompt i's sample j uses prompt_seeds[i] + j): multi-turn
    # waves give each turn the seed of its trajectory and turn, whatever else is batched
    # with it (rollout/turn_waves.py). Overrides `seed`.
    prompt_seeds: tuple[int, ...] | None = None
    # Per-prompt caps on new tokens: prompt i's samples stop at min(max_new_tokens,
    # prompt_max_new_tokens[i]) with finish reason "length" (a benchmark's length sampler,
    # benchmarks/async_ab.py). None: max_new_tokens for every prompt.
    prompt_max_new_tokens: tuple[int, ...] | None = None
    prompt_overflow: PromptOverflow = "reject"  # what to do with a too-long prompt
    max_prompt_len: int | None = None  # extra cap on prompt tokens; None: context only

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; a tuple keeps the dataclass hashable.
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.prompt_seeds is not None and not isinstance(self.prompt_seeds, tuple):
            object.__setattr__(self, "prompt_seeds", tuple(self.prompt_seeds))
        if self.prompt_max_new_tokens is not None and not isinstance(
            self.prompt_max_new_tokens, tuple
        ):
            object.__setattr__(self, "prompt_max_new_tokens", tuple(self.prompt_max_new_tokens))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.temperature >= 0, "sampling.temperature", "must be >= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "sampling.top_k", "must be >= 1, or 0 / -1 to disable"),
            (self.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1"),
            (self.n >= 1, "sampling.n", "must be >= 1"),
            (
                self.prompt_overflow in PROMPT_OVERFLOW_POLICIES,
                "sampling.prompt_overflow",
                f"must be one of {PROMPT_OVERFLOW_POLICIES}",
            ),
            (
                self.max_prompt_len is None or self.max_prompt_len >= 1,
                "sampling.max_prompt_len",
                "must be >= 1 or None",
            ),
            (
                self.stop_token_ids is None or all(t >= 0 for t in self.stop_token_ids),
                "sampling.stop_token_ids",
                "must hold non-negative token ids",
            ),
            (
                self.prompt_max_new_tokens is None
                or all(c >= 1 for c in self.prompt_max_new_tokens),
                "sampling.prompt_max_new_tokens",
                "must hold caps >= 1",
            ),
        ]
        for ok, key, rule in checks:
            if not ok:
                value = getattr(self, key.split(".", 1)[1])
                raise ValueError(f"{key} {rule}; got {value!r}")

    def prompt_seed(self, i: int) -> int | None:
        """The seed of prompt i's first sample (sample j draws with it + j); None: the
        engine's RNG."""
        if self.prompt_seeds is not None:
            return self.prompt_seeds[i]
        return None if self.seed is None else self.seed + i * self.n

    def check_prompt_seeds(self, num_prompts: int) -> None:
        """Refuse `prompt_seeds` or `prompt_max_new_tokens` that do not give every prompt
        exactly one entry."""
        if self.prompt_seeds is not None and len(self.prompt_seeds) != num_prompts:
            raise ValueError(
                f"sampling.prompt_seeds holds {len(self.prompt_seeds)} seeds for "
                f"{num_prompts} prompts"
            )
        caps = self.prompt_max_new_tokens
        if caps is not None and len(caps) != num_prompts:
            raise ValueError(
                f"sampling.prompt_max_new_tokens holds {len(caps)} caps for {num_prompts} prompts"
            )

    def prompt_max_new(self, i: int) -> int:
        """Most new tokens prompt i's samples may generate."""
        if self.prompt_max_new_tokens is None:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.prompt_max_new_tokens[i])

    @property
    def greedy(self) -> bool:
        """True when the engine should take the argmax (top-p/top-k are then moot)."""
        return self.temperature == 0

    def prompt_limit(self, context_len: int) -> int:
        """Most prompt tokens that still leave `max_new_tokens` of room in `context_len`."""
        limit = context_len - self.max_new_tokens
        if limit < 1:
            raise ValueError(
                f"sampling.max_new_tokens={self.max_new_tokens} leaves no room for a prompt "
                f"in the engine's context of {context_len} tokens; lower it or raise the "
                f"engine's max_model_len"
            )
        if self.max_prompt_len is not None:
            limit = min(limit, self.max_prompt_len)
        return limit

    def resolved_stop_token_ids(self, model_eos_ids: Sequence[int]) -> tuple[int, ...]:
        """Stop ids the engine should use: none with `ignore_eos`, else explicit or model's."""
        if self.ignore_eos:
            return ()
        if self.stop_token_ids is not None:
            return self.stop_token_ids
        return tuple(model_eos_ids)


@dataclass(frozen=True)
class FittedPrompts:
    """Prompts after the overflow policy; one entry per input prompt, same order."""

    token_ids: list[list[int]]  # truncated (or, when rejected, left-cut to the limit)
    truncated: list[bool]  # True where tokens were cut from the left
    rejected: list[bool]  # True where the prompt gets no response

    @property
    def num_truncated(self) -> int:
        return sum(self.truncated)

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected)


def fit_prompts(
    prompt_token_ids: Sequence[Sequence[int]],
    limit: int,
    policy: PromptOverflow,
    vocab_size: int | None = None,
) -> FittedPrompts:
    """Apply the prompt-overflow policy to every prompt.

    prompt_token_ids: `batch` lists of token ids (any lengths >= 1).
    limit: most prompt tokens allowed (`SamplingParams.prompt_limit(context_len)`).
    policy: `truncate_left` keeps the last `limit` tokens (the end of a prompt, where the
        question usually sits, survives); `reject` marks the prompt rejected. A rejected
        prompt is still left-cut to `limit`, so that its row in the batch stays bounded.
    vocab_size: when given, every token id must be in `[0, vocab_size)`.
    """
    if policy not in PROMPT_OVERFLOW_POLICIES:
        raise ValueError(f"sampling.prompt_overflow must be one of {PROMPT_OVERFLOW_POLICIES}")
    token_ids, truncated, rejected = [], [], []
    for i, prompt in enumerate(prompt_token_ids):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if vocab_size is not None and not (min(prompt) >= 0 and max(prompt) < vocab_size):
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} holds token id {bad[0]} outside the vocabulary [0, {vocab_size})"
                )
        over = len(prompt) > limit
        token_ids.append(prompt[-limit:] if over else prompt)
        truncated.append(over and policy == "truncate_left")
        rejected.append(over and policy == "reject")
    return FittedPrompts(token_ids=token_ids, truncated=truncated, rejected=rejected)


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p applied to `[rows, vocab]` fp32 logits (filtered = -inf)."""
    x = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = x.topk(sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top one stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


# ---- batched sampling -----------------------------------------------------------------
#
# Per-request seeds must make a row's samples independent of which rows share its batch
# (DESIGN §7 "Rollout sampling"). One `torch.Generator` per row does that but costs one
# `multinomial` call per row and step (46 % of a GRPO step's CPU time on an H200). Instead
# every row draws one counter-based uniform per step, u = splitmix64(key(seed) + step·γ)
# (Steele, Lea & Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014),
# computed for all rows at once in int64 arithmetic on the device, and inverts the CDF of
# its filtered distribution.


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic: clear the sign fill)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; products wrap modulo 2^64, as in C."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seed_tensor(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Python seeds (any ints) → `[rows]` int64 holding their low 64 bits."""
    return torch.tensor([_signed(s % (1 << 64)) for s in seeds], dtype=torch.int64, device=device)


def seeded_uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform draw in (0, 1] per row, a function of (row seed, step) only.

    seeds: `[rows]` int64 (`seed_tensor`); step: the decode step (response position).
    Returns `[rows]` float64 with 53 random bits: the `step`-th output of a splitmix64
    stream keyed by a hash of the seed, so nearby seeds give unrelated streams.
    """
    key = _mix64(seeds)
    offset = _signed((step + 1) * _GOLDEN_GAMMA % (1 << 64))  # the step-th state increment
    bits = _shr(_mix64(key + offset), 11)  # top 53 bits
    return (bits + 1).to(torch.float64) * 2.0**-53


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token `[rows]` drawn from `[rows, vocab]` probabilities by inverting their CDF at u.

    probs: non-negative, each row with positive mass (need not sum to 1 exactly).
    u: `[rows]` uniforms in (0, 1]. The result is the first i with cdf[i] >= u · cdf[-1]:
    since 0 < u · cdf[-1] <= cdf[-1], that token always has positive probability. The CDF
    is summed in float64 so that each token's interval is exact to ~1e-16, not fp32's ~1e-7.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    target = u.to(torch.float64) * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None])[:, 0].clamp_(max=probs.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    sampling: SamplingParams,
    *,
    seeds: torch.Tensor | None = None,
    step: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its log-prob, both `[rows]`.

    logits: `[rows, vocab]` fp32. Greedy (temperature 0) takes the argmax and returns its
    log-prob under `log_softmax(logits)`. Otherwise temperature, top-k and top-p are applied
    (`filter_logits`) and the log-prob is that of the token under the filtered, renormalised
    distribution (vLLM's "processed_logprobs").
    seeds: `[rows]` int64 per-row seeds (`seed_tensor`): row r's token depends only on
        (seeds[r], step, logits[r]), whatever else is in the batch. None: one uniform per
        row from `generator` (on the logits' device).
    step: the decode step, so each step of a row draws a fresh uniform.
    """
    if sampling.greedy:
        tok = logits.argmax(-1)
        return tok, logits.gather(-1, tok[:, None])[:, 0] - logits.logsumexp(-1)
    x = filter_logits(logits, sampling)
    lse = x.logsumexp(-1)
    if seeds is None:  # 1 - [0, 1) is (0, 1]; cheaper than multinomial's vocab-wide draw
        u = 1 - torch.rand(x.shape[0], generator=generator, dtype=torch.float64, device=x.device)
    else:
        u = seeded_uniform(seeds, step)
    tok = inverse_cdf_sample((x - lse[:, None]).exp(), u)
    return tok, x.gather(-1, tok[:, None])[:, 0] - lse
