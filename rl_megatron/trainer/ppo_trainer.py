"""The PPO / GRPO loop (DESIGN.md §2), one step read top to bottom in `train_step`.

    rollout   actor weights → engine (reshard), generate n responses per prompt, rewards
              (with dynamic sampling, rounds until the step's groups are informative)
    score     actor old log-probs, reference log-probs, critic values
    advantage GAE / GRPO / RLOO / REINFORCE++ (pure functions, DP-reduced statistics)
    correct   importance weights / rejection for the rollout engine's mismatch
    update    PPO epochs × mini-batches × micro-batches: critic, then actor
    bookkeep  metrics, evaluation, checkpoint, SIGTERM

Every rank runs every line (SPMD). The ranks of one data-parallel replica read the same
prompts and hold the same rollout rows; replicas hold different rows, and everything that
is a statistic of the batch (whitening, loss normalisation, metrics) is reduced over DP.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from rl_megatron.algorithms.advantages import compute_advantages
from rl_megatron.algorithms.dapo import overlong_penalty
from rl_megatron.algorithms.kl import apply_kl_penalty, build_kl_controller, kl_loss
from rl_megatron.algorithms.losses import entropy_bonus, explained_variance, policy_loss, value_loss
from rl_megatron.algorithms.rollout_correction import mismatch_metrics
from rl_megatron.checkpoint.training_state import CheckpointManager
from rl_megatron.config import Config
from rl_megatron.data.sampler import PromptSampler, eval_batches
from rl_megatron.distributed import DistributedRun
from rl_megatron.models.hf_config import HFModelInfo
from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.sync_probe import probe_metrics, probe_prompts, probe_sampling
from rl_megatron.trainer import checkpointing
from rl_megatron.trainer import experience as ex
from rl_megatron.trainer import multi_turn as mt
from rl_megatron.trainer.build import Roles, TrainingData
from rl_megatron.trainer.dynamic_sampling import Collected, Round, collect_groups
from rl_megatron.trainer.hf_snapshots import HFSnapshots, PeftSnapshots
from rl_megatron.trainer.optimizer_step import NonFiniteUpdateError
from rl_megatron.trainer.partial_rollouts import PartialRollouts, ReplicaStates, staleness_metrics
from rl_megatron.trainer.reporting import batch_stats, console_line, throughput
from rl_megatron.trainer.roles import MegatronRole
from rl_megatron.trainer.rollout_records import RolloutRecords
from rl_megatron.trainer.sampling_seeds import step_sampling
from rl_megatron.trainer.scoring import RewardScorer
from rl_megatron.trainer.split_rollouts import TrainingSide
from rl_megatron.trainer.split_rollouts import total_steps as count_steps
from rl_megatron.utils.metrics import MetricsTracker, wandb_settings
from rl_megatron.utils.timers import PhaseTimer, device_used_gb

Batch = dict[str, torch.Tensor]


# A colocated_async phase's counts summed over the replicas (the others: their mean).
_ASYNC_SUMS = (
    "async/restarted",
    "async/dropped",
    "async/draws",
    "async/carried_groups",
    "async/carried_partial_samples",
    "async/generated_tokens",
)


class PPOTrainer:
    """Owns the run's state: roles, engine, data position, KL controller, step."""

    def __init__(
        self,
        config: Config,
        run: DistributedRun,
        data: TrainingData,
        info: HFModelInfo,
        roles: Roles,
        engine,
        total_steps: int,
        logger,
        split: TrainingSide | None = None,
    ) -> None:
        self.config, self.run, self.data, self.info = config, run, data, info
        # trainer.mode: split_async: other ranks generate (`split_rollouts.py`); no engine here.
        self.split = split
        self.device = run.device  # where collectives' tensors live (NCCL needs the GPU)
        self.roles, self.engine, self.total_steps, self.log = roles, engine, total_steps, logger
        self.dp_group = run.groups.dp
        self.dp_rank, self.dp_size = run.coordinates["dp"], run.layout.dp
        self.sampler = PromptSampler.from_config(
            config, len(data.train), self.dp_rank, self.dp_size
        )
        # The ranks of a replica score the same rows.
        self.scorer = RewardScorer(
            config, roles.reward_model, data.tokenizer, run.groups.replica, self.device, logger
        )
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.metrics = MetricsTracker(
            config.run_dir, run.env.rank, config.logging.tensorboard, wandb=wandb_settings(config)
        )
        # What a resumed run needs, registered by name (trainer/checkpointing.py).
        self.checkpoints = checkpointing.RunCheckpoints(
            CheckpointManager(
                config.run_dir / "checkpoints", keep_last=config.checkpoint.keep_last
            ),
            config.checkpoint,
        )
        for name, role in roles.trainable().items():
            head = "value" if role.value_head else "lm"
            sidecar = checkpointing.sidecar(config, info, head, run.layout)
            # A LoRA actor's checkpoints reference its frozen base instead of holding it.
            lora_base = config.model.hf_path if name == "actor" else None
            self.checkpoints.register_role(name, role, sidecar, hf_base=lora_base)
        # trainer.mode: colocated_async: groups in flight across steps (partial rollouts).
        # Each replica then draws records at its own pace: its data position is its own,
        # saved with its buffer.
        self.partial = None
        if config.trainer.mode == "colocated_async":
            r = config.rollout
            reach = r.partial.chunk_tokens * (r.max_staleness + 1)
            if r.partial.enable and r.on_stale == "restart" and reach < r.max_response_length:
                logger.warning(
                    "rollout.partial.chunk_tokens=%d x (rollout.max_staleness=%d + 1) = %d < "
                    "rollout.max_response_length=%d: a sample longer than %d tokens cannot "
                    "finish within the staleness bound; it restarts and is never trained",
                    r.partial.chunk_tokens,
                    r.max_staleness,
                    reach,
                    r.max_response_length,
                    reach,
                )
            self.partial = PartialRollouts(
                r.n,
                r.max_response_length,
                r.partial.chunk_tokens if r.partial.enable else r.max_response_length,
                (r.partial.in_flight_batches - 1) * self.sampler.local_batch_size
                if r.partial.enable
                else 0,
                r.max_staleness,
                r.on_stale,
                with_log_probs=self._engine_log_probs(),
            )
            self.checkpoints.register(
                "async_rollouts",
                ReplicaStates(
                    {"sampler": self.sampler, "buffer": self.partial}, self.dp_rank, self.dp_group
                ),
            )
        else:
            self.checkpoints.register("sampler", self.sampler)
        self.checkpoints.register("kl_ctrl", self.kl_ctrl)
        # checkpoint.save_hf: the actor as an HF model folder beside every checkpoint.
        self.hf_snapshots = (
            HFSnapshots(config, info, data.tokenizer, run.env.rank, run.groups)
            if config.checkpoint.save_hf
            else None
        )
        # checkpoint.save_hf_adapter: a LoRA actor's adapters as a PEFT folder beside them too.
        self.peft_snapshots = (
            PeftSnapshots(config, info, run.env.rank, run.groups)
            if config.checkpoint.save_hf_adapter
            else None
        )
        # The phases' `_on_device` peaks: torch counts the engine's memory asleep as allocated.
        self.phases = PhaseTimer(off_device_bytes=engine.unmapped_bytes if engine else None)
        # trainer.dump_rollouts: each step's trajectories as JSONL, for the user to read.
        self.rollout_records = (
            RolloutRecords(
                config.run_dir, data.tokenizer, self.dp_rank, self.dp_group, run.env.rank
            )
            if config.trainer.dump_rollouts
            else None
        )
        # environment.function: multi-turn rollouts through the environment's workers.
        self.session = mt.build_session(config, data.tokenizer, logger)
        # rollout.sync_probe_prompts: a fixed batch sampled after each step's sync and scored
        # with the old log-probs (rollout/sync_probe.py): the engine-vs-trainer mismatch.
        count = config.rollout.sync_probe_prompts
        val = data.val.input_ids if data.val is not None else None
        self.probe_prompts = probe_prompts(data.train.input_ids, val, count) if count else None
        self._probe: RolloutBatch | None = None  # sampled after this step's sync
        self.step = 0  # optimizer steps of the actor taken so far = the next step's index
        self.resumed = False

    # ------------------------------------------------------------------------ driver

    def fit(self) -> None:
        """Train until `total_steps`, evaluating and checkpointing on schedule or SIGTERM."""
        self.resume()
        cfg = self.config
        # Before any step: a run resumed at its end tells the generation ranks so, too.
        self._start_split()
        while self.step < self.total_steps:
            started = time.perf_counter()
            metrics = self.train_step()
            self.step += 1
            if cfg.trainer.val_interval and self.step % cfg.trainer.val_interval == 0:
                with self.phases.time("evaluate"):
                    metrics.update(self.evaluate())
            stop = self._stop_requested()
            due = cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0
            if due or self.step == self.total_steps or (stop and cfg.checkpoint.save_on_sigterm):
                self.save()
            # The step's record is written once its evaluation and checkpoint are done, so
            # that their timings and memory figures are this step's (train_step took the
            # training phases'; read before them, they went into the next step's record,
            # and the last step's nowhere).
            metrics.update(self.phases.pop())
            metrics["timing_s/step"] = time.perf_counter() - started
            self.metrics.log(self.step, metrics)
            if self.run.env.rank == 0 and self.step % cfg.logging.log_interval == 0:
                print(console_line(self.step, self.total_steps, metrics), flush=True)
            if stop:
                self.log.info("SIGTERM: stopped after step %d (checkpoint saved)", self.step)
                if self.split is not None:
                    self.split.stop()  # the generation ranks end too
                break
        if cfg.trainer.manual_gc:
            gc.enable()
        if self.session is not None:
            self.session.shutdown()
        self.metrics.close()

    def train_step(self) -> dict[str, float]:
        """One PPO iteration; returns this step's metrics (identical on every rank)."""
        roles, cfg = self.roles, self.config
        self._collect_garbage()

        # 1. Rollout: the engine gets this step's weights, then samples n responses to each
        #    prompt, which are scored (reward function or model, DAPO's overlong shaping).
        #    With dynamic sampling, more prompts until every group's rewards differ.
        collected, sync = self._rollout()
        rollout, scores = collected.rollout, collected.scores
        if self.rollout_records is not None:  # numbered as metrics.jsonl numbers the step
            self.rollout_records.write(self.step + 1, rollout, scores, collected.per_row)
        batch = self._to_device(ex.training_batch(rollout))
        mask = batch["response_mask"]

        # 2. Score: recompute the sampling policy's log-probs (never trust the engine's),
        #    the reference's and the critic's values. An exact (`full`) KL penalty needs
        #    the reference's logits beside the actor's.
        beside = self._full_kl_reference(cfg.algorithm.use_kl_in_reward, cfg.algorithm.kl_penalty)
        with self.phases.time("old_log_probs"), roles.actor.on_device(), _on_device(beside):
            old = roles.actor.forward_only(batch, with_entropy=True, kl_to=beside)
        batch["old_log_prob"] = old["log_prob"]
        probe = self._probe_mismatch()  # the same weights as the sync's: the engine's
        if roles.reference is not None:
            with self.phases.time("reference"), roles.reference.on_device():
                batch["ref_log_prob"] = roles.reference.forward_only(batch)["log_prob"]
        if roles.critic is not None:
            with self.phases.time("values"), roles.critic.on_device():
                batch["values"] = roles.critic.forward_only(batch)["values"]

        # 3. Advantages.
        rewards = ex.token_level_scores(scores.to(self.device), mask)
        kl_metrics: dict[str, float] = {}
        if cfg.algorithm.use_kl_in_reward:
            rewards, raw = apply_kl_penalty(
                rewards,
                batch["old_log_prob"],
                batch["ref_log_prob"],
                mask,
                self.kl_ctrl.value,
                cfg.algorithm.kl_penalty,
                group=self.dp_group,
                full_kl=old.get("kl_full"),
            )
            kl_metrics = {k: float(v) for k, v in raw.items()}  # already over all of DP
        batch["token_level_rewards"] = rewards
        batch["advantages"], batch["returns"] = compute_advantages(
            cfg.algorithm.adv_estimator,
            rewards,
            mask,
            values=batch.get("values"),
            group_index=rollout.group_index.to(self.device),
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
            norm_by_std=cfg.algorithm.norm_adv_by_std,
            group=self.dp_group,
        )

        # 4. Off-policy correction: the engine's policy mu sampled the batch, the clip's
        #    proximal policy is old_log_prob (decoupled PPO, DESIGN.md §7). The actor's loss
        #    gets importance weights pi_old / mu, and loses the tokens rejection removes.
        actor_batch, correction_metrics = ex.rollout_correction(
            batch, cfg.algorithm.rollout_correction, self.dp_group
        )

        # 5. Update: critic first (it does not depend on the actor's new weights).
        critic_metrics: dict[str, float] = {}
        if roles.critic is not None:
            with self.phases.time("update_critic"), roles.critic.on_device():
                critic_metrics = self._update(roles.critic, batch, self._critic_loss, "critic")
            critic_metrics["critic/explained_variance"] = float(
                explained_variance(batch["values"], batch["returns"], mask, self.dp_group)
            )
        beside = self._full_kl_reference(cfg.actor.use_kl_loss, cfg.actor.kl_loss_type)
        with self.phases.time("update_actor"), roles.actor.on_device(), _on_device(beside):
            actor_metrics = self._update(
                roles.actor,
                actor_batch,
                self._actor_loss,
                "actor",
                kl_to=beside,
                while_last_step_runs=(
                    self._wake_engine_weights_early
                    if cfg.rollout.wake_weights_during_update and self.engine is not None
                    else None
                ),
            )
        if cfg.algorithm.use_kl_in_reward:
            # The batch's KL over all replicas, so every rank's controller stays the same.
            kl = kl_metrics["actor/reward_kl_penalty"]
            self.kl_ctrl.update(kl, cfg.data.train_batch_size * cfg.rollout.n)

        # 6. Metrics (DP-averaged where they are per-replica statistics).
        local = {**rollout.metrics(), **collected.reward_metrics()}
        metrics = ex.dp_mean(local, self.dp_group, sums=("reward/errors", "rollout/num_samples"))
        # Token statistics of the whole batch (sums over DP, not a mean of per-rank means).
        metrics.update(batch_stats(batch, old["entropy"], self.dp_group), **kl_metrics)
        if "rollout_log_prob" in batch:  # the engine's log-probs, when it computed them
            mismatch = mismatch_metrics(
                batch["rollout_log_prob"], batch["old_log_prob"], mask, group=self.dp_group
            )
            metrics.update({k: float(v) for k, v in mismatch.items()})
        if "routed_experts" in batch:  # routing replay: the routers' own choices vs the engine's
            routing_mismatch = roles.actor.routing_mismatch_frac()
            if routing_mismatch is not None:
                metrics["rollout/routing_mismatch_frac"] = routing_mismatch
        if self.session is not None:  # turns, tool calls, ... of the rows trained on
            metrics.update(mt.step_metrics(collected.per_row, self.dp_group))
        if self.partial is not None or self.split is not None:
            # Staleness of the tokens trained on, the phase's counts.
            versions = collected.per_row["async/token_versions"].to(mask.device)
            metrics.update(staleness_metrics(versions, mask, self.step, self.dp_group))
            phase = {**self._phase_metrics}
            phase["async/partial_fraction"] = collected.per_row["async/partial"].mean().item()
            metrics.update(ex.dp_mean(phase, self.dp_group, sums=_ASYNC_SUMS))
        if self.split is not None:  # the generation side's throughput, apart from training's
            generate_s = max(metrics["split/generate_s"], 1e-9)
            metrics["split/generate_tokens_per_s"] = metrics["async/generated_tokens"] / generate_s
        metrics.update(correction_metrics, **collected.metrics)
        metrics.update(actor_metrics, **critic_metrics, **sync, **probe, **self.sampler.metrics())
        metrics.update(self.data.metrics())  # rollout/prompts_truncated: counted at load
        metrics["actor/kl_coef"] = self.kl_ctrl.value
        metrics.update(self.phases.pop())
        metrics.update(throughput(metrics, self.info, self.config.actor.ppo_epochs))
        if self.partial is not None:  # what generation did, apart from what was trained
            generate_s = max(metrics.get("timing_s/generate", 0.0), 1e-9)
            metrics["async/generate_tokens_per_s"] = metrics["async/generated_tokens"] / generate_s
        return metrics

    def _probe_mismatch(self) -> dict[str, float]:
        """`sync_probe/*` of the batch sampled after this step's sync (none: {}): the
        actor's log-probs of its tokens against the engine's (the actor is on the device)."""
        if self._probe is None:
            return {}
        probe, self._probe = self._probe, None
        with self.phases.time("sync_probe_log_probs"), self.roles.actor.on_device():
            batch = self._to_device(ex.training_batch(probe))
            trainer = self.roles.actor.forward_only(batch)["log_prob"]
        return probe_metrics(
            batch["rollout_log_prob"], trainer, batch["response_mask"], group=self.dp_group
        )

    def _collect_garbage(self) -> None:
        """With `trainer.manual_gc`: automatic collection off from the first step on, and a
        timed collection (`timing_s/gc`) before it and every `manual_gc_interval` steps."""
        t = self.config.trainer
        if not t.manual_gc:
            return
        first = gc.isenabled()
        gc.disable()
        if first or (t.manual_gc_interval and self.step % t.manual_gc_interval == 0):
            with self.phases.time("gc"):
                gc.collect()

    # ------------------------------------------------------------------ rollout

    def _sampling(
        self, step: int, evaluation: bool = False, round_index: int = 0
    ) -> SamplingParams:
        return step_sampling(
            self.config,
            self.data.tokenizer.eos_token_id,
            step,
            self.dp_rank,
            self.dp_size,
            self.sampler.local_batch_size,
            multi_turn=self.session is not None,
            evaluation=evaluation,
            round_index=round_index,
        )

    def _rollout(self) -> tuple[Collected, dict[str, float]]:
        """Sync the engine to the actor's weights (version = step), then the step's rounds
        of generation and scoring (`dynamic_sampling.collect_groups`); the engine sleeps
        after each, and while the roles train."""
        if self.split is not None:
            return self._split_rollout()
        ds = self.config.algorithm.dynamic_sampling
        with contextlib.ExitStack() as actor_on_device:
            actor_on_device.enter_context(self.roles.actor.on_device())
            with self.phases.time("reshard"):
                sync = self._sync_engine(version=self.step)
            if not self.engine.generates_with_trainer_modules:
                actor_on_device.close()  # the engine has its own copy now
            # After the actor's weights went (if they are offloaded): the memory the roles
            # trained in goes back to the engine. Not part of the weight sync: its cost
            # grows with the KV cache, not with the weights.
            with self.phases.time("wake_kv_cache"):
                self._wake_kv_cache("wake_kv_cache")
            if self.probe_prompts is not None:
                with self.phases.time("sync_probe"):
                    eos = self.data.tokenizer.eos_token_id
                    sampling = probe_sampling(self.config.rollout, self.config.trainer.seed, eos)
                    self._probe = self._generate(self.probe_prompts, sampling)
            collected = collect_groups(
                self._rollout_round if self.partial is None else self._partial_round,
                self.sampler.local_batch_size,
                self.config.rollout.n,
                ds.enable,
                ds.max_extra_rounds,
                self.dp_group,
                self.log,
            )
        return collected, sync

    def _start_split(self) -> None:
        """split_async, once per process: tell the generation ranks where the run stands
        (the step and this replica's data position)."""
        if self.split is not None and self.split.schedule is None:
            r = self.config.rollout
            self.split.start(
                self.step, self.total_steps, r.max_staleness, self.sampler.state_dict()
            )

    def _split_rollout(self) -> tuple[Collected, dict[str, float]]:
        """split_async: this step's batch from the generation ranks (after the weights the
        schedule sends first); the records must be the ones this replica draws next."""
        self._start_split()  # (train_step alone, as benchmarks call it, starts here)
        with self.roles.actor.on_device():
            received, sync = self.split.rollout(self.step, self.roles.actor.model, self.phases.time)
        records = self.sampler.next_batch()
        if list(records) != list(received.records):
            raise RuntimeError(
                f"split_async: step {self.step}'s batch holds records {received.records[:4]}..., "
                f"this replica draws {list(records)[:4]}...: the two sides' data positions differ"
            )
        rollout = received.rollout
        samples = [records[int(g)] for g in rollout.group_index]
        per_row = {
            "async/token_versions": torch.full(
                tuple(rollout.responses.shape), received.version, dtype=torch.int64
            ),
            "async/partial": torch.zeros(rollout.responses.shape[0], dtype=torch.float64),
            "async/record": torch.tensor(samples, dtype=torch.int64),
        }
        round_ = self._scored_round(rollout, samples, per_row, None)
        collected = collect_groups(
            lambda _: round_, len(records), self.config.rollout.n, False, 0, self.dp_group, self.log
        )
        self._phase_metrics = dict(received.generator)
        return collected, sync

    def _rollout_round(self, round_index: int) -> Round:
        """The next prompts' n responses each, scored; the engine sleeps afterwards."""
        if round_index:  # the last round's engine slept, keeping its weights
            self.engine.prepare_for_generation()
        indices = self.sampler.next_batch()
        sampling = self._sampling(self.step, round_index=round_index)
        answers, per_row = None, {}
        with self.phases.time("generate"):
            if self.session is None:
                prompts = [self.data.train.input_ids[i] for i in indices]
                rollout = self._generate(prompts, sampling)
            else:
                rollout, per_row, answers = self._generate_trajectories(indices, sampling)
        # Another round generates with these weights (no sync before it): keep them.
        self.engine.release_for_training(keep_weights=self.config.algorithm.dynamic_sampling.enable)
        self._record_device_used("engine_asleep")
        samples = [indices[int(g)] for g in rollout.group_index]
        return self._scored_round(rollout, samples, per_row, answers)

    def _partial_round(self, round_index: int) -> Round:
        """colocated_async: the step's groups from the partial-rollout buffer (finished in
        this phase or waiting from an earlier one); the others stay in flight."""
        local = self.sampler.local_batch_size

        def draw(d: int) -> tuple[list[int], list[list[int]], int | None]:
            indices = self.sampler.next_batch()  # the d-th local batch of this replica
            prompts = [self.data.train.input_ids[i] for i in indices]
            return indices, prompts, self._sampling(d).seed

        def generate(prompts, max_new_tokens, seeds) -> RolloutBatch:
            sampling = replace(
                self._sampling(self.step),
                n=1,
                max_new_tokens=max_new_tokens,
                seed=None,
                prompt_seeds=None if seeds[0] is None else tuple(seeds),
                # A continuation's prompt holds its tokens so far: the context bounds it.
                max_prompt_len=None,
                prompt_overflow="reject",
            )
            return self._generate(prompts, sampling)

        with self.phases.time("generate"):
            phase = self.partial.phase(self.step, local, draw, generate)
        self.engine.release_for_training(keep_weights=False)
        self._record_device_used("engine_asleep")
        rollout, per_row, samples = PartialRollouts.to_rows(
            phase.groups, self.engine.pad_token_id, self.engine.weight_version
        )
        self._phase_metrics = phase.metrics
        return self._scored_round(rollout, samples, per_row, None)

    def _scored_round(
        self,
        rollout: RolloutBatch,
        samples: list[int],
        per_row: dict[str, torch.Tensor],
        answers: list[str] | None,
    ) -> Round:
        """A round's rows scored: the reward function's or model's scores (plus the
        environment's with multi-turn) and DAPO's overlong shaping."""
        with self.phases.time("reward"):
            scores, m = self._score(
                rollout, self.data.train.dataset, samples, answers, self.step + 1
            )
            if self.session is not None:  # the environment's reward, added to the rule's
                scores = scores + per_row["mt/env_reward"].to(scores.dtype)
            ob, limit = self.config.reward.overlong_buffer, self.config.rollout.max_response_length
            if ob.enable:  # DAPO's soft overlong punishment, part of the reward
                penalty = overlong_penalty(
                    rollout.response_lengths, limit, ob.length, ob.penalty_factor
                )
                scores, per_row["overlong_penalty"] = scores + penalty, penalty
        return Round(rollout, scores, per_row, m.get("reward/errors"))

    def _generate_trajectories(
        self, indices: list[int], sampling: SamplingParams
    ) -> tuple[RolloutBatch, dict[str, torch.Tensor], list[str]]:
        """Multi-turn: `sampling.n` trajectories per record through the environment; the
        rows, their per-row facts (`trainer/multi_turn.py`) and each one's final answer."""
        records = [self.data.train.dataset[i] for i in indices]
        trajectories, _ = self.engine.generate_trajectories(
            records, sampling, self.session, group=self.run.groups.replica
        )
        rollout, per_row = mt.trajectory_round(
            trajectories,
            with_log_probs=self._engine_log_probs(),
            pad_token_id=self.engine.pad_token_id,
            weight_version=self.engine.weight_version,
        )
        return rollout, per_row, [t.final_answer for t in trajectories]

    def _engine_log_probs(self) -> bool:
        """Whether the engine returns sampled log-probs (`rollout.calculate_log_probs`)."""
        return bool(getattr(self.engine, "calculate_log_probs", True))

    def _score(
        self,
        rollout: RolloutBatch | None,
        dataset,
        samples: list[int],
        answers: list[str] | None,
        step: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward function's or model's scores of `rollout`'s rows; with multi-turn
        the rule scores each trajectory's final answer, and a run without a rule
        (`reward.function: null`) takes the environment's reward alone (zeros here)."""
        if self.session is not None and self.config.reward.type == "rule":
            if self.config.reward.function is None:
                return torch.zeros(len(samples)), {}
            return self.scorer.score(rollout, dataset, samples, None, step, texts=answers)
        # Only a reward model reads the batch; the step as the console numbers it.
        batch = None
        if self.roles.reward_model is not None and rollout is not None:
            batch = self._to_device(ex.training_batch(rollout))
        return self.scorer.score(rollout, dataset, samples, batch, step)

    def _sync_engine(self, version: int, phase: str = "reshard") -> dict[str, float]:
        """Put the actor's current weights into the engine as `version`: its weights wake
        first; its KV cache wakes once they are in (`_wake_kv_cache`, `RolloutEngine.wake`).

        Each part is timed (`timing_parts_s/<phase>/<part>`): waking the weights (after a
        level-2 sleep: mapping their memory back, nothing copied; nothing left to do when
        the update woke them, `_wake_engine_weights_early`), the sync (its host-side
        pieces in `reshard/*_s`: preparing the plan, the engine's begin, issuing the
        copies, the engine's finish with its prefix-cache reset)."""
        self.engine.prepare_for_sync(functools.partial(self.phases.part, phase))
        if version == 0 and self.engine.weight_version == 0 and not self.resumed:
            # The engine holds the weights the actor starts from (it loaded model.hf_path,
            # or generates with the actor's modules): nothing to move.
            stats = None
        else:
            with self.phases.part(phase, "sync"):
                stats = self.engine.sync_from(self.roles.actor.model, version)
        if stats is None:
            return {}
        verified = {}
        if stats.verify is not None:  # rollout.verify_sync, on this sync
            verified = {
                "sync/verify_s": stats.verify.verify_s,
                "sync/verified_tensors": float(stats.verify.verified_tensors),
                "sync/verified_bytes": float(stats.verify.verified_bytes),
            }
        return verified | {
            "reshard/bytes_received_gb": stats.bytes_received / 1e9,
            "reshard/bytes_sent_gb": stats.bytes_sent / 1e9,
            "reshard/prepare_s": stats.prepare_s,
            "reshard/begin_s": stats.begin_s,
            "reshard/issue_copies_s": stats.wall_s,
            "reshard/finish_s": stats.finish_s,
            # 1: the copies from the rank's own shards were CUDA graph replays (copy_program)
            "reshard/copy_graphs": float(stats.copies_replayed),
        }

    def _wake_engine_weights_early(self) -> None:
        """While the device runs the actor's last optimizer step: map the engine's weights
        back (a level-1 or 2 sleep released them), so that the next sync has nothing to wake
        (`rollout.wake_weights_during_update`). Mapping them is host work for the driver,
        ~4-9 ms/GB on an H200, against 0.7-1.2 ms/GB for the sync itself; the step's Adam
        hid 4-5 of the 11.5 ms at 0.85B (benchmarks/runs/2026-12-02-h200-run16-wake-during-update-8b.md). Only when
        they fit beside what the roles hold now (`RolloutEngine.wake_if_room`); otherwise
        the sync wakes them, giving torch's cached memory back first. The update's memory
        peaks are taken before: the wake changes what sleeps, not what the update used."""
        self.phases.close_peaks("update_actor")
        with self.phases.overlapped("update_actor", "wake_engine_weights"):
            woke = self.engine.prefetch_weights()
        self.phases.record("reshard/weights_woken_during_update", float(woke))

    def _wake_kv_cache(self, phase: str) -> None:
        """The engine's KV cache back (in `phase`), after its weights are in and the actor's
        put away (`RolloutEngine.prepare_for_generation`): peak memory never holds two
        models plus a KV cache. Its pieces are timed apart (`timing_parts_s/<phase>/
        make_room_for_kv_cache`, `wake_kv_cache`), so that the phase's `_on_device` peaks
        see the release of torch's cache and the engine's memory mapped in intervals of
        their own (`PhaseTimer`)."""
        self.engine.prepare_for_generation(functools.partial(self.phases.part, phase))
        self._record_device_used("engine_awake")

    def _record_device_used(self, state: str) -> None:
        """Device memory in use (the driver's figure) with the engine in `state`
        (`memory_gb/<state>_device_used`; GPUs only), and what the engine's own allocator
        holds mapped then (`memory_gb/<state>_mapped`, vLLM in sleep mode): the latter's
        difference between awake and asleep is what the engine gives back while the roles
        train; the driver's also moves with what torch keeps cached, which the engine gives
        back before a wake only when the wake needs it."""
        used = device_used_gb()
        if used is not None:
            self.phases.record(f"memory_gb/{state}_device_used", used)
        mapped = self.engine.mapped_bytes()
        if mapped is not None:
            self.phases.record(f"memory_gb/{state}_mapped", mapped / 2**30)

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        return self.engine.generate(prompts, sampling, output_layout="full")

    # ------------------------------------------------------------------- update

    def _actor_loss(self, out: Batch, mb: Batch, totals):
        a = self.config.actor
        mask = mb["response_mask"]
        # seq-mean-token-sum-norm's constant: the configured response length, not the
        # micro-batch's trimmed width (which would make the loss depend on the split).
        norm_len = self.config.rollout.max_response_length
        loss, metrics = policy_loss(
            out["log_prob"],
            mb["old_log_prob"],
            mb["advantages"],
            mask,
            a.clip_ratio_low,
            a.clip_ratio_high,
            a.clip_ratio_c,
            a.loss_agg_mode,
            totals=totals,
            norm_len=norm_len,
            loss_mode=a.policy_loss,
            rollout_is_weights=mb.get("rollout_is_weights"),
        )
        if a.entropy_coeff:
            bonus, m = entropy_bonus(
                out["entropy"], mask, a.loss_agg_mode, totals=totals, norm_len=norm_len
            )
            loss = loss - a.entropy_coeff * bonus
            metrics.update(m)
        if a.use_kl_loss:
            kl, m = kl_loss(
                out["log_prob"],
                mb["ref_log_prob"],
                mask,
                a.kl_loss_type,
                a.loss_agg_mode,
                totals=totals,
                norm_len=norm_len,
                full_kl=out.get("kl_full"),
            )
            loss = loss + a.kl_loss_coef * kl
            metrics.update(m)
        return loss, metrics

    def _critic_loss(self, out: Batch, mb: Batch, totals):
        c = self.config.critic
        return value_loss(
            out["values"],
            mb["values"],
            mb["returns"],
            mb["response_mask"],
            c.cliprange_value,
            c.loss_agg_mode,
            totals=totals,
            norm_len=self.config.rollout.max_response_length,
        )

    def _full_kl_reference(self, used: bool, kind: str) -> MegatronRole | None:
        """The reference role when a KL term is the exact one (`full`): its logits are
        computed beside the actor's on each micro-batch (`MegatronRole.forward_only`)."""
        return self.roles.reference if used and kind == "full" else None

    def _update(
        self,
        role: MegatronRole,
        batch: Batch,
        loss_fn,
        name: str,
        kl_to=None,
        while_last_step_runs=None,
    ) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; metrics averaged over optimizer steps,
        `<name>/steps_skipped` counts the steps a non-finite loss or grad norm dropped.
        kl_to: the reference, for an exact KL loss (`_full_kl_reference`).
        while_last_step_runs: as in `MegatronRole.train_steps`."""
        section = self.config.actor if name == "actor" else self.config.critic
        rows = batch["prompts"].shape[0]
        per_rank = section.mini_batch_size // self.dp_size
        # Same permutation on every rank of a replica; a pure function of the step.
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 1009 + self.step)
        with_entropy = name == "actor" and self.config.actor.entropy_coeff != 0
        steps = [
            mini
            for _ in range(section.ppo_epochs)
            for mini in ex.mini_batch_rows(rows, per_rank, generator)
        ]
        try:
            per_step = role.train_steps(
                batch,
                steps,
                loss_fn,
                with_entropy=with_entropy,
                kl_to=kl_to,
                while_last_step_runs=while_last_step_runs,
            )
        except NonFiniteUpdateError as exc:
            # Raised on every rank alike, before the optimizer step: the weights the
            # engine would get next are the last finite ones. Steps count from 1 here,
            # as on the console.
            raise NonFiniteUpdateError(f"step {self.step + 1}: {exc}") from None
        metrics = {}
        for key in per_step[0]:
            short = key if "/" in key else f"{name}/{key}"
            metrics[short] = sum(m[key] for m in per_step) / len(per_step)
        del metrics[f"{name}/skipped"]
        metrics[f"{name}/steps_skipped"] = sum(m["skipped"] for m in per_step)
        return metrics

    # --------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy responses to every held-out prompt once; `val/...` metrics."""
        val = self.data.val
        if val is None:
            return {}
        with self.roles.actor.on_device():
            self._sync_engine(version=self.step, phase="evaluate")
            # In parts of its own: the evaluate phase's `_on_device` peaks need boundaries
            # between this wake and the sleep that ends the evaluation (`PhaseTimer`).
            self._wake_kv_cache("evaluate")
        totals = torch.zeros(3, dtype=torch.float64)  # reward sum, length sum, count
        batches = eval_batches(
            len(val), self.config.data.val_batch_size, self.dp_rank, self.dp_size
        )
        for batch_index, rows in enumerate(batches):
            # Every rank walks the same batches; a replica with an empty share (the last
            # batch may be uneven) generates nothing (unless the engine's generate spans
            # replicas: then it joins with no prompts) but joins the reward collectives.
            rollout, answers, env_reward = None, None, None
            if rows or self.engine.needs_every_replica:
                sampling = self._sampling(batch_index, evaluation=True)
                with contextlib.ExitStack() as stack:
                    if self.engine.generates_with_trainer_modules:
                        stack.enter_context(self.roles.actor.on_device())
                    if self.session is None:
                        rollout = self._generate([val.input_ids[i] for i in rows], sampling)
                    else:
                        trajectories, _ = self.engine.generate_trajectories(
                            [val.dataset[i] for i in rows],
                            sampling,
                            self.session,
                            group=self.run.groups.replica,
                        )
                        if rows:
                            rollout, per_row = mt.trajectory_round(
                                trajectories,
                                with_log_probs=False,
                                pad_token_id=self.engine.pad_token_id,
                                weight_version=self.engine.weight_version,
                            )
                            answers = [t.final_answer for t in trajectories]
                            env_reward = per_row["mt/env_reward"]
            if not rows:
                rollout = None
            scores, _ = self._score(rollout, val.dataset, rows, answers, self.step)
            if env_reward is not None:
                scores = scores + env_reward.to(scores.dtype)
            if rows:
                totals += torch.tensor(
                    [scores.sum().item(), rollout.response_lengths.sum().item(), len(rows)],
                    dtype=torch.float64,
                )
        self.engine.release_for_training()
        totals = totals.to(self.device)
        dist.all_reduce(totals, group=self.dp_group)
        count = max(totals[2].item(), 1.0)
        return {
            "val/reward_mean": totals[0].item() / count,
            "val/response_length_mean": totals[1].item() / count,
            "val/num_prompts": totals[2].item(),
        }

    # -------------------------------------------------------------- checkpoints

    def save(self) -> None:
        """Checkpoint the run after `self.step` optimizer steps (collective)."""
        with self.phases.time("checkpoint"):
            self.checkpoints.save(self.step)
        if self.hf_snapshots is not None:
            with self.phases.time("save_hf"), self.roles.actor.on_device():
                self.hf_snapshots.save(self.roles.actor.model, self.step, self.log)
        if self.peft_snapshots is not None:
            with self.phases.time("save_hf_adapter"), self.roles.actor.on_device():
                self.peft_snapshots.save(self.roles.actor.model, self.step, self.log)

    def resume(self) -> None:
        """Continue from `checkpoint.resume_from`, or the run's newest checkpoint (auto)."""
        step = self.checkpoints.resume(self.log)
        if step is not None:
            self.step, self.resumed = step, True
            for exports in (self.hf_snapshots, self.peft_snapshots):
                if exports is not None:  # an export a kill interrupted: redone
                    with self.roles.actor.on_device():
                        exports.redo_missing(self.roles.actor.model, step, self.log)

    # -------------------------------------------------------------------- misc

    def _to_device(self, batch: Batch) -> Batch:
        """Rollouts arrive on the CPU; scores, advantages and DP reductions run here."""
        return {k: v.to(self.device) for k, v in batch.items()}

    def _stop_requested(self) -> bool:
        """SIGTERM on any rank stops all of them after the same step."""
        flag = torch.tensor([1.0 if self.run.stop_requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _on_device(role: MegatronRole | None):
    """`role.on_device()`, or nothing for no role."""
    return contextlib.nullcontext() if role is None else role.on_device()


def build_trainer(config: Config, run: DistributedRun, logger) -> PPOTrainer:
    """Data, model roles and rollout engine from the config; raises user errors first."""
    from rl_megatron.trainer.build import build_data, build_engine, build_roles, model_info

    data = build_data(config, logger)
    info = model_info(config)
    total_steps = count_steps(config, len(data.train))
    roles = build_roles(config, info, total_steps, run.groups)
    if config.trainer.mode == "split_async":
        from rl_megatron.trainer.split_rollouts import training_side

        split = training_side(config, info, run)
        return PPOTrainer(config, run, data, info, roles, None, total_steps, logger, split)
    engine = build_engine(config, info, roles.actor, data.tokenizer, run)
    return PPOTrainer(config, run, data, info, roles, engine, total_steps, logger)
