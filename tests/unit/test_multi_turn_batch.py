"""A multi-turn batch through the trainer's pieces equals the same tokens computed by hand.

The trajectories below interleave sampled turns with observations; `trajectory_batch`
makes the rows the trainer trains on. Every quantity the loop derives from them
(token rewards, GRPO / GAE advantages, the policy loss, the KL loss, the entropy bonus) is
recomputed here from each trajectory's sampled tokens alone, concatenated: observation
tokens must count nowhere, neither in a sum nor in a normaliser nor in a recursion.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_megatron.algorithms.advantages import compute_advantages
from rl_megatron.algorithms.kl import kl_loss
from rl_megatron.algorithms.losses import entropy_bonus, policy_loss
from rl_megatron.rollout.trajectory import Trajectory, trajectory_batch
from rl_megatron.trainer import experience as ex
from rl_megatron.trainer.multi_turn import trajectory_round
from rl_megatron.trainer.rollout_records import records_of

F64 = torch.float64


def trajectory(group, sample, prompt, parts, reason, reward):
    """parts: ("turn", ids) / ("obs", ids) in order."""
    t = Trajectory(group=group, sample=sample)
    t.set_prompt(prompt)
    for kind, ids in parts:
        if kind == "turn":
            t.add_turn(ids, [-0.1 * (k + 1) for k in range(len(ids))])
        else:
            t.add_observation(ids)
    t.finish(reason)
    t.reward = reward
    return t


def batch_of_trajectories():
    return [
        # record 0: two turns around a 3-token observation, then a short one
        trajectory(0, 0, [5, 6, 7], [("turn", [8, 9, 1]), ("obs", [20, 21, 22]), ("turn", [10, 1])], "done", 1.0),
        trajectory(0, 1, [5, 6, 7], [("turn", [11, 1])], "done", 0.0),
        # record 1: three turns, two observations of different lengths
        trajectory(1, 0, [4], [("turn", [8, 1]), ("obs", [23]), ("turn", [9, 9, 1]), ("obs", [24, 25]), ("turn", [12])], "turn_length", 0.5),
        trajectory(1, 1, [4], [("turn", [13, 14, 1]), ("obs", [26, 27, 28, 29]), ("turn", [1])], "max_turns", 2.0),
    ]  # fmt: skip


def sampled(t: Trajectory) -> list[int]:
    """Indices (into the response) of the tokens the policy sampled, from the spans."""
    return [k - t.prompt_length for s, e in t.turns for k in range(s, e)]


def test_rows_mask_and_groups():
    trajs = batch_of_trajectories()
    rollout = trajectory_batch(trajs, with_log_probs=True, pad_token_id=0)
    for i, t in enumerate(trajs):
        prompt, response = rollout.row_tokens(i)
        assert prompt + response == t.token_ids
        mask = rollout.response_mask[i, : len(response)].tolist()
        assert [k for k, m in enumerate(mask) if m] == sampled(t)
        for s, e in t.observations:  # every observation token is out of the loss
            assert mask[s - t.prompt_length : e - t.prompt_length] == [0] * (e - s)
        assert rollout.attention_mask[i].sum() == len(t.token_ids)  # but attended to
        lps = rollout.rollout_log_probs[i, : len(response)].tolist()
        assert lps == pytest.approx(t.logprobs[t.prompt_length :])
    assert rollout.group_index.tolist() == [0, 0, 1, 1]  # GRPO groups: per record
    assert rollout.finish_reasons == ["stop", "stop", "length", "stop"]


def test_reward_sits_on_the_last_sampled_token():
    trajs = batch_of_trajectories()
    rollout = trajectory_batch(trajs, with_log_probs=False, pad_token_id=0)
    scores = torch.tensor([t.reward for t in trajs])
    rewards = ex.token_level_scores(scores, rollout.response_mask)
    for i, t in enumerate(trajs):
        last = sampled(t)[-1]
        expected = torch.zeros(rollout.responses.shape[1])
        expected[last] = t.reward
        assert torch.equal(rewards[i], expected), i
    # A reward model's score is read there too.
    values = torch.arange(rollout.responses.numel(), dtype=torch.float32).view_as(rewards)
    got = ex.sequence_scores_at_last_token(values, rollout.response_mask)
    assert got.tolist() == [values[i, sampled(t)[-1]].item() for i, t in enumerate(trajs)]


def test_grpo_advantages_loss_kl_and_entropy_by_hand():
    torch.manual_seed(0)
    trajs = batch_of_trajectories()
    rollout = trajectory_batch(trajs, with_log_probs=True, pad_token_id=0)
    mask = rollout.response_mask
    shape = mask.shape
    # Observation and padding positions get huge values: any use of them shows.
    junk = torch.where(mask.bool(), 0.0, 1e3)
    log_prob = torch.randn(shape, dtype=F64) * 0.3 - 1 + junk
    old = log_prob.detach() + torch.randn(shape, dtype=F64) * 0.4
    ref = log_prob.detach() + torch.randn(shape, dtype=F64) * 0.2 - junk
    entropy = torch.rand(shape, dtype=F64) + junk
    scores = torch.tensor([t.reward for t in trajs], dtype=F64)
    rewards = ex.token_level_scores(scores, mask)
    adv, _ = compute_advantages("grpo", rewards, mask, group_index=rollout.group_index)
    loss, _ = policy_loss(log_prob, old, adv, mask, 0.2, 0.28, agg_mode="token-mean")
    kl, _ = kl_loss(log_prob, ref, mask, "k3", "token-mean")
    bonus, _ = entropy_bonus(entropy, mask, "seq-mean-token-mean")

    # By hand: each trajectory's sampled tokens only.
    by_group: dict[int, list[float]] = {}
    for t in trajs:
        by_group.setdefault(t.group, []).append(t.reward)
    pg_sum = kl_sum = 0.0
    count = 0
    seq_entropy = []
    for i, t in enumerate(trajs):
        idx = sampled(t)
        group = torch.tensor(by_group[t.group], dtype=F64)
        a = (t.reward - group.mean()) / (group.std() + 1e-6)  # GRPO, unbiased std
        a = a.to(torch.float32).to(F64)  # the trainer's token rewards are float32
        assert torch.allclose(adv[i, idx].to(F64), a.expand(len(idx)), atol=1e-6)
        assert torch.all(adv[i][~mask[i].bool()] == 0)
        lp, o, r = log_prob[i, idx], old[i, idx], ref[i, idx]
        ratio = torch.exp(lp - o)
        pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.28))
        pg_sum += pg.sum().item()
        k3 = (torch.exp(r - lp) - (r - lp) - 1).clamp(-10, 10)
        kl_sum += k3.sum().item()
        count += len(idx)
        seq_entropy.append(entropy[i, idx].mean().item())
    assert loss.item() == pytest.approx(pg_sum / count, rel=1e-6)  # float32 advantages
    assert kl.item() == pytest.approx(kl_sum / count, rel=1e-9)
    assert bonus.item() == pytest.approx(sum(seq_entropy) / len(seq_entropy), rel=1e-9)


def test_gae_skips_observations():
    """GAE over a multi-turn row equals GAE over its sampled tokens laid end to end: an
    observation is not a step of the policy (its values and rewards are ignored)."""
    torch.manual_seed(1)
    trajs = batch_of_trajectories()
    rollout = trajectory_batch(trajs, with_log_probs=False, pad_token_id=0)
    mask = rollout.response_mask
    junk = torch.where(mask.bool(), 0.0, 50.0)
    values = torch.randn(mask.shape, dtype=F64) + junk
    scores = torch.tensor([t.reward for t in trajs], dtype=F64)
    rewards = (
        ex.token_level_scores(scores, mask).to(F64)
        + 0.1 * torch.randn(mask.shape, dtype=F64) * mask
    )
    gamma, lam = 0.9, 0.8
    adv, returns = compute_advantages(
        "gae", rewards + junk, mask, values=values, gamma=gamma, lam=lam, norm_by_std=False
    )
    raw = []
    for i, t in enumerate(trajs):
        idx = sampled(t)
        r, v = rewards[i, idx], values[i, idx]
        a, next_a, next_v = torch.zeros(len(idx), dtype=F64), 0.0, 0.0
        for k in reversed(range(len(idx))):
            delta = r[k] + gamma * next_v - v[k]
            next_a = delta + gamma * lam * next_a
            next_v = v[k]
            a[k] = next_a
        assert torch.allclose(returns[i, idx], a + v), i
        raw.append(a)
    # Whitening over the sampled tokens of the whole batch only.
    flat = torch.cat(raw)
    white = (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)
    got = torch.cat([adv[i, sampled(t)] for i, t in enumerate(trajs)])
    assert torch.allclose(got, white, atol=1e-9)


class _Tok:
    """Ids as text; 1 (the fixtures' stop token) is special: the records must keep it."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 1))


def test_records_split_turns_and_observations_off_the_mask():
    trajs = batch_of_trajectories()
    trajs[0].metrics = {"tool_calls": 1.0}
    rollout, per_row = trajectory_round(
        trajs, with_log_probs=True, pad_token_id=0, weight_version=3
    )
    assert per_row["mt/turns"].tolist() == [2, 1, 3, 2]
    assert per_row["mt/observation_tokens"].tolist() == [3, 0, 3, 4]
    assert per_row["mt/env/tool_calls"].tolist() == [1, 0, 0, 0]
    assert per_row["mt/finish_turn_length"].tolist() == [0, 0, 1, 0]
    scores = torch.tensor([t.reward for t in trajs])
    records = records_of(rollout, scores, _Tok(), step=7, dp_rank=0, per_row=per_row)
    third = records[2]
    assert [t["text"] for t in third["turns"]] == ["8 1", "9 9 1", "12"]
    assert [o["text"] for o in third["observations"]] == ["23", "24 25"]
    assert third["num_turns"] == 3 and third["finish_reason"] == "turn_length"
    assert third["token_ids"] == trajs[2].token_ids
    assert third["loss_mask"] == trajs[2].loss_mask
    assert third["env_reward"] == 0.5 and math.isclose(third["reward"], 0.5)
    assert records[3]["observations"] == [{"text": "26 27 28 29"}]
