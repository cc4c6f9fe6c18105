"""The trainer's PPO / GRPO step equals a plain-PyTorch reference written from the formulas.

Every test runs the real `PPOTrainer.train_step` (roles, megatron-core schedules, DDP and
the distributed optimizer) on a replayed rollout and compares with `tests/reference_step.py`
on the same rollout and weights: old / reference log-probs, values, token rewards (KL in
reward), advantages and returns, every loss term and metric, each optimizer step's
gradients, and the weights after the step (`tests/trainer_probe.py`, tolerances there).
Where the two disagree, the trainer is wrong until shown otherwise.

Each case is one training step with its own config (the loss and algorithm keys), applied
to the same trainer in turn, so the optimizer's state carries over as in a run.
"""

from __future__ import annotations

import pytest

from tests.spawn import run_on_ranks
from tests.trainer_probe import check_trainer_against_reference

ALL_ROLES = ["critic.enable=true", "reference.enable=true"]

# Every estimator and every loss aggregation, with the entropy bonus, the KL loss and the
# KL reward penalty (each estimator of it) on in turn; several mini-batches and PPO epochs.
# Then the policy losses (GSPO, CISPO), the rollout correction at both levels (TIS,
# IcePop, rejection, batch normalisation; the replayed engine's log-probs are the actor's
# plus noise, trainer_probe.LOG_PROB_NOISE), DAPO's overlong shaping and dynamic sampling
# (half the prompts answered alike; then a cap that binds), the critic's aggregation and the
# abs / full KL estimators.
CASES = [
    [
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.9",
        "algorithm.gamma=0.95",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=k1",
        "algorithm.kl_ctrl.kl_coef=0.2",
        "actor.entropy_coeff=0.01",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=k3",
        "actor.kl_loss_coef=0.1",
    ],
    [
        "algorithm.adv_estimator=grpo",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=k2",
        "actor.kl_loss_coef=0.5",
        "actor.ppo_epochs=2",
        "actor.mini_batch_size=8",
        "critic.mini_batch_size=8",
        "model.logprob_chunk_tokens=0",  # the output layer's whole logits
    ],
    [
        "algorithm.adv_estimator=rloo",
        "actor.loss_agg_mode=seq-mean-token-sum",
        "actor.entropy_coeff=0.05",
        "actor.clip_ratio_high=0.28",
        "actor.ppo_epochs=2",
        "model.logprob_chunk_tokens=3",  # many chunks per micro-batch (default: one here)
    ],
    [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.gamma=0.9",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=k3",
        "algorithm.kl_ctrl.kl_coef=0.3",
        "actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor.entropy_coeff=0.02",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.2",
    ],
    [
        "algorithm.adv_estimator=reinforce_plus_plus_baseline",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=k2",
        "algorithm.kl_ctrl.kl_coef=0.5",
        "actor.clip_ratio_c=1.05",  # low enough that ratios reach it (6% of tokens here)
        "actor.ppo_epochs=3",
        "actor.mini_batch_size=8",
    ],
    [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std=false",
        "actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor.mini_batch_size=8",
        "critic.mini_batch_size=8",
        "critic.ppo_epochs=2",
        "critic.cliprange_value=0.05",
    ],
    [  # 6
        "algorithm.adv_estimator=grpo",
        "actor.policy_loss=gspo",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.clip_ratio_low=0.0003",
        "actor.clip_ratio_high=0.0004",
        "actor.ppo_epochs=2",
        "actor.mini_batch_size=8",
        "algorithm.rollout_correction.level=token",
        "algorithm.rollout_correction.threshold=1.2",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.length=4",
        "reward.overlong_buffer.penalty_factor=0.5",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=full",
        "algorithm.kl_ctrl.kl_coef=0.5",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=full",
        "actor.kl_loss_coef=0.5",
    ],
    [  # 7
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=abs",
        "algorithm.kl_ctrl.kl_coef=0.2",
        "actor.policy_loss=cispo",
        "actor.clip_ratio_high=0.01",
        "actor.ppo_epochs=2",
        "actor.mini_batch_size=8",
        "critic.loss_agg_mode=seq-mean-token-sum-norm",
        "algorithm.rollout_correction.level=sequence",
        "algorithm.rollout_correction.threshold=[0.6, 1.6]",
        "algorithm.rollout_correction.batch_normalize=true",
        "algorithm.rollout_correction.rejection=[0.4, 2.5]",
    ],
    [  # 8
        "algorithm.adv_estimator=rloo",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=abs",
        "actor.kl_loss_coef=0.3",
        "actor.ppo_epochs=2",
        "algorithm.rollout_correction.level=token",
        "algorithm.rollout_correction.threshold=null",
        "algorithm.rollout_correction.rejection=[0.7, 1.4]",
    ],
    [  # 9
        "algorithm.adv_estimator=grpo",
        "algorithm.dynamic_sampling.enable=true",
        "replay.repeat_frac=0.5",
        "algorithm.rollout_correction.level=token",
        "algorithm.rollout_correction.threshold=[0.5, 2.0]",
        "algorithm.rollout_correction.batch_normalize=true",
    ],
    [  # 10: the cap binds: the step trains on what it found, filled up and reported
        "algorithm.adv_estimator=grpo",
        "algorithm.dynamic_sampling.enable=true",
        "algorithm.dynamic_sampling.max_extra_rounds=1",
        "replay.repeat_frac=0.8",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.length=8",
    ],
]


def test_one_rank_every_estimator_and_loss_mode(tmp_path):
    run_on_ranks(
        check_trainer_against_reference,
        world_size=1,
        tmp_path=tmp_path,
        layout={},
        base=ALL_ROLES,
        cases=CASES,
    )


@pytest.mark.parametrize(
    "name, extra",
    [
        (
            "dynamic micro-batches",
            ["actor.use_dynamic_batch=true", "actor.max_tokens_per_micro_batch=40"],
        ),
        ("packed sequences", ["model.pack_sequences=true"]),
    ],
)
def test_one_rank_micro_batching(tmp_path, name, extra):
    run_on_ranks(
        check_trainer_against_reference,
        world_size=1,
        tmp_path=tmp_path,
        layout={},
        base=[*ALL_ROLES, *extra],
        cases=[CASES[0], CASES[1]],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, extra, cases",
    [
        # DP=2: losses normalised over both replicas, gradients averaged by DDP; the IS
        # weights' statistics and dynamic sampling's counts over both, each replica filling
        # its own share; the exact KL from vocabulary shards (TP=2).
        ({"tp": 2}, [], [0, 1, 4, 6, 9]),
        # The interleaved schedule: micro-batches of 5 rows split a replica's 8 rows as
        # 5 + 3, so the second is filled up with copies that must count nowhere (cases
        # with one mini-batch per epoch: 4 rows would make 1 micro-batch, not 2).
        (
            {"pp": 2, "vpp": 2},
            ["actor.micro_batch_size=5", "critic.micro_batch_size=5"],
            [0, 2, 3, 8],
        ),
        # TP and PP together, with dynamic micro-batches.
        (
            {"tp": 2, "pp": 2},
            ["actor.use_dynamic_batch=true", "actor.max_tokens_per_micro_batch=40"],
            [0, 1, 4, 7],
        ),
        # Context parallelism: each sequence split over two ranks, gathered once; rows
        # shared within the CP pair, losses normalised over the DP pair only.
        ({"cp": 2}, [], [0, 1, 2, 6]),
    ],
    ids=["tp2-dp2", "pp2-vpp2-dp2", "tp2-pp2-dynamic", "cp2-dp2"],
)
def test_four_ranks(tmp_path, layout, extra, cases):
    run_on_ranks(
        check_trainer_against_reference,
        world_size=4,
        tmp_path=tmp_path,
        layout=layout,
        base=[*ALL_ROLES, *extra],
        cases=[CASES[i] for i in cases],
    )


@pytest.mark.slow
def test_four_ranks_packed_dp4(tmp_path):
    """Packing with DP=4: each replica holds one prompt's four samples."""
    run_on_ranks(
        check_trainer_against_reference,
        world_size=4,
        tmp_path=tmp_path,
        layout={},
        base=[*ALL_ROLES, "model.pack_sequences=true"],
        cases=[CASES[2], CASES[3]],
    )
