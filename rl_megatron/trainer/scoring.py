"""Sequence rewards of a rollout (the "score" phase's rewards, DESIGN.md §2).

    scorer = RewardScorer(config, roles.reward_model, tokenizer, replica_group, device, log)
    scores, metrics = scorer.score(rollout, dataset, rows, batch, step)  # collective; step 1-based

A reward model's value at each response's last token, or the rule function
(`reward.function`) run on the first rank of each replica and copied to the others. Every
rank gets the same scores as the rest of its replica; failures are raised on every rank
together. A user function ("module:function") runs in a worker process, each call limited
to `reward.timeout_s` (`rewards/user_calls.py`), and the batch to half of
`parallel.timeout_s`: the scoring rank always reaches the collectives below, with a score
or a failure to share, before the other ranks waiting in them give up.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from rl_megatron.config import Config
from rl_megatron.data.datasets import PromptDataset
from rl_megatron.rewards.registry import RewardError, reward_fn_from_config
from rl_megatron.rewards.scoring import score_batch
from rl_megatron.rewards.user_calls import TimedWorker
from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.trainer import experience as ex
from rl_megatron.trainer.roles import MegatronRole

Batch = dict[str, torch.Tensor]


class RewardScorer:
    """The run's reward: `reward_model` when there is one, else the rule function."""

    def __init__(
        self,
        config: Config,
        reward_model: MegatronRole | None,
        tokenizer,
        replica_group: dist.ProcessGroup,
        device: torch.device,
        logger: logging.Logger,
    ) -> None:
        """
        Args:
            config: the run's config (`reward.*`; `data.answer_key` for rule functions).
            reward_model: the reward model role (`reward.type=model`), or None.
            tokenizer: decodes responses for the rule function (`batch_decode`).
            replica_group: the ranks of one data-parallel replica (TP × PP).
            device: where collectives' tensors live (NCCL needs the GPU).
            logger: where the rule function's first error is logged.
        """
        self.reward_config = config.reward
        self.reward_model, self.tokenizer = reward_model, tokenizer
        self.device, self.log = device, logger
        # The replica's ranks (TP × PP) agree on rewards through its first rank.
        self.replica_group = replica_group
        self.replica_src = dist.get_process_group_ranks(replica_group)[0]
        # No rule (reward.function: null): a multi-turn run on the environment's reward.
        rule = config.reward.type == "rule" and config.reward.function is not None
        self.reward_fn = reward_fn_from_config(config) if rule else None
        if self.reward_fn is not None and ":" in config.reward.function:
            # User code: time-limited, in a process of its own. The built-in rules are
            # ours, bounded and cheap; they stay in this process.
            self.reward_fn = TimedWorker(
                self.reward_fn, config.reward.function, config.reward.timeout_s
            )
        self.budget_s = config.parallel.timeout_s / 2

    def score(
        self,
        rollout: RolloutBatch | None,
        dataset: PromptDataset,
        rows: list[int],
        batch: Batch | None,
        step: int,
        texts: list[str] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Sequence rewards `[b]` of a rollout whose row i answers `dataset[rows[i]]`.

        The same on every rank of the replica. Collective over the whole world (failures
        are raised on every rank together), so every rank calls it, with 0 rows if need be.

        Args:
            rollout: the responses (None with 0 rows).
            dataset: the records the prompts came from (the rule function's `sample`).
            rows: `dataset` index of each rollout row, `[b]`.
            batch: the rollout's training batch on the device (the reward model's input).
            step: the number of the step being scored as the console prints it (1-based:
                `train_step` passes `self.step + 1`; the evaluation after step N passes N),
                for the error message.
            texts: what the rule function scores, per row, instead of the decoded response
                (a multi-turn trajectory's final answer).

        Returns:
            scores `[b]` on the CPU, and `reward/mean`, `reward/std` (and `reward/errors`
            for a rule) of this rank's rows; no metrics with 0 rows.
        """
        n = len(rows)
        if self.reward_model is not None:
            if n == 0:
                return torch.zeros(0), {}
            with self.reward_model.on_device():
                values = self.reward_model.forward_only(batch)["values"]
            scores = ex.sequence_scores_at_last_token(values, batch["response_mask"]).cpu()
            return scores, {
                "reward/mean": scores.mean().item(),
                "reward/std": scores.std(unbiased=False).item(),
            }
        rcfg = self.reward_config
        message = ""
        scores = torch.zeros(n)
        errors = torch.zeros(1)
        if dist.get_rank() == self.replica_src and n:
            # One rank scores (user functions need not be deterministic); the rest copy.
            if texts is None:
                texts = self.tokenizer.batch_decode([rollout.row_tokens(i)[1] for i in range(n)])
            try:
                scores, m = score_batch(
                    self.reward_fn,
                    texts,
                    [dataset[i] for i in rows],
                    on_error=rcfg.on_error,
                    error_score=rcfg.error_score,
                    names=[dataset.sources[i] for i in rows],
                    logger=self.log,
                    budget_s=self.budget_s,
                )
                errors[0] = m["reward/errors"]
            except RewardError as exc:
                message, errors[0] = str(exc), -1.0
        shared = torch.cat([scores, errors]).to(self.device)
        dist.broadcast(shared, src=self.replica_src, group=self.replica_group)
        scores, errors = shared[:n].cpu(), shared[n:].cpu()
        # One collective for both checks. Failures and counts are summed over every rank
        # of every replica (each replica's counted once per rank on both sides, so the
        # ratio is exact).
        failed = errors.item() < 0
        total = torch.tensor(
            [float(failed), 0.0 if failed else errors.item(), float(n)], device=self.device
        )
        dist.all_reduce(total)
        if total[0] > 0:
            # Every rank raises the first failing rank's message, so rank 0 can print it
            # and none is left waiting in a collective.
            messages: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(messages, message)
            raise RewardError(next(m for m in messages if m))
        if total[1] > 0 and total[1] == total[2]:
            replica_size = dist.get_world_size(self.replica_group)
            raise RewardError(
                f"reward.function: {rcfg.function!r} failed on every sample of step "
                f"{step} ({int(total[2]) // max(replica_size, 1)} samples); "
                "the first error is logged above"
            )
        if not n:
            return scores, {}
        return scores, {
            "reward/mean": scores.mean().item(),
            "reward/std": scores.std(unbiased=False).item(),
            "reward/errors": errors.item(),
        }
