"""Run the real trainer step on every rank and compare it with `tests/reference_step.py`.

    run_on_ranks(check_trainer_against_reference, world_size=4, tmp_path=tmp_path,
                 layout=dict(tp=2), base=[...], cases=[[...], ...])

Each rank builds the trainer as `launch/ppo.py` does (`build_data`, `build_roles`,
`PPOTrainer`) from `yaml_configs/tiny_cpu.yaml` plus overrides, except for the rollout
engine: `ReplayEngine` answers every prompt with seeded random tokens, so that any layout
(PP included, which the Megatron engine does not generate with) trains on a known rollout,
and responses of every length (EOS-ended or cut at the limit) meet the loss. Its log-probs
(the behaviour policy mu of the rollout correction) are the actor's own, computed in
float64 from its gathered weights, plus seeded noise of a known size (`LOG_PROB_NOISE`), so
that importance weights, truncation and rejection all meet non-trivial ratios. A case may
set `replay.repeat_frac=x`: that share of prompts (seeded) gets n identical responses, so
their groups' rewards are all equal (dynamic sampling's uninformative groups).

For each case (config overrides of the loss and the algorithm, applied to the trainer's
config between steps), one `train_step` runs while a recorder keeps what the trainer made
of the rollout (the batch the actor trains on: old / reference log-probs, values, token
rewards, advantages, returns), each optimizer step's rows and gradients (taken before
megatron-core reduces them over DP), the step's metrics, and the weights before and after
(gathered to HF names). Rank 0 runs the reference on the whole global batch and compares.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from tests import reference_step as ref

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "yaml_configs" / "tiny_cpu.yaml"

# The trainer computes in float32 and the reference in float64; each bound is ~10-100x
# the largest difference seen on CPU across the layouts, and far below what any of the
# faults the tests are there for produces (a swapped tensor moves these by 1e-2 or more).
TOL_TOKEN = 2e-5  # log-probs, values, rewards, advantages, returns (|x| up to ~10)
TOL_METRIC = 1e-5  # relative, losses and metrics (fractions are exact counts)
TOL_GRAD = 1e-4  # relative to the largest |grad| of the tensor
TOL_WEIGHT = 1e-3  # relative to lr: |Δ| against an update of ~lr per element

# Std of the seeded noise added to the actor's log-probs to make the replayed engine's:
# token ratios pi_old / mu of about exp(+-0.3), sequence ratios (up to 8 tokens) exp(+-0.85).
LOG_PROB_NOISE = 0.3

# What a step with dynamic sampling logs (`check_dynamic_sampling`).
DYNAMIC_SAMPLING_METRICS = (
    "dynamic_sampling/rounds",
    "dynamic_sampling/groups_generated",
    "dynamic_sampling/groups_informative",
    "dynamic_sampling/groups_filled",
    "dynamic_sampling/cap_reached",
)

# Keys compared with the reference, per role, when the trainer reports them.
ACTOR_METRICS = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_upper",
    "actor/pg_clipfrac_lower",
    "actor/pg_clipfrac_dual",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
    "actor/loss",
    "actor/grad_norm",
)
CRITIC_METRICS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/loss",
    "critic/grad_norm",
)

# The base settings of every probe run: tiny model in fp32, 4 prompts x 4 samples, a
# temperature that is not 1 (log-probs must divide by it), AdamW with weight decay (spared
# on norms) and an eps well above fp32 gradient noise (Adam's first step is ~lr·sign(g),
# which an eps of 1e-8 would make flip on gradients of ~1e-9), a clip that binds.
BASE = [
    "model.dtype=fp32",
    "data.train_batch_size=4",
    "rollout.n=4",
    "rollout.max_response_length=8",
    "rollout.temperature=0.8",
    "actor.optim.lr=1e-3",
    "actor.optim.weight_decay=0.1",
    "actor.optim.adam_eps=1e-5",
    "actor.optim.clip_grad=0.5",
    "critic.optim.lr=1e-3",
    "critic.optim.weight_decay=0.1",
    "critic.optim.adam_eps=1e-5",
    "critic.optim.clip_grad=0.5",
    "actor.mini_batch_size=16",
    "critic.mini_batch_size=16",
    "actor.micro_batch_size=3",
    "critic.micro_batch_size=3",
    "trainer.val_interval=0",
    "checkpoint.save_interval=0",
]


# ------------------------------------------------------------------------------ engine


def replay_engine(
    vocab_size: int, eos_id: int, actor_chunks=None, info=None, hf_config=None, groups=None
):
    """A `RolloutEngine` that answers with seeded random tokens (digits half the time).

    With the actor's chunks, its HF `info` and `hf_config` (and the run's `groups`, which
    gather them), it also returns log-probs: the actor's (transformers' Llama in float64 on
    its gathered weights) plus seeded noise.
    """
    from rl_megatron.checkpoint.hf_export import iter_hf_tensors
    from rl_megatron.rollout.batch import FinishReason, RolloutBatch
    from rl_megatron.rollout.engine import RolloutEngine

    class ReplayEngine(RolloutEngine):
        # Stands in for tiny_cpu.yaml's Megatron engine: the actor stays on the device
        # while it "generates", and a sync only stamps the version.
        generates_with_trainer_modules = True
        repeat_frac = 0.0  # share of prompts answered n times alike (uninformative groups)

        def _log_probs(self, prompts, responses, temperature: float):
            """The actor's log-probs of each response plus noise. Global rank 0 gathers the
            weights; every rank gets them and scores its own replica's rows (in float64,
            identically on the ranks of a replica)."""
            box = [dict(iter_hf_tensors(actor_chunks, info, groups, head="lm"))]  # collective
            dist.broadcast_object_list(box, src=0)
            model = ref.llama(hf_config, box[0])
            with torch.no_grad():
                return [
                    ref.token_log_probs(model, ref.Row(p, r, ()), temperature)[0].float()
                    for p, r in zip(prompts, responses)
                ]

        def sync_from(self, model_chunks, version: int) -> None:
            self.update_weights({}, version)

        def _begin_update(self) -> None: ...

        def _load_bucket(self, weights) -> None: ...

        def _finish_update(self) -> None: ...

        def _sleep(self, level: int) -> None: ...

        def _wake(self, tags) -> None: ...

        def _generate(self, prompt_token_ids, sampling, output_layout):
            gen = torch.Generator().manual_seed(sampling.seed)
            # Repeats and noise from a stream of their own: the tokens stay those of a
            # replay without them.
            extra = torch.Generator().manual_seed(sampling.seed + 7)
            prompts, responses, reasons, groups = [], [], [], []
            for i, prompt in enumerate(prompt_token_ids):
                repeat = bool(torch.rand(1, generator=extra) < self.repeat_frac)
                for j in range(sampling.n):
                    length = int(torch.randint(1, sampling.max_new_tokens + 1, (1,), generator=gen))
                    digits = torch.randint(2, 12, (length,), generator=gen)
                    other = torch.randint(2, vocab_size, (length,), generator=gen)
                    pick = torch.rand(length, generator=gen) < 0.5
                    tokens = torch.where(pick, digits, other).tolist()
                    stop = length < sampling.max_new_tokens or bool(
                        torch.rand(1, generator=gen) < 0.5
                    )
                    if stop:
                        tokens[-1] = eos_id
                    reason = FinishReason.STOP if stop else FinishReason.LENGTH
                    if repeat and j:  # the group's first response again
                        tokens, reason = list(responses[-j]), reasons[-j]
                    prompts.append(list(prompt))
                    responses.append(tokens)
                    reasons.append(reason)
                    groups.append(i)
            log_probs = None
            if actor_chunks is not None:
                actor = self._log_probs(prompts, responses, sampling.temperature)
                log_probs = [
                    (lp + LOG_PROB_NOISE * torch.randn(len(lp), generator=extra)).tolist()
                    for lp in actor
                ]
            return RolloutBatch.from_sequences(
                prompts, responses, log_probs, reasons, group_index=groups
            )

    return ReplayEngine()


def probe_config(tmp_path: Path, layout: dict, overrides: Sequence[str]):
    """tiny_cpu.yaml with `BASE`, the layout (tp, pp default 1) and `overrides`."""
    from rl_megatron.config import load_config

    layout = {"tp": 1, "pp": 1, **layout}
    return load_config(
        TINY,
        [
            *BASE,
            f"trainer.output_dir={tmp_path}",
            *(f"parallel.{k}={v}" for k, v in layout.items()),
            *overrides,
        ],
    )


def build_probe_trainer(config, run, total_steps: int):
    """The trainer `launch/ppo.py` builds, with `replay_engine` as its rollout engine."""
    from rl_megatron.trainer.build import build_data, build_roles, model_info, random_init_hf_config
    from rl_megatron.trainer.ppo_trainer import PPOTrainer

    log = logging.getLogger("trainer_probe")
    data = build_data(config, log)
    info = model_info(config)
    roles = build_roles(config, info, total_steps, run.groups)
    engine = replay_engine(
        config.model.vocab_size,
        data.tokenizer.eos_token_id,
        roles.actor.model,
        info,
        random_init_hf_config(config),
        run.groups,
    )
    engine.sleep_level = config.rollout.sleep_level  # as an engine's own build sets it
    return PPOTrainer(config, run, data, info, roles, engine, total_steps, log)


# ---------------------------------------------------------------------------- recorder


class Recorder:
    """Keeps what one `train_step` computed: the trained batch, rows and grads per step."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.batch: dict[str, torch.Tensor] | None = None
        self.steps: dict[str, list[list[int]]] = {}
        self.grads: dict[str, list[list[torch.Tensor]]] = {}
        self._undo = []
        for name, role in trainer.roles.trainable().items():
            self._wrap(name, role)

    def _wrap(self, name: str, role) -> None:
        original_train_steps = role.train_steps
        config = role.config
        original_finalize = config.finalize_model_grads_func
        self.grads[name] = []

        def train_steps(batch, steps, loss_fn, **kwargs):
            self.batch = {k: v.detach().cpu().clone() for k, v in batch.items()}
            self.steps[name] = [list(rows) for rows in steps]
            return original_train_steps(batch, steps, loss_fn, **kwargs)

        def finalize(model, *args, **kwargs):
            if model[0] is role.model[0]:
                # This rank's own gradients, before megatron-core reduces them over DP.
                self.grads[name].append(
                    [p.main_grad.detach().clone() for chunk in model for p in _params(chunk)]
                )
            return original_finalize(model, *args, **kwargs)

        role.train_steps = train_steps
        config.finalize_model_grads_func = finalize
        self._undo.append(lambda: delattr(role, "train_steps"))
        self._undo.append(lambda: setattr(config, "finalize_model_grads_func", original_finalize))

    def close(self) -> None:
        for undo in self._undo:
            undo()


def _params(chunk) -> list[torch.nn.Parameter]:
    return [p for p in chunk.parameters() if p.requires_grad]


# ------------------------------------------------------------------------- gathering


def hf_weights(role, info, head: str) -> dict[str, torch.Tensor]:
    """The role's parameters under HF names, on global rank 0 ({} elsewhere); collective."""
    from rl_megatron.checkpoint.hf_export import iter_hf_tensors

    # An offloaded role's parameters have no storage until it is reloaded.
    with role.on_device():
        return {
            name: t.double()
            for name, t in iter_hf_tensors(role.model, info, role.groups, head=head)
        }


def hf_grads(role, info, head: str, local: list[torch.Tensor], dp_group) -> dict:
    """One optimizer step's gradient under HF names (rank 0); collective.

    local: this rank's gradient per parameter (`Recorder`), i.e. of its DP share of the
    loss times the DP size (megatron-core's DDP averages over DP); their DP mean is the
    mini-batch's gradient. With context parallelism `dp_group` is DP x CP: a CP rank's
    gradient is its own tokens' share, times cp (megatron-core's schedule).
    """
    params = [p for chunk in role.model for p in _params(chunk)]
    saved = [p.data for p in params]
    try:
        for p, g in zip(params, local):
            g = g.clone()
            dist.all_reduce(g, group=dp_group)
            p.data = g / dist.get_world_size(dp_group)
        return hf_weights(role, info, head)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _gather_rows(batch: dict[str, torch.Tensor], dp_group) -> list[dict[str, torch.Tensor]]:
    """Every DP replica's batch, in DP-rank order (on every rank)."""
    out: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(out, batch, group=dp_group)
    return out


# ---------------------------------------------------------------------- the comparison


def settings_of(config, kl_coef: float) -> ref.Settings:
    a, c, al = config.actor, config.critic, config.algorithm

    def optim(o) -> ref.Optim:
        return ref.Optim(o.lr, o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps, o.clip_grad)

    rc, ob = al.rollout_correction, config.reward.overlong_buffer

    def band(x):
        return tuple(x) if isinstance(x, list) else x

    return ref.Settings(
        temperature=config.rollout.temperature,
        n=config.rollout.n,
        adv_estimator=al.adv_estimator,
        gamma=al.gamma,
        lam=al.lam,
        norm_adv_by_std=al.norm_adv_by_std,
        use_kl_in_reward=al.use_kl_in_reward,
        kl_penalty=al.kl_penalty,
        kl_coef=kl_coef,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        loss_agg_mode=a.loss_agg_mode,
        max_response_length=config.rollout.max_response_length,
        cliprange_value=c.cliprange_value,
        actor_optim=optim(a.optim),
        critic_optim=optim(c.optim) if c.enable else None,
        policy_loss=a.policy_loss,
        critic_loss_agg_mode=c.loss_agg_mode,
        rc_level=rc.level,
        rc_threshold=band(rc.threshold),
        rc_batch_normalize=rc.batch_normalize,
        rc_rejection=band(rc.rejection),
        overlong=(ob.length, ob.penalty_factor) if ob.enable else None,
    )


def rows_of(replicas: list[dict[str, torch.Tensor]], n: int) -> tuple[list[ref.Row], list[int]]:
    """Real tokens of every row of every replica; and each replica's first global row.

    A prompt's samples are consecutive rows of one replica (the engine's documented
    layout), so its group is (replica, row // n) — derived here, not read from the trainer.
    The response tokens are read from the attention mask: the actor's `response_mask` has
    lost the tokens a rollout rejection removed.
    """
    rows, offsets = [], []
    for d, b in enumerate(replicas):
        offsets.append(len(rows))
        p = b["prompts"].shape[1]
        for i in range(b["prompts"].shape[0]):
            real = b["attention_mask"][i, p:].bool()
            prompt = b["prompts"][i][b["attention_mask"][i, :p].bool()].tolist()
            response = b["responses"][i][real].tolist()
            mu = b["rollout_log_prob"][i][real].double() if "rollout_log_prob" in b else None
            rows.append(ref.Row(prompt, response, group=(d, i // n), rollout_log_prob=mu))
    return rows, offsets


def global_mini_batches(
    per_replica: list[dict[str, list[list[int]]]], offsets: list[int], role: str
) -> list[list[int]]:
    """Each optimizer step's rows as global row ids: the union of every replica's rows."""
    steps = [replica[role] for replica in per_replica]
    return [
        [offsets[d] + i for d in range(len(steps)) for i in steps[d][k]]
        for k in range(len(steps[0]))
    ]


def _per_row(t: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [t[i][mask[i].bool()].double() for i in range(t.shape[0])]


def _close(what: str, got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        diff = (g - w).abs().max().item() if g.numel() else 0.0
        assert g.shape == w.shape and diff <= tol, (
            f"{what}, row {i}: max |trainer - reference| = {diff:.3g} > {tol}\n"
            f"trainer   {g.tolist()}\nreference {w.tolist()}"
        )


def _close_metric(key: str, got: float, want: float) -> None:
    assert abs(got - want) <= TOL_METRIC * max(1.0, abs(want)), (
        f"{key}: trainer {got!r}, reference {want!r}"
    )


def _close_tensors(what: str, got: dict, want: dict, tol_of) -> None:
    assert set(got) == set(want), f"{what}: names {sorted(set(got) ^ set(want))} differ"
    for name in sorted(want):
        g, w = got[name].double(), want[name].double()
        diff = (g - w).abs().max().item()
        tol = tol_of(w)
        assert diff <= tol, f"{what} {name}: max |trainer - reference| = {diff:.3g} > {tol:.3g}"


def compare(
    s: ref.Settings,
    result: ref.Result,
    replicas: list[dict[str, torch.Tensor]],
    metrics: dict[str, float],
    grads: dict[str, list[dict]],
    after: dict[str, dict],
    critic: bool,
) -> None:
    """Assert the trainer's step equals the reference's, within the stated tolerances."""

    def real(b):  # every response token, rejected or not (`rows_of`)
        return b["attention_mask"][:, b["prompts"].shape[1] :]

    trained = {
        k: [v for b in replicas for v in _per_row(b[k], real(b))]
        for k in replicas[0]
        if replicas[0][k].shape[1:] == replicas[0]["response_mask"].shape[1:]
        and replicas[0][k].is_floating_point()
    }
    kept = [v.bool() for b in replicas for v in _per_row(b["response_mask"], real(b))]
    for i, (got, want) in enumerate(zip(kept, result.keep)):
        assert torch.equal(got, want), (
            f"tokens in the actor's loss (rollout rejection), row {i}: trainer "
            f"{got.int().tolist()}, reference {want.int().tolist()}"
        )
    if result.is_weights is not None:
        assert "rollout_is_weights" in trained, "the actor's batch has no rollout_is_weights"
        _close(
            "rollout_is_weights",
            [g[k] for g, k in zip(trained["rollout_is_weights"], result.keep)],
            [w[k] for w, k in zip(result.is_weights, result.keep)],
            TOL_TOKEN,
        )
    else:
        assert "rollout_is_weights" not in trained, "IS weights without rollout correction"
    _close("old_log_prob", trained["old_log_prob"], result.old_log_prob, TOL_TOKEN)
    if result.ref_log_prob is not None:
        _close("ref_log_prob", trained["ref_log_prob"], result.ref_log_prob, TOL_TOKEN)
    if result.values is not None:
        _close("values", trained["values"], result.values, TOL_TOKEN)
    _close(
        "token_level_rewards", trained["token_level_rewards"], result.token_level_rewards, TOL_TOKEN
    )
    _close("advantages", trained["advantages"], result.advantages, TOL_TOKEN)
    _close("returns", trained["returns"], result.returns, TOL_TOKEN)
    if result.reward_kl_penalty is not None:
        _close_metric(
            "actor/reward_kl_penalty", metrics["actor/reward_kl_penalty"], result.reward_kl_penalty
        )

    for key, want in result.batch_stats.items():
        _close_metric(key, metrics[key], want)

    def mean_over_steps(steps: list[dict], key: str) -> float:
        return sum(st["metrics"][key] for st in steps) / len(steps)

    for key in ACTOR_METRICS:
        if key in result.actor_steps[0]["metrics"]:
            assert key in metrics, f"{key} is not reported by the trainer"
            _close_metric(key, metrics[key], mean_over_steps(result.actor_steps, key))
    assert metrics["actor/steps_skipped"] == 0
    if critic:
        for key in CRITIC_METRICS:
            _close_metric(key, metrics[key], mean_over_steps(result.critic_steps, key))

    def rel(scale: float):
        return lambda w: scale * max(w.abs().max().item(), 1e-12)

    for role, steps in (("actor", result.actor_steps), ("critic", result.critic_steps)):
        assert len(grads.get(role, [])) == len(steps), (
            f"{role}: {len(grads.get(role, []))} optimizer steps, reference {len(steps)}"
        )
        for k, (got, st) in enumerate(zip(grads.get(role, []), steps)):
            _close_tensors(f"{role} gradient, optimizer step {k}", got, st["grads"], rel(TOL_GRAD))
    lr = s.actor_optim.lr
    _close_tensors(
        "actor weights after the step",
        after["actor"],
        result.actor_weights,
        lambda w: TOL_WEIGHT * lr,
    )
    if critic:
        _close_tensors(
            "critic weights after the step",
            after["critic"],
            result.critic_weights,
            lambda w: TOL_WEIGHT * s.critic_optim.lr,
        )


def check_dynamic_sampling(config, rows: list[ref.Row], metrics: dict[str, float]) -> None:
    """The step's groups under dynamic sampling, from the reference's own rewards.

    Every round reads data.train_batch_size prompts; the step trains on exactly that many
    groups; without the cap reached all of them have rewards that differ (by the
    reference's digit_echo score plus overlong shaping), and with it the rounds are
    1 + max_extra_rounds and the uninformative groups trained on are the ones counted.
    """
    missing = [k for k in DYNAMIC_SAMPLING_METRICS if k not in metrics]
    assert not missing, f"dynamic sampling on, but the step logged no {missing}"
    ds, want = config.algorithm.dynamic_sampling, config.data.train_batch_size
    ob = config.reward.overlong_buffer
    scores: dict[tuple, list[float]] = {}
    for r in rows:
        score = ref.digit_echo_score(r)
        if ob.enable:
            score += ref.overlong_score(
                len(r.response), config.rollout.max_response_length, ob.length, ob.penalty_factor
            )
        scores.setdefault(r.group, []).append(score)
    assert len(scores) == want, f"{len(scores)} groups trained on, data.train_batch_size={want}"
    idle = sum(max(g) == min(g) for g in scores.values())
    rounds = metrics["dynamic_sampling/rounds"]
    assert 1 <= rounds <= 1 + ds.max_extra_rounds, rounds
    assert metrics["dynamic_sampling/groups_generated"] == rounds * want
    assert metrics["dynamic_sampling/groups_filled"] == idle, (idle, metrics)
    if metrics["dynamic_sampling/cap_reached"]:
        assert rounds == 1 + ds.max_extra_rounds and idle > 0
        assert metrics["dynamic_sampling/groups_informative"] == want - idle
    else:
        assert idle == 0 and metrics["dynamic_sampling/groups_informative"] >= want


# ---------------------------------------------------------------------- on each rank


def check_trainer_against_reference(
    rank: int,
    world_size: int,
    tmp_path: Path,
    layout: dict,
    base: Sequence[str],
    cases: Sequence[Sequence[str]],
) -> None:
    """Spawned body: build the trainer at `layout`, run each case, compare on rank 0."""
    from megatron.core import parallel_state as ps

    from rl_megatron.algorithms.kl import build_kl_controller
    from rl_megatron.distributed import distributed_run
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.build import random_init_hf_config

    config = probe_config(tmp_path, layout, base)
    with distributed_run(
        ParallelLayout.from_config(config.parallel, world_size),
        seed=config.trainer.seed,
        timeout_s=config.parallel.timeout_s,
    ) as run:
        trainer = build_probe_trainer(config, run, total_steps=len(cases))
        roles, info = trainer.roles, trainer.info
        hf_config = random_init_hf_config(config)
        dp_group = ps.get_data_parallel_group()
        # Gradients are averaged over DP x CP (each CP rank's covers its own tokens).
        grad_group = ps.get_data_parallel_group(with_context_parallel=True)
        adam = {"actor": ref.AdamState(), "critic": ref.AdamState()}
        heads = {"actor": "lm", "critic": "value"}
        for case in cases:
            # `replay.<attribute>=<value>` entries set the replay engine, the rest the config.
            trainer.engine.repeat_frac = 0.0
            for entry in case:
                if entry.startswith("replay."):
                    name, value = entry.removeprefix("replay.").split("=")
                    setattr(trainer.engine, name, float(value))
            case = [entry for entry in case if not entry.startswith("replay.")]
            trainer.config = probe_config(tmp_path, layout, [*base, *case])
            kl = trainer.config.algorithm.kl_ctrl
            trainer.kl_ctrl = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
            kl_coef = trainer.kl_ctrl.value
            # The roles are built once; the case's model keys that they read at run time:
            for role in (roles.actor, roles.reference):
                if role is not None:
                    role.logprob_chunk_tokens = trainer.config.model.logprob_chunk_tokens
            trainable = roles.trainable()
            before = {n: hf_weights(r, info, heads[n]) for n, r in trainable.items()}
            before_ref = hf_weights(roles.reference, info, "lm") if roles.reference else None
            recorder = Recorder(trainer)
            try:
                metrics = trainer.train_step()
            finally:
                recorder.close()
            trainer.step += 1
            replicas = _gather_rows(recorder.batch, dp_group)
            all_steps = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(all_steps, recorder.steps, group=dp_group)
            grads = {
                n: [hf_grads(r, info, heads[n], g, grad_group) for g in recorder.grads[n]]
                for n, r in trainable.items()
            }
            after = {n: hf_weights(r, info, heads[n]) for n, r in trainable.items()}
            if rank != 0:
                continue
            s = settings_of(trainer.config, kl_coef)
            rows, offsets = rows_of(replicas, s.n)

            critic = "critic" in trainable
            result = ref.reference_step(
                s,
                hf_config,
                rows,
                before["actor"],
                before_ref,
                before.get("critic"),
                global_mini_batches(all_steps, offsets, "actor"),
                global_mini_batches(all_steps, offsets, "critic") if critic else [],
                adam["actor"],
                adam["critic"] if critic else None,
            )
            try:
                compare(s, result, replicas, metrics, grads, after, critic)
                if trainer.config.algorithm.dynamic_sampling.enable:
                    check_dynamic_sampling(trainer.config, rows, metrics)
                if s.policy_loss == "vanilla" and any("clip_ratio_c=" in e for e in case):
                    # A case that sets the dual clip's bound must reach it: below it the
                    # bound changes nothing and the comparison cannot tell it was applied.
                    dual = metrics["actor/pg_clipfrac_dual"]
                    assert dual > 0, f"no ratio reached actor.clip_ratio_c ({dual=})"
            except AssertionError as exc:
                raise AssertionError(
                    f"case {list(case)} at layout {config.parallel}: {exc}"
                ) from None
