"""One PPO / GRPO step in plain PyTorch, written from the formulas: the trainer's reference.

Nothing here comes from `rl_megatron` except what a user brings: the model's weights (HF
names) and its HF config. The models are `transformers`' Llama in float64; every other
line (rewards, KL, advantages, losses, aggregation, gradient clipping, AdamW) is written
out from the papers cited beside it, one sequence at a time, without micro-batches, data
parallelism or padding. `tests/trainer_probe.py` runs the real trainer step on the same
rollout and compares.

The conventions a reference must share with any implementation, because they are choices
and not mathematics, are the documented ones of the config keys (verl's):
* a response's reward sits on its last token (`token_level_rewards`), minus
  `kl_coef * KL(old || ref)` per token with `use_kl_in_reward`;
* std is the unbiased one (group std, whitening), whitening adds 1e-8 to the variance and
  GRPO 1e-6 to the std;
* V(s_k) is read where response token k is predicted; the step after the last token is
  terminal;
* weight decay is decoupled (AdamW) and spares 1-D parameters (norms), as Megatron-LM's;
  the gradient is clipped by its global norm with coefficient clip / (norm + 1e-6);
* k3 is clamped to [-10, 10] (verl's `low_var_kl`, OpenRLHF's k3);
* the rollout correction's ratio is pi_old / mu (old log-prob minus the engine's); rejection
  comes first and takes tokens out of the loss and its normaliser, the weights of what is
  left come after; `batch_normalize` divides by the mean over the units that are left;
* dynamic sampling is not re-done here: the reference trains on the rows the trainer kept,
  and `tests/trainer_probe.py` checks what it kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

F64 = torch.float64
PAD_ID, EOS_ID = 0, 1
DIGIT_IDS = range(2, 12)  # the synthetic character tokenizer's '0' … '9'


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Optim:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    clip_grad: float


@dataclass(frozen=True)
class Settings:
    """The config values one step depends on (names as in the YAML)."""

    temperature: float
    n: int
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_coef: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    loss_agg_mode: str
    max_response_length: int
    cliprange_value: float | None
    actor_optim: Optim
    critic_optim: Optim | None
    policy_loss: str = "vanilla"
    critic_loss_agg_mode: str = "token-mean"
    # Rollout correction: level (None = off), weight threshold (C or (lower, upper)),
    # batch normalisation, rejection band.
    rc_level: str | None = None
    rc_threshold: float | tuple[float, float] | None = None
    rc_batch_normalize: bool = False
    rc_rejection: tuple[float, float] | None = None
    # DAPO's overlong shaping: (buffer length, penalty factor), None = off.
    overlong: tuple[int, float] | None = None


@dataclass
class Row:
    """One sample: real tokens only."""

    prompt: list[int]
    response: list[int]
    group: tuple  # rows of one prompt share it
    rollout_log_prob: torch.Tensor | None = None  # the engine's log-probs, [len(response)]


@dataclass
class AdamState:
    """Per-parameter moments, kept across steps like the trainer's optimizer."""

    step: int = 0
    m: dict[str, torch.Tensor] = field(default_factory=dict)
    v: dict[str, torch.Tensor] = field(default_factory=dict)


# ------------------------------------------------------------------------------ models


def llama(hf_config: dict, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """transformers' Llama in float64 holding `weights` (a value head's `score.weight`
    is kept aside by the caller)."""
    cfg = LlamaConfig(**{k: v for k, v in hf_config.items() if k != "torch_dtype"})
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).to(F64)
    state = {k: v.to(F64) for k, v in weights.items() if k != "score.weight"}
    if "lm_head.weight" not in state:  # a value model has no LM head
        state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


def token_log_probs(model, row: Row, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(a_k | s_k) and the entropy of π(· | s_k) for each response token, `[len]`.

    The logits at position t predict token t + 1, so response token k is predicted at
    prompt_len - 1 + k; the policy samples from softmax(logits / temperature).
    """
    ids = torch.tensor([row.prompt + row.response])
    logits = model(input_ids=ids).logits[0].to(F64)
    start = len(row.prompt) - 1
    logp = torch.log_softmax(logits[start : start + len(row.response)] / temperature, dim=-1)
    taken = logp.gather(1, torch.tensor(row.response)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return taken, entropy


def token_log_softmax(model, row: Row, temperature: float) -> torch.Tensor:
    """log π(· | s_k) over the whole vocabulary for each response token, `[len, vocab]`."""
    ids = torch.tensor([row.prompt + row.response])
    logits = model(input_ids=ids).logits[0].to(F64)
    start = len(row.prompt) - 1
    return torch.log_softmax(logits[start : start + len(row.response)] / temperature, dim=-1)


def token_values(model, head: torch.Tensor, row: Row) -> torch.Tensor:
    """V(s_k) = w · h_{prompt_len - 1 + k} (final-normed hidden state), `[len]`."""
    ids = torch.tensor([row.prompt + row.response])
    hidden = model.model(input_ids=ids).last_hidden_state[0]
    start = len(row.prompt) - 1
    return hidden[start : start + len(row.response)] @ head.to(F64)[0]


# ----------------------------------------------------------------------------- rewards


def digit_echo_score(row: Row) -> float:
    """The demo task: per response character, 1 for the prompt's last digit, 0.2 for any
    other digit, 0 otherwise; the mean over the characters (special tokens dropped)."""
    answer = [t for t in row.prompt if t in DIGIT_IDS][-1]
    chars = [t for t in row.response if t not in (PAD_ID, EOS_ID)]
    if not chars:
        return 0.0
    return sum(1.0 if t == answer else 0.2 if t in DIGIT_IDS else 0.0 for t in chars) / len(chars)


def overlong_score(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13: 0 up to L_max - L_cache, then linear down to -1 at L_max; times factor."""
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / buffer
    return -factor


def kl_estimate(log_p: torch.Tensor, log_q: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(p || q) from samples of p (Schulman 2020, k1/k2/k3), k3
    clamped to [-10, 10]; `abs` is |log p - log q|. For `full`, log_p and log_q are the
    whole distributions `[len, vocab]`: sum_v p (log p - log q)."""
    if kind == "full":
        return (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    log_r = log_q - log_p
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.clamp(torch.exp(log_r) - 1 - log_r, -10.0, 10.0)
    if kind == "abs":
        return log_r.abs()
    raise ValueError(kind)


# -------------------------------------------------------------------------- advantages


def _whiten(per_row: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat(per_row)
    mean = flat.mean()
    var = ((flat - mean) ** 2).sum() / max(flat.numel() - 1, 1)
    return [(x - mean) / torch.sqrt(var + 1e-8) for x in per_row]


def _discounted(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """GAE (Schulman et al. 2015, eq. 11-16); values = 0, lam = 1 gives the return."""
    adv = torch.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


def advantages_and_returns(
    s: Settings, rows: list[Row], rewards: list[torch.Tensor], values: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    est = s.adv_estimator
    if est == "gae":
        adv = [_discounted(r, v, s.gamma, s.lam) for r, v in zip(rewards, values)]
        returns = [a + v for a, v in zip(adv, values)]
        return _whiten(adv), returns
    if est == "reinforce_plus_plus":
        returns = [_discounted(r, torch.zeros_like(r), s.gamma, 1.0) for r in rewards]
        return _whiten(returns), returns
    scores = [float(r.sum()) for r in rewards]
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.group, []).append(i)
    per_row = [0.0] * len(rows)
    for members in groups.values():
        g = torch.tensor([scores[i] for i in members], dtype=F64)
        k = len(members)
        for j, i in enumerate(members):
            if est == "grpo":  # Shao et al. 2024, §4.1.2
                if k == 1:
                    a = 0.0
                else:
                    a = scores[i] - float(g.mean())
                    if s.norm_adv_by_std:
                        a /= float(g.std(unbiased=True)) + 1e-6
            elif est == "rloo":  # Ahmadian et al. 2024: mean of the other samples
                a = scores[i] - float((g.sum() - g[j]) / (k - 1)) if k > 1 else 0.0
            elif est == "reinforce_plus_plus_baseline":
                a = scores[i] - float(g.mean())
            else:
                raise ValueError(est)
            per_row[i] = a
    adv = [torch.full((len(r.response),), a, dtype=F64) for r, a in zip(rows, per_row)]
    if est == "reinforce_plus_plus_baseline":
        adv = _whiten(adv)
    return adv, adv


# ------------------------------------------------------------------------------ losses


def aggregate(per_row: list[torch.Tensor], mode: str, norm_len: int) -> torch.Tensor:
    """A mini-batch's loss from per-token losses of its rows (all rows here non-empty)."""
    tokens = sum(x.numel() for x in per_row)
    seqs = len(per_row)
    if mode == "token-mean":
        return sum(x.sum() for x in per_row) / tokens
    if mode == "seq-mean-token-sum":
        return sum(x.sum() for x in per_row) / seqs
    if mode == "seq-mean-token-mean":
        return sum(x.mean() for x in per_row) / seqs
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: a constant length
        return sum(x.sum() for x in per_row) / (seqs * norm_len)
    raise ValueError(mode)


def _token_mean(per_row: list[torch.Tensor]) -> float:
    return float(torch.cat([x.detach().to(F64) for x in per_row]).mean())


def actor_loss(s: Settings, log_prob, entropy, old, adv, ref, weights=None, full=None):
    """The policy loss of `s.policy_loss`, each token's times its rollout IS weight, minus
    the entropy bonus, plus the KL loss (GRPO eq. 4):
    vanilla: PPO's clipped surrogate (Schulman et al. 2017 eq. 7) with clip-higher (DAPO)
        and dual clip (Ye et al. 2020);
    gspo: GSPO-token (Zheng et al. 2025, arXiv 2507.18071, eq. 13-14): s_t = sg[s] π_t /
        sg[π_t] with s = exp(mean log(π / π_old)), log s clamped at 10, clipped as PPO's;
    cispo: -sg(clip(π / π_old, 1 - ε_low, 1 + ε_high)) A log π (arXiv 2506.13585, eq. 4).
    weights: the rollout IS weights per row (None: 1). With the `full` KL loss, `full` holds
    each row's `[len, vocab]` log-softmax of the policy and `ref` the reference's."""
    pg, frac = [], {"clip": [], "upper": [], "lower": [], "dual": [], "ppo_kl": []}
    if weights is None:
        weights = [torch.ones_like(lp) for lp in log_prob]
    for lp, o, a, w in zip(log_prob, old, adv, weights):
        ratio = torch.exp(lp - o)
        dual = torch.zeros_like(ratio, dtype=torch.bool)
        if s.policy_loss == "cispo":
            weight = ratio.detach().clamp(1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
            surrogate = -weight * a * lp
            upper = ratio > 1 + s.clip_ratio_high
            lower = ratio < 1 - s.clip_ratio_low
            pg.append(surrogate * w)
            frac["clip"].append((upper | lower).to(F64))
            frac["upper"].append(upper.to(F64))
            frac["lower"].append(lower.to(F64))
            frac["dual"].append(dual.to(F64))
            frac["ppo_kl"].append(o - lp)
            continue
        if s.policy_loss == "gspo":
            seq = (lp - o).mean().detach()
            ratio = torch.exp(torch.clamp(seq + lp - lp.detach(), max=10.0))
        surrogate = torch.maximum(
            -a * ratio, -a * ratio.clamp(1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
        )
        if s.clip_ratio_c is not None and s.policy_loss == "vanilla":
            dual = (a < 0) & (surrogate > -a * s.clip_ratio_c)
            surrogate = torch.where(a < 0, torch.minimum(surrogate, -a * s.clip_ratio_c), surrogate)
        pg.append(surrogate * w)
        upper = (a > 0) & (ratio > 1 + s.clip_ratio_high)
        lower = (a < 0) & (ratio < 1 - s.clip_ratio_low)
        frac["clip"].append((upper | lower).to(F64))
        frac["upper"].append(upper.to(F64))
        frac["lower"].append(lower.to(F64))
        frac["dual"].append(dual.to(F64))
        frac["ppo_kl"].append(o - lp)
    norm = s.max_response_length
    pg_loss = aggregate(pg, s.loss_agg_mode, norm)
    loss = pg_loss
    metrics = {
        "actor/pg_loss": float(pg_loss),
        "actor/pg_clipfrac": _token_mean(frac["clip"]),
        "actor/pg_clipfrac_upper": _token_mean(frac["upper"]),
        "actor/pg_clipfrac_lower": _token_mean(frac["lower"]),
        "actor/pg_clipfrac_dual": _token_mean(frac["dual"]),
        "actor/ppo_kl": _token_mean(frac["ppo_kl"]),
    }
    if s.entropy_coeff:
        bonus = aggregate(entropy, s.loss_agg_mode, norm)
        loss = loss - s.entropy_coeff * bonus
        metrics["actor/entropy"] = float(bonus)
    if s.use_kl_loss:
        kl = aggregate(
            [kl_estimate(lp, r, s.kl_loss_type) for lp, r in zip(log_prob, ref)]
            if s.kl_loss_type != "full"
            else [kl_estimate(f, r, "full") for f, r in zip(full, ref)],
            s.loss_agg_mode,
            norm,
        )
        loss = loss + s.kl_loss_coef * kl
        metrics["actor/kl_loss"] = float(kl)
    metrics["actor/loss"] = float(loss)
    return loss, metrics


def critic_loss(s: Settings, values, old_values, returns):
    """0.5 · max((V - R)^2, (V_clip - R)^2), aggregated as critic.loss_agg_mode says
    (PPO's value clipping)."""
    per_row, clipped = [], []
    for v, o, r in zip(values, old_values, returns):
        err = (v - r) ** 2
        if s.cliprange_value is None:
            per_row.append(err)
            clipped.append(torch.zeros_like(err))
            continue
        v_clip = o + (v - o).clamp(-s.cliprange_value, s.cliprange_value)
        err_clip = (v_clip - r) ** 2
        per_row.append(torch.maximum(err, err_clip))
        clipped.append(((err_clip > err) & ((v - o).abs() > s.cliprange_value)).to(F64))
    loss = 0.5 * aggregate(per_row, s.critic_loss_agg_mode, s.max_response_length)
    metrics = {
        "critic/vf_loss": float(loss),
        "critic/loss": float(loss),
        "critic/vf_clipfrac": _token_mean(clipped),
        "critic/vpred_mean": _token_mean(values),
    }
    return loss, metrics


# --------------------------------------------------------------------------- optimizer


def adamw_step(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], opt: Optim, state: AdamState
) -> float:
    """Clip by the global norm, then one AdamW step (Loshchilov & Hutter 2019) in place.

    Returns the gradient norm before clipping.
    """
    norm = math.sqrt(sum(float((g.to(F64) ** 2).sum()) for g in grads.values()))
    scale = opt.clip_grad / (norm + 1e-6) if opt.clip_grad > 0 else 1.0
    scale = min(scale, 1.0)
    state.step += 1
    t = state.step
    for name, p in params.items():
        g = grads[name].to(F64) * scale
        m = state.m.get(name, torch.zeros_like(g)) * opt.beta1 + (1 - opt.beta1) * g
        v = state.v.get(name, torch.zeros_like(g)) * opt.beta2 + (1 - opt.beta2) * g * g
        state.m[name], state.v[name] = m, v
        if p.dim() > 1:  # decoupled weight decay, not on norms
            p.mul_(1 - opt.lr * opt.weight_decay)
        m_hat, v_hat = m / (1 - opt.beta1**t), v / (1 - opt.beta2**t)
        p.sub_(opt.lr * m_hat / (v_hat.sqrt() + opt.eps))
    return norm


# ------------------------------------------------------------------ rollout correction


def rollout_correction(s: Settings, rows: list[Row], old: list[torch.Tensor]):
    """Which tokens of each row stay in the actor's loss, and their IS weights.

    ρ = π_old / μ per token (`token`) or the product over the response (`sequence`).
    Rejection (MIS, Liu et al. 2025): a unit whose ρ leaves [lower, upper] leaves the loss.
    Weights of what is left: min(ρ, C) (TIS, Yao et al. 2025) or ρ · 1[lower <= ρ <= upper]
    (IcePop, arXiv 2510.18855), divided by their mean over the units left when
    batch_normalize. Returns (keep per row, weights per row, metrics).
    """
    per_row_rho = []
    for row, o in zip(rows, old):
        log_rho = o - row.rollout_log_prob
        if s.rc_level == "sequence":
            log_rho = torch.full_like(log_rho, float(log_rho.sum()))
        per_row_rho.append(torch.exp(log_rho))
    keep = [torch.ones_like(r, dtype=torch.bool) for r in per_row_rho]
    metrics: dict[str, float] = {}
    if s.rc_rejection is not None:
        lower, upper = s.rc_rejection
        keep = [(r >= lower) & (r <= upper) for r in per_row_rho]
        rejected = [~k for k in keep]
        metrics["rollout_corr/rejected_token_frac"] = _token_mean(rejected)
        metrics["rollout_corr/rejected_seq_frac"] = sum(bool(x.any()) for x in rejected) / len(rows)
    if s.rc_threshold is None:
        return keep, None, metrics
    weights, units, clipped = [], [], []
    for i, rho in enumerate(per_row_rho):
        if isinstance(s.rc_threshold, tuple):
            lower, upper = s.rc_threshold
            inside = (rho >= lower) & (rho <= upper)
            w = torch.where(inside, rho, 0.0)
            out = ~inside
        else:
            w = rho.clamp(max=s.rc_threshold)
            out = rho > s.rc_threshold
        weights.append(w)
        kept = keep[i]
        if s.rc_level == "sequence":
            if kept.any():  # one unit per sequence
                units.append(float(w[0]))
                clipped.append(float(out[0]))
        else:
            units.extend(w[kept].tolist())
            clipped.extend(out[kept].float().tolist())
    u = torch.tensor(units, dtype=F64)
    mean = float(u.mean())
    metrics.update(
        {
            "rollout_corr/is_weight_mean": mean,
            "rollout_corr/is_weight_max": float(u.max()),
            "rollout_corr/is_weight_min": float(u.min()),
            "rollout_corr/is_clipped_frac": sum(clipped) / len(clipped),
            "rollout_corr/is_ess": float(u.sum() ** 2 / (len(u) * (u**2).sum())),
        }
    )
    if s.rc_batch_normalize:
        weights = [w / mean for w in weights]
    return keep, weights, metrics


def mismatch(rows: list[Row], old: list[torch.Tensor]) -> dict[str, float]:
    """|log π_old - log μ| (mean, max), mean π_old / μ and KL(μ || π_old) by k1 and k3."""
    d = torch.cat([o - r.rollout_log_prob for r, o in zip(rows, old)])
    return {
        "rollout/logprob_diff_mean": float(d.abs().mean()),
        "rollout/logprob_diff_max": float(d.abs().max()),
        "rollout/prob_ratio_mean": float(d.exp().mean()),
        "rollout/mismatch_kl_k1": float((-d).mean()),
        "rollout/mismatch_kl_k3": float((d.exp() - 1 - d).mean()),
    }


# ---------------------------------------------------------------------------- the step


@dataclass
class Result:
    """Per-row tensors `[len(response)]`; per optimizer step: metrics and HF-named grads."""

    old_log_prob: list[torch.Tensor]
    ref_log_prob: list[torch.Tensor] | None
    keep: list[torch.Tensor]  # tokens in the actor's loss (rollout rejection)
    is_weights: list[torch.Tensor] | None  # rollout IS weights
    values: list[torch.Tensor] | None
    token_level_rewards: list[torch.Tensor]
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    reward_kl_penalty: float | None
    batch_stats: dict[str, float]  # token statistics of the whole batch
    actor_steps: list[dict]  # {"metrics": {...}, "grads": {hf_name: tensor}}
    critic_steps: list[dict]
    actor_weights: dict[str, torch.Tensor]  # after the step
    critic_weights: dict[str, torch.Tensor] | None


def reference_step(
    s: Settings,
    hf_config: dict,
    rows: list[Row],
    actor: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor] | None,
    critic: dict[str, torch.Tensor] | None,
    actor_mini_batches: list[list[int]],
    critic_mini_batches: list[list[int]],
    actor_adam: AdamState,
    critic_adam: AdamState | None,
) -> Result:
    """One step on `rows` from the given weights (HF names); mini-batches are row ids.

    The Adam states carry over between calls, like the trainer's optimizer.
    """
    policy = llama(hf_config, actor)
    full_kl = (s.use_kl_in_reward and s.kl_penalty == "full") or (
        s.use_kl_loss and s.kl_loss_type == "full"
    )
    with torch.no_grad():
        old, old_entropy = zip(*[token_log_probs(policy, r, s.temperature) for r in rows])
        ref = ref_full = old_full = None
        if reference is not None:
            ref_model = llama(hf_config, reference)
            ref = [token_log_probs(ref_model, r, s.temperature)[0] for r in rows]
            if full_kl:
                ref_full = [token_log_softmax(ref_model, r, s.temperature) for r in rows]
                old_full = [token_log_softmax(policy, r, s.temperature) for r in rows]
        old_values = None
        if critic is not None:
            value_model = llama(hf_config, critic)
            old_values = [token_values(value_model, critic["score.weight"], r) for r in rows]

    rewards = []
    for r in rows:
        x = torch.zeros(len(r.response), dtype=F64)
        x[-1] = digit_echo_score(r)
        if s.overlong is not None:
            x[-1] += overlong_score(len(r.response), s.max_response_length, *s.overlong)
        rewards.append(x)
    reward_kl = None
    if s.use_kl_in_reward:
        if s.kl_penalty == "full":
            kls = [kl_estimate(o, q, "full") for o, q in zip(old_full, ref_full)]
        else:
            kls = [kl_estimate(o, q, s.kl_penalty) for o, q in zip(old, ref)]
        rewards = [x - s.kl_coef * k for x, k in zip(rewards, kls)]
        reward_kl = _token_mean(kls)
    adv, returns = advantages_and_returns(s, rows, rewards, old_values)

    critic_steps, critic_after = [], None
    if critic is not None:
        params = {k: v.to(F64).clone().requires_grad_(True) for k, v in critic.items()}
        for mini in critic_mini_batches:
            value_model = llama(hf_config, params)
            names = dict(value_model.named_parameters())
            vals = [token_values(value_model, params["score.weight"], rows[i]) for i in mini]
            loss, metrics = critic_loss(
                s, vals, [old_values[i] for i in mini], [returns[i] for i in mini]
            )
            grads = _grads(loss, names, params)
            metrics["critic/grad_norm"] = adamw_step(
                {k: p.data for k, p in params.items()}, grads, s.critic_optim, critic_adam
            )
            critic_steps.append({"metrics": metrics, "grads": grads})
        critic_after = {k: p.detach() for k, p in params.items()}

    keep = [torch.ones(len(r.response), dtype=torch.bool) for r in rows]
    weights, correction = None, {}
    if s.rc_level is not None:
        keep, weights, correction = rollout_correction(s, rows, old)

    params = {k: v.to(F64).clone() for k, v in actor.items()}
    actor_steps = []
    for mini in actor_mini_batches:
        model = llama(hf_config, params)
        # Rejected tokens are not in the loss; a row left without any is not either.
        mini = [i for i in mini if keep[i].any()]
        outs = [token_log_probs(model, rows[i], s.temperature) for i in mini]
        k = [keep[i] for i in mini]
        full = None
        if s.use_kl_loss and s.kl_loss_type == "full":
            full = [token_log_softmax(model, rows[i], s.temperature)[m] for i, m in zip(mini, k)]
        loss, metrics = actor_loss(
            s,
            [o[0][m] for o, m in zip(outs, k)],
            [o[1][m] for o, m in zip(outs, k)],
            [old[i][m] for i, m in zip(mini, k)],
            [adv[i][m] for i, m in zip(mini, k)],
            None
            if ref is None
            else [(ref_full if full is not None else ref)[i][m] for i, m in zip(mini, k)],
            None if weights is None else [weights[i][m] for i, m in zip(mini, k)],
            full,
        )
        grads = _grads(loss, dict(model.named_parameters()), params)
        metrics["actor/grad_norm"] = adamw_step(params, grads, s.actor_optim, actor_adam)
        actor_steps.append({"metrics": metrics, "grads": grads})

    flat = torch.cat(adv)
    stats = {
        "advantages/mean": float(flat.mean()),
        "advantages/std": float(flat.std(unbiased=False)),
        "actor/entropy_rollout": _token_mean(old_entropy),
    }
    if ref is not None:
        stats["actor/kl_to_ref"] = _token_mean([o - q for o, q in zip(old, ref)])
    if critic is not None:
        stats["critic/values_mean"] = _token_mean(old_values)
        stats["critic/returns_mean"] = _token_mean(returns)
    if rows[0].rollout_log_prob is not None:
        stats.update(mismatch(rows, old))
    stats.update(correction)
    return Result(
        old_log_prob=list(old),
        ref_log_prob=ref,
        keep=keep,
        is_weights=weights,
        values=old_values,
        token_level_rewards=rewards,
        advantages=adv,
        returns=returns,
        reward_kl_penalty=reward_kl,
        batch_stats=stats,
        actor_steps=actor_steps,
        critic_steps=critic_steps,
        actor_weights=params,
        critic_weights=critic_after,
    )


def _grads(loss: torch.Tensor, named: dict, params: dict[str, torch.Tensor]):
    """d loss / d each HF-named parameter (the value head's `score.weight` included)."""
    names = [k for k in params if k in named or k == "score.weight"]
    tensors = [named[k] if k in named else params[k] for k in names]
    got = torch.autograd.grad(loss, tensors, allow_unused=True)
    return {k: (torch.zeros_like(t) if g is None else g) for k, t, g in zip(names, tensors, got)}
