"""Break one line of the trainer at a time; the tests that guard it must fail for each.

    .venv/bin/python tests/mutations.py            # every mutation (~25 minutes on 2 cores)
    .venv/bin/python tests/mutations.py sign GRPO  # those whose name contains a word

Each mutation copies the repository (without .venv and .git) to a temporary folder,
replaces one exact line there, and runs the test that must catch it against the copy
(PYTHONPATH puts the copy first, spawned ranks included). A mutation the test does not
catch is printed MISSED and the script exits 1. Not part of `make test`: it re-runs the
slowest tests once per mutation. The faults are issue 17's list (the one-line faults that
once passed the whole suite), the bugs the reference step found, and issue 20's wiring
(rollout correction, GSPO / CISPO, DAPO, the critic's aggregation, the KL estimators),
issue 22's (log-probs from the hidden states, context parallelism), the Megatron
engine's routing record (routing replay), issue 21's engine sleep levels, batch
padding and vLLM core loop, and issue 36's edges (non-finite values other than NaN, the
dual clip engaged, routing replay's gate weights and sequence parallelism, dynamic
sampling across replicas, the restricted unpickler), and issue 39's per-prompt caps on
new tokens in both engines, issue 38's environment-worker cap, worker reuse and copied turn requests, and issue 41's LoRA
merged weight sync and PEFT export (rows split two ways, shard order, the scale, the
tool's merge), and issue 39's split placement (data position, seeds, the stop, the weight plan's
destinations).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "tests/multirank/test_trainer_reference.py"
ONE_RANK = f"{REFERENCE}::test_one_rank_every_estimator_and_loss_mode"
TP_DP = f"{REFERENCE}::test_four_ranks[tp2-dp2]"
VPP = f"{REFERENCE}::test_four_ranks[pp2-vpp2-dp2]"
NONFINITE = "tests/multirank/test_nonfinite_update.py"
TRAINER = "rl_megatron/trainer/ppo_trainer.py"
ROLES = "rl_megatron/trainer/roles.py"
HEADS = "rl_megatron/trainer/heads.py"
EXPERIENCE = "rl_megatron/trainer/experience.py"
ENGINE = "rl_megatron/rollout/megatron/engine.py"
RECORDING = "tests/multirank/test_router_replay.py::test_megatron_engine_records_the_routing"
DP_ALGORITHMS = (
    "tests/multirank/test_algorithms_dp.py::test_dp_whitening_and_global_loss_normalisation"
)
UNPICKLER = "tests/unit/test_checkpoint_integrity.py"
LORA = "rl_megatron/models/lora.py"
LORA_TEST = "tests/multirank/test_lora.py::test_lora_across_layouts"
LORA_SYNC_TEST = "tests/multirank/test_lora_sync.py"
PEFT = "rl_megatron/checkpoint/peft_export.py"
PEFT_TEST = "tests/multirank/test_peft_export.py"
SPLIT = "rl_megatron/trainer/split_rollouts.py"
SPLIT_TEST = "tests/e2e/test_split_placement.py"

# (name, file, exact text, replacement, the test that must fail)
MUTATIONS = [
    (
        "LoRA scale inverted (rank/alpha)",
        LORA,
        "self.mode, self.rank, self.scale = mode, rank, alpha / rank",
        "self.mode, self.rank, self.scale = mode, rank, rank / alpha",
        LORA_TEST,
    ),
    (
        "LoRA B not zero at init",
        LORA,
        "self.lora_b = torch.nn.Parameter(torch.zeros(out_local, rank, **kw))",
        "self.lora_b = torch.nn.Parameter(torch.full((out_local, rank), 1e-3, **kw))",
        LORA_TEST,
    ),
    (
        "LoRA adapters_disabled does not disable",
        LORA,
        "        a.enabled = False",
        "        a.enabled = True",
        LORA_TEST,
    ),
    (
        "LoRA merge without the scale",
        LORA,
        "    return (adapter.lora_b.to(dtype) @ lora_a.to(dtype)) * adapter.scale",
        "    return (adapter.lora_b.to(dtype) @ lora_a.to(dtype))",
        LORA_TEST,
    ),
    (
        "LoRA row-parallel partial sums not reduced over TP",
        LORA,
        "h = tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=group)",
        "h = h",
        LORA_TEST,
    ),
    (
        "LoRA head: log-probs from the hidden states ignore its adapter",
        "rl_megatron/models/chunked_logprobs.py",
        "    return head_weight(gpt, gpt.output_layer.weight)",
        "    return gpt.output_layer.weight",
        LORA_TEST,
    ),
    (
        "LoRA head: A's gradient not summed over TP in the chunked log-probs",
        LORA,
        "        lora_a = tensor_parallel.copy_to_tensor_model_parallel_region(",
        "        lora_a = (lambda t, group: t)(",
        LORA_TEST,
    ),
    (
        "sync probe compares the engine with itself",
        "rl_megatron/rollout/sync_probe.py",
        "    diff = (trainer_log_prob.double() - engine_log_prob.double())[valid].abs().cpu()",
        "    diff = (engine_log_prob.double() - engine_log_prob.double())[valid].abs().cpu()",
        "tests/unit/test_sync_probe.py",
    ),
    (
        "LoRA adapter sync: vLLM keeps the adapter version it loaded first",
        "rl_megatron/rollout/vllm/engine.py",
        "        reload = LoRARequest(name, adapter_id, str(folder), load_inplace=True)",
        "        reload = LoRARequest(name, adapter_id, str(folder), load_inplace=False)",
        "tests/vllm/test_trainer_vllm.py::test_grpo_with_a_lora_adapter_in_vllm",
    ),
    (
        "old log-probs replaced by the new (ratio 1)",
        TRAINER,
        'mb["old_log_prob"],',
        'out["log_prob"].detach(),',
        ONE_RANK,
    ),
    ("critic trained towards its own values", TRAINER, 'mb["returns"],', 'mb["values"],', ONE_RANK),
    (
        "KL-in-reward arguments swapped",
        TRAINER,
        'batch["old_log_prob"],\n                batch["ref_log_prob"],',
        'batch["ref_log_prob"],\n                batch["old_log_prob"],',
        ONE_RANK,
    ),
    (
        "KL-loss sign flipped",
        TRAINER,
        "loss = loss + a.kl_loss_coef * kl",
        "loss = loss - a.kl_loss_coef * kl",
        ONE_RANK,
    ),
    (
        "entropy-bonus sign flipped",
        TRAINER,
        "loss = loss - a.entropy_coeff * bonus",
        "loss = loss + a.entropy_coeff * bonus",
        ONE_RANK,
    ),
    (
        "every GRPO group merged into one",
        TRAINER,
        "group_index=rollout.group_index.to(self.device)",
        "group_index=torch.zeros_like(rollout.group_index).to(self.device)",
        ONE_RANK,
    ),
    (
        "critic reads the wrong column",
        HEADS,
        'index = batch["gather_index"] + (1 - self.output_shift) * self.value_head',
        'index = batch["gather_index"] + self.value_head',
        ONE_RANK,
    ),
    (
        "interleaved filler rows counted as response tokens",
        "rl_megatron/trainer/micro_batches.py",
        'sub["response_mask"][len(rows) :] = 0',
        "pass",
        VPP,
    ),
    (
        "seq-mean-token-sum-norm by the micro-batch's width",
        TRAINER,
        "norm_len=norm_len,\n            loss_mode=a.policy_loss,",
        "loss_mode=a.policy_loss,",
        ONE_RANK,
    ),
    (
        "metrics averaged over micro-batches",
        "rl_megatron/trainer/step_metrics.py",
        "sums = values.sum(dim=1).to(device)",
        "sums = values.mean(dim=1).to(device)",
        ONE_RANK,
    ),
    (
        "norms weight-decayed",
        "rl_megatron/trainer/optimizer_step.py",
        'weight_decay * group.get("wd_mult", 1.0)',
        "weight_decay",
        ONE_RANK,
    ),
    (
        "temperature ignored in training",
        "rl_megatron/trainer/build.py",
        "temperature = config.rollout.temperature or 1.0",
        "temperature = 1.0",
        ONE_RANK,
    ),
    (
        "loss not scaled by the DP size",
        ROLES,
        "scale = self.layout.dp * len(micro)",
        "scale = len(micro)",
        TP_DP,
    ),
    (
        "advantages whitened per DP rank",
        TRAINER,
        "            group=self.dp_group,\n        )\n\n        # 4. Off-policy correction",
        "            group=None,\n        )\n\n        # 4. Off-policy correction",
        TP_DP,
    ),
    (
        "a non-finite loss on another rank ignored",
        "rl_megatron/trainer/optimizer_step.py",
        "dist.all_reduce(first_bad, op=dist.ReduceOp.MIN, group=group)",
        "pass",
        NONFINITE,
    ),
    (
        "non-finite steps taken anyway",
        "rl_megatron/trainer/optimizer_step.py",
        "    if bad_rank < dist.get_world_size():\n",
        "    if False:\n",
        NONFINITE,
    ),
    # Issue 20: rollout correction, GSPO / CISPO, DAPO, the critic's aggregation, the KL
    # estimators. The trainer's wiring is guarded by the reference step's cases 6-10, the
    # pure functions by their unit tests.
    (
        "rollout IS weights not passed to the policy loss",
        TRAINER,
        'rollout_is_weights=mb.get("rollout_is_weights"),',
        "rollout_is_weights=None,",
        ONE_RANK,
    ),
    (
        "actor.policy_loss ignored",
        TRAINER,
        "loss_mode=a.policy_loss,",
        'loss_mode="vanilla",',
        ONE_RANK,
    ),
    (
        "rollout log-ratio sign flipped (mu / pi_old)",
        EXPERIENCE,
        'log_ratio = batch["old_log_prob"] - batch["rollout_log_prob"]',
        'log_ratio = batch["rollout_log_prob"] - batch["old_log_prob"]',
        ONE_RANK,
    ),
    (
        "rollout log-ratio from the reference's log-probs",
        EXPERIENCE,
        'log_ratio = batch["old_log_prob"] - batch["rollout_log_prob"]',
        'log_ratio = batch["ref_log_prob"] - batch["rollout_log_prob"]',
        ONE_RANK,
    ),
    (
        "rejected tokens kept in the actor's loss",
        EXPERIENCE,
        'actor["response_mask"], m = rejection_mask(',
        "_, m = rejection_mask(",
        ONE_RANK,
    ),
    (
        "actor trained on the uncorrected batch",
        TRAINER,
        "                actor_batch,\n                self._actor_loss,",
        "                batch,\n                self._actor_loss,",
        ONE_RANK,
    ),
    ("critic.loss_agg_mode ignored", TRAINER, "c.loss_agg_mode,", '"token-mean",', ONE_RANK),
    (
        "overlong penalty added with the wrong sign",
        TRAINER,
        'scores, per_row["overlong_penalty"] = scores + penalty, penalty',
        'scores, per_row["overlong_penalty"] = scores - penalty, penalty',
        ONE_RANK,
    ),
    (
        "overlong penalty from the prompt's length",
        TRAINER,
        "rollout.response_lengths, limit, ob.length, ob.penalty_factor",
        "rollout.prompt_lengths, limit, ob.length, ob.penalty_factor",
        ONE_RANK,
    ),
    (
        "mismatch metrics' arguments swapped",
        TRAINER,
        'batch["rollout_log_prob"], batch["old_log_prob"], mask, group=self.dp_group',
        'batch["old_log_prob"], batch["rollout_log_prob"], mask, group=self.dp_group',
        ONE_RANK,
    ),
    (
        "full KL penalty from the wrong tensor",
        TRAINER,
        'full_kl=old.get("kl_full"),',
        'full_kl=old["entropy"],',
        ONE_RANK,
    ),
    (
        "full KL loss without its gradient",
        TRAINER,
        'full_kl=out.get("kl_full"),',
        'full_kl=out["kl_full"].detach() if "kl_full" in out else None,',
        ONE_RANK,
    ),
    (
        "dynamic sampling never filters",
        TRAINER,
        "                ds.enable,",
        "                False,",
        ONE_RANK,
    ),
    (
        "dynamic sampling keeps the uninformative groups",
        "rl_megatron/trainer/dynamic_sampling.py",
        "useful = [g for g, ok in enumerate(informative) if ok][: groups_per_rank - have]",
        "useful = [g for g, ok in enumerate(informative) if not ok][: groups_per_rank - have]",
        ONE_RANK,
    ),
    (
        "sequence IS ratio from the mean log-ratio, not the product",
        "rl_megatron/algorithms/rollout_correction.py",
        "return lr.sum(dim=-1, keepdim=True), valid.any(dim=-1, keepdim=True)",
        "return lr.mean(dim=-1, keepdim=True), valid.any(dim=-1, keepdim=True)",
        "tests/unit/test_rollout_correction.py",
    ),
    (
        "TIS weights not truncated",
        "rl_megatron/algorithms/rollout_correction.py",
        "w = torch.exp(log_rho.clamp(max=log_upper))",
        "w = torch.exp(log_rho)",
        "tests/unit/test_rollout_correction.py",
    ),
    (
        "IS batch normalisation skipped",
        "rl_megatron/algorithms/rollout_correction.py",
        "w = w / torch.where(mean > 0, mean, 1.0)",
        "w = w",
        ONE_RANK,
    ),
    (
        "GSPO's sequence ratio not stopped (gradient doubled)",
        "rl_megatron/algorithms/losses.py",
        "log_s = seq_log_ratio.detach() + lp - lp.detach()",
        "log_s = seq_log_ratio + lp - lp.detach()",
        ONE_RANK,
    ),
    (
        "CISPO's weight not clipped",
        "rl_megatron/algorithms/losses.py",
        "weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)",
        "weight = ratio",
        ONE_RANK,
    ),
    (
        "k3 not clamped",
        "rl_megatron/algorithms/kl.py",
        "return k3.clamp(-_K3_BOUND, _K3_BOUND)",
        "return k3",
        "tests/unit/test_kl.py",
    ),
    (
        "exact KL's gradient sign flipped in its KL term",
        "rl_megatron/models/vocab_parallel.py",
        "grad = log_p.sub_(log_q).sub_(kl.unsqueeze(-1)).mul_(p)",
        "grad = log_p.sub_(log_q).add_(kl.unsqueeze(-1)).mul_(p)",
        ONE_RANK,
    ),
    # Issue 22's wiring: log-probs from the hidden states, context parallelism.
    (
        "chunked log-probs ignore the sampling temperature",
        HEADS,
        "                temperature=self.temperature,\n                vocab_size=self.vocab_size,\n"
        "                chunk_tokens=self.chunk_tokens,",
        "                temperature=1.0,\n                vocab_size=self.vocab_size,\n"
        "                chunk_tokens=self.chunk_tokens,",
        ONE_RANK,
    ),
    (
        "CP output gather sums gradients over CP (each token counted cp times)",
        "rl_megatron/models/context_parallel.py",
        "    return _gather(x, group, dim, cu_seqlens, reduce_grad=False)",
        "    return _gather(x, group, dim, cu_seqlens, reduce_grad=True)",
        f"{REFERENCE}::test_four_ranks[cp2-dp2]",
    ),
    (
        "CP key/value gather keeps only the local gradient",
        "rl_megatron/models/context_parallel.py",
        "    return _gather(x, group, 0, cu_seqlens, reduce_grad=True)",
        "    return _gather(x, group, 0, cu_seqlens, reduce_grad=False)",
        f"{REFERENCE}::test_four_ranks[cp2-dp2]",
    ),
    # The Megatron engine's routing record (routing replay with rollout.engine megatron).
    (
        "engine routing: each row's tokens shifted by one",
        ENGINE,
        "by_row[k, p - len(prompts[k]) : p + n - 1] for k, n in enumerate(length_l)",
        "by_row[k, p - len(prompts[k]) + 1 : p + n] for k, n in enumerate(length_l)",
        RECORDING,
    ),
    (
        "engine routing: decode step t recorded as response token t + 1",
        ENGINE,
        "routing.append(recorder.take().unflatten(0, (p, b)))",
        "routing.append(torch.cat([(pre := recorder.take().unflatten(0, (p, b))), pre[-1:]]))",
        RECORDING,
    ),
    (
        "engine routing: layers in reverse order",
        "rl_megatron/models/router_replay.py",
        "torch.stack([latest[layer] for layer in self.layers], dim=1)",
        "torch.stack([latest[layer] for layer in reversed(self.layers)], dim=1)",
        RECORDING,
    ),
    # Issue 21: how deeply the engine sleeps, and the rollout batch's padding.
    (
        "engine sleep: rounds ignore rollout.sleep_level",
        "rl_megatron/rollout/engine.py",
        "if keep_weights else self.sleep_level)",
        "if keep_weights else 1)",
        "tests/multirank/test_engine_sleep.py::test_sleep_level[default]",
    ),
    (
        "engine sleep: dynamic sampling drops the weights between rounds",
        "rl_megatron/rollout/engine.py",
        "self.sleep(level=min(self.sleep_level, 1) if keep_weights",
        "self.sleep(level=2 if keep_weights",
        "tests/multirank/test_engine_sleep.py::test_sleep_level[dynamic_sampling]",
    ),
    (
        "engine sleep: level 0 moves the weights off the device like level 1",
        "rl_megatron/rollout/engine.py",
        "        if level >= 1:\n",
        "        if level >= 0:\n",
        "tests/unit/test_rollout_sampling.py::test_engine_sleep_level_0_keeps_the_weights",
    ),
    (
        "vLLM target: a parameter that vLLM replaced is written through the kept table",
        "rl_megatron/rollout/vllm/target.py",
        "        if self._owners is None or not self._owners.still_owned():",
        "        if self._owners is None:",
        "tests/unit/test_reshard_caches.py::"
        "test_vllm_target_keeps_its_parameter_table_until_vllm_replaces_a_parameter",
    ),
    (
        "resharding: the kept views' check ignores strides (a same-address view rebound)",
        "rl_megatron/resharding/tensor_facts.py",
        "        list(map(stride_of, ts)),",
        "        [],",
        "tests/unit/test_reshard_caches.py::"
        "test_a_non_contiguous_replacement_is_refused_not_written_through_old_views",
    ),
    (
        "resharding: a run bound block by block steps its source by the destination's step",
        "rl_megatron/resharding/copy_program.py",
        "d0, s0 = op.dst_start + i * op.dst_step, op.src_start + i * op.src_step",
        "d0, s0 = op.dst_start + i * op.dst_step, op.src_start + i * op.dst_step",
        "tests/unit/test_reshard_caches.py::test_runs_bound_block_by_block_write_the_same_elements",
    ),
    (
        "resharding: the last sync's facts reused without the C++ check (a reshaped source)",
        "rl_megatron/resharding/tensor_facts.py",
        "            and previous.unchanged.check(*values)\n",
        "\n",
        "tests/unit/test_reshard_caches.py::test_a_source_viewed_anew_at_its_address_is_refused",
    ),
    (
        "resharding: a source gone from the actor passes the one-list shape check",
        "rl_megatron/resharding/tensor_facts.py",
        "            same_set = len(shapes) == len(self.want) and None not in shapes",
        "            same_set = None not in shapes",
        "tests/unit/test_reshard_caches.py::test_a_source_gone_is_refused_on_a_repeated_sync",
    ),
    (
        "resharding: a stacked tensor's experts concatenated in the plan's order, not slot order",
        "rl_megatron/resharding/copy_program.py",
        "        chain.sort(key=_DST_START)\n",
        "\n",
        "tests/unit/test_reshard_plan.py::"
        "test_blocks_end_to_end_in_one_destination_become_one_concatenation",
    ),
    (
        "resharding: a stacked destination's dims counted from the stack, not within a slot",
        "rl_megatron/resharding/copy_program.py",
        "        self.dst = {s.name: s.shape[1:] if s.stack else s.shape for s in targets}",
        "        self.dst = {s.name: s.shape for s in targets}",
        "tests/unit/test_reshard_caches.py::"
        "test_moe_experts_fill_each_stacked_tensor_in_one_concatenation",
    ),
    (
        "resharding: kept steps bound afresh once are never captured again",
        "rl_megatron/resharding/copy_program.py",
        "            self.captured = False\n",
        "\n",
        "tests/unit/test_reshard_caches.py::"
        "test_kept_steps_are_captured_on_their_second_sync_and_replayed_until_they_move",
    ),
    (
        "vLLM engine: a level-0 sleep unmaps the weights too",
        "rl_megatron/rollout/vllm/engine.py",
        '    return [d for d in allocations if d.tag == "kv_cache"]',
        "    return allocations",
        "tests/unit/test_vllm_sleep_levels.py",
    ),
    (
        "vLLM engine: a deeper sleep after level 0 unmaps the KV cache twice",
        "rl_megatron/rollout/vllm/engine.py",
        "        if asleep:\n            self._wake(asleep)",
        "        if False:\n            self._wake(asleep)",
        "tests/unit/test_vllm_sleep_levels.py",
    ),
    (
        "vLLM engine: no prefix-cache reset after a generate",
        "rl_megatron/rollout/vllm/engine.py",
        "        self._prefix_cache_dirty = True\n        # Not `LLM.generate`",
        "        # Not `LLM.generate`",
        "tests/vllm/test_vllm_engine.py",
    ),
    (
        "memory: the phases' on-device peaks not told what the engine holds asleep",
        TRAINER,
        "self.phases = PhaseTimer(off_device_bytes=engine.unmapped_bytes if engine else None)",
        "self.phases = PhaseTimer()",
        "tests/multirank/test_engine_sleep.py::test_sleep_level[default]",
    ),
    (
        "memory: the phases' on-device peaks subtract the memory asleep at an interval's end",
        "rl_megatron/utils/timers.py",
        "else min(before, asleep)",
        "else asleep",
        "tests/unit/test_utils.py",
    ),
    (
        "memory: the phases' on-device peaks over the whole phase, not per interval",
        "rl_megatron/utils/timers.py",
        "            torch.cuda.reset_peak_memory_stats()\n        if opening",
        "            torch.cuda.reset_peak_memory_stats() if opening else None\n        if opening",
        "tests/unit/test_utils.py",
    ),
    (
        "memory: the engine's wake and the room made for it in one part",
        "rl_megatron/rollout/engine.py",
        '        with part(f"make_room_for_{tag}"):\n'
        "            self.make_room([tag])\n"
        '        with part(f"wake_{tag}"):\n',
        '        with part(f"wake_{tag}"):\n            self.make_room([tag])\n',
        "tests/multirank/test_engine_sleep.py",
    ),
    (
        "vLLM engine: unmapped bytes count the mapped allocations",
        "rl_megatron/rollout/vllm/engine.py",
        "return _allocated_bytes(asleep=True, unknown=False)",
        "return _allocated_bytes(asleep=False, unknown=False)",
        "tests/unit/test_vllm_sleep_levels.py",
    ),
    (
        "wake during update: the weights woken after the host read the steps' metrics",
        "rl_megatron/trainer/roles.py",
        "        if while_last_step_runs is not None:\n            while_last_step_runs()\n"
        "        return self._resolve(pending)",
        "        metrics = self._resolve(pending)\n        if while_last_step_runs is not None:\n"
        "            while_last_step_runs()\n        return metrics",
        "tests/multirank/test_engine_sleep.py::test_weights_wake_during_the_update",
    ),
    (
        "wake during update: woken without room",
        "rl_megatron/rollout/engine.py",
        "if todo and not self._has_room(todo):",
        "if False:",
        "tests/unit/test_vllm_sleep_levels.py",
    ),
    (
        "wake during update: the update's peaks taken after the wake",
        TRAINER,
        '        self.phases.close_peaks("update_actor")\n',
        "",
        "tests/multirank/test_engine_sleep.py::test_weights_wake_during_the_update",
    ),
    (
        "vLLM engine: a sleep wakes only the KV cache a level-0 sleep unmapped",
        "rl_megatron/rollout/vllm/engine.py",
        "asleep = self._asleep()",
        'asleep = ["kv_cache"] if self._kv_cache_unmapped else []',
        "tests/unit/test_vllm_sleep_levels.py",
    ),
    (
        "vLLM core loop: every sample of a prompt drawn with the prompt's seed",
        "rl_megatron/rollout/vllm/core_loop.py",
        "child.sampling_params.seed = params.seed + j",
        "child.sampling_params.seed = params.seed",
        "tests/vllm/test_vllm_engine.py::test_samples_are_those_of_vllms_own_generate",
    ),
    (
        "vLLM core loop: abort keeps the aborted requests live (aborted again next time)",
        "rl_megatron/rollout/vllm/core_loop.py",
        "unfinished, self._live = list(self._live), {}",
        "unfinished = list(self._live)",
        "tests/vllm/test_vllm_core_loop.py",
    ),
    (
        "vLLM core loop: a finished request stays live (aborted on an error)",
        "rl_megatron/rollout/vllm/core_loop.py",
        "done.append(self._live.pop(out.request_id))",
        "done.append(self._live[out.request_id])",
        "tests/vllm/test_vllm_core_loop.py::test_requests_added_one_by_one_finish_step_by_step_under_their_keys",
    ),
    (
        "vLLM core loop: a copied turn keeps the first turn's seed",
        "rl_megatron/rollout/vllm/core_loop.py",
        "request.sampling_params = replace_params(request.sampling_params, seed, max_tokens)",
        "request.sampling_params = replace_params(request.sampling_params, None, max_tokens)",
        "tests/vllm/test_vllm_core_loop.py",
    ),
    (
        "vLLM core loop: a copied turn keeps the last adapter version's request",
        "rl_megatron/rollout/vllm/core_loop.py",
        "if cached is None or cached[0] is not like or cached[1] is not self.lora_request:",
        "if cached is None or cached[0] is not like:",
        "tests/vllm/test_vllm_core_loop.py",
    ),
    (
        "multi-turn: a rollout ends before its workers' closes are acknowledged",
        "rl_megatron/rollout/multi_turn.py",
        "pool.wait_for_closes()  # so the next call's starts reuse these workers",
        "pool.ready(0.0)",
        "tests/unit/test_multi_turn.py::test_the_next_call_reuses_the_workers_the_last_one_closed",
    ),
    (
        "multi-turn waves: a turn's seed swaps its trajectory and turn",
        "rl_megatron/rollout/turn_waves.py",
        "seeds = [turn_seed(self.sampling.seed, t, k, self.max_turns) for t, k in ids]",
        "seeds = [turn_seed(self.sampling.seed, k, t, self.max_turns) for t, k in ids]",
        "tests/unit/test_turn_waves.py",
    ),
    (
        "Megatron engine: per-prompt seeds ignored for the call's seed",
        ENGINE,
        "seeds = [sampling.prompt_seed(i) + j for i, j in chunk]",
        "seeds = [(sampling.seed or 0) + i * sampling.n + j for i, j in chunk]",
        "tests/multirank/test_megatron_engine.py",
    ),
    (
        "Megatron engine: a row capped by prompt_max_new_tokens stops one token late",
        ENGINE,
        "done |= length >= row_caps",
        "done |= length > row_caps",
        "tests/multirank/test_megatron_engine.py",
    ),
    (
        "vLLM engine: prompt_max_new_tokens ignored (every request gets max_new_tokens)",
        "rl_megatron/rollout/vllm/engine.py",
        "max_tokens=sampling.prompt_max_new(i),",
        "max_tokens=sampling.max_new_tokens,",
        "tests/vllm/test_vllm_engine.py::test_prompt_caps_cut_the_seeded_samples",
    ),
    (
        "sampling: a prompt's cap is not bounded by max_new_tokens",
        "rl_megatron/rollout/sampling.py",
        "return min(self.max_new_tokens, self.prompt_max_new_tokens[i])",
        "return self.prompt_max_new_tokens[i]",
        "tests/unit/test_rollout_sampling.py",
    ),
    (
        "partial rollouts: staleness judged by a sample's newest token, not its oldest",
        "rl_megatron/trainer/partial_rollouts.py",
        "stale = [s for s in group.samples if s.versions and s.versions[0] < oldest]",
        "stale = [s for s in group.samples if s.versions and s.versions[-1] < oldest]",
        "tests/unit/test_partial_rollouts.py",
    ),
    (
        "partial rollouts: a continuation overwrites the log-probs sampled before",
        "rl_megatron/trainer/partial_rollouts.py",
        "sample.log_probs += batch.rollout_log_probs[row, : len(tokens)].tolist()",
        "sample.log_probs = batch.rollout_log_probs[row, : len(tokens)].tolist()",
        "tests/unit/test_partial_rollouts.py",
    ),
    (
        "partial rollouts: a continuation forgets the tokens sampled so far",
        "rl_megatron/trainer/partial_rollouts.py",
        "prompts = [g.prompt + s.tokens for g, s in requests]",
        "prompts = [g.prompt for g, s in requests]",
        "tests/vllm/test_trainer_vllm.py::test_partial_rollouts_continue_exactly_on_vllm",
    ),
    (
        "colocated_async: a drawn batch seeded as the next draw",
        TRAINER,
        "return indices, prompts, self._sampling(d).seed",
        "return indices, prompts, self._sampling(d + 1).seed",
        "tests/e2e/test_async_training.py::"
        "test_staleness_zero_without_partial_rollouts_is_the_synchronous_loop",
    ),
    (
        "vLLM core loop: a step's tokens replace the earlier ones",
        "rl_megatron/rollout/vllm/core_loop.py",
        "sample.token_ids.extend(out.new_token_ids)",
        "sample.token_ids[:] = out.new_token_ids",
        "tests/vllm/test_vllm_core_loop.py",
    ),
    (
        "rollout batch: prompts right-aligned",
        "rl_megatron/rollout/batch.py",
        "    if left:",
        "    if not left:",
        "tests/unit/test_rollout_batch.py",
    ),
    # Issue 36: the edges (non-finite values other than NaN, the dual clip engaged, routing
    # replay's gate weights and sequence parallelism, dynamic sampling across replicas,
    # the restricted unpickler).
    (
        "an infinite loss taken for finite (only NaN checked)",
        "rl_megatron/trainer/optimizer_step.py",
        "torch.isfinite(local_loss).all(), float",
        "(~torch.isnan(local_loss)).all(), float",
        NONFINITE,
    ),
    (
        "an infinite gradient norm taken for finite (only NaN checked)",
        "rl_megatron/trainer/optimizer_step.py",
        "    if not math.isfinite(grad_norm):",
        "    if math.isnan(grad_norm):",
        NONFINITE,
    ),
    ("dual clip's bound not passed to the loss", TRAINER, "a.clip_ratio_c,", "None,", ONE_RANK),
    (
        "dual clip's bound a floor, not a ceiling",
        "rl_megatron/algorithms/losses.py",
        "loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, loss_dual), loss_mat)",
        "loss_mat = torch.where(adv < 0, torch.maximum(loss_mat, loss_dual), loss_mat)",
        ONE_RANK,
    ),
    (
        "dual clip's bound not applied",
        "rl_megatron/algorithms/losses.py",
        "loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, loss_dual), loss_mat)",
        "loss_mat = loss_mat",
        ONE_RANK,
    ),
    (
        "routing replay: gate weights at the router's own top-k, not the replayed experts",
        "rl_megatron/models/router_replay.py",
        "return scores.gather(1, chosen), chosen",
        "return scores.gather(1, own), chosen",
        "tests/multirank/test_router_replay.py::test_replay_makes_top_k_sets_agree",
    ),
    (
        "routing replay: every SP rank replays the first rank's columns",
        "rl_megatron/models/router_replay.py",
        "seq_first = seq_first[sp_rank * width : (sp_rank + 1) * width]",
        "seq_first = seq_first[:width]",
        "tests/multirank/test_router_replay.py::test_role_replays_the_rollout_routing",
    ),
    (
        "routing replay: SP columns taken strided, not consecutive",
        "rl_megatron/models/router_replay.py",
        "seq_first = seq_first[sp_rank * width : (sp_rank + 1) * width]",
        "seq_first = seq_first[sp_rank::sp_size]",
        "tests/multirank/test_router_replay.py::test_role_replays_the_rollout_routing",
    ),
    (
        "dynamic sampling: rounds stop once any replica is full",
        "rl_megatron/trainer/dynamic_sampling.py",
        "short = _all_reduce(short, dp_group, dist.ReduceOp.MAX)",
        "short = _all_reduce(short, dp_group, dist.ReduceOp.MIN)",
        DP_ALGORITHMS,
    ),
    (
        "dynamic sampling: each replica decides its rounds alone",
        "rl_megatron/trainer/dynamic_sampling.py",
        "short = _all_reduce(short, dp_group, dist.ReduceOp.MAX)",
        "short = short",
        DP_ALGORITHMS,
    ),
    (
        "dynamic sampling: a full replica keeps the informative groups of later rounds",
        "rl_megatron/trainer/dynamic_sampling.py",
        "useful = [g for g, ok in enumerate(informative) if ok][: groups_per_rank - have]",
        "useful = [g for g, ok in enumerate(informative) if ok][:groups_per_rank]",
        DP_ALGORITHMS,
    ),
    (
        "dynamic sampling: counts of this replica only",
        "rl_megatron/trainer/dynamic_sampling.py",
        "counts = _all_reduce(counts, dp_group, dist.ReduceOp.SUM)",
        "counts = counts",
        DP_ALGORITHMS,
    ),
    (
        "restricted unpickler: all of torch admitted, not only its dtypes",
        "rl_megatron/checkpoint/safe_metadata.py",
        'return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)',
        'return module == "torch"',
        UNPICKLER,
    ),
    (
        "restricted unpickler: torch's loaders admitted",
        "rl_megatron/checkpoint/safe_metadata.py",
        '    ("torch.serialization", "_get_layout"),',
        '    ("torch.serialization", "_get_layout"),\n    ("torch.serialization", "load"),',
        UNPICKLER,
    ),
    (
        "restricted unpickler: an explicit weights_only=False honoured",
        "rl_megatron/checkpoint/safe_metadata.py",
        'kwargs["weights_only"] = True',
        'kwargs.setdefault("weights_only", True)',
        UNPICKLER,
    ),
    (
        "sync verification: an FP8 weight compared as sent, not quantized",
        "rl_megatron/resharding/verify.py",
        "for stored_name, expected in (form.encode(sent) if form else {name: sent}).items():",
        "for stored_name, expected in {name: sent}.items():",
        "tests/unit/test_sync_verify.py",
    ),
    (
        "environment pool: 0 read as a cap of none, not as no cap",
        "rl_megatron/environments/workers.py",
        "if 0 < self.max_concurrent <= len(self._workers):",
        "if 0 <= self.max_concurrent <= len(self._workers):",
        "tests/unit/test_environment_workers.py",
    ),
    (
        "environment pool: queued starts not counted",
        "rl_megatron/environments/workers.py",
        "self.waited += any(t == traj_id for t, _ in self._queue)",
        "self.waited += 0",
        "tests/unit/test_environment_workers.py",
    ),
    (
        "sync verification: the bitwise compare lets a last-place difference pass",
        "rl_megatron/resharding/verify.py",
        "    differ = (a != b).nonzero()",
        "    differ = ((a >> 1) != (b >> 1)).nonzero()",
        "tests/unit/test_sync_verify.py::"
        "test_full_verification_catches_one_changed_element_in_any_parameter",
    ),
    (
        "sync verification: sample checks the same tensor of each kind every time",
        "rl_megatron/resharding/verify.py",
        "            name = group[j % len(group)]",
        "            name = group[0]",
        "tests/unit/test_sync_verify.py::"
        "test_sample_covers_every_kind_each_time_and_every_parameter_in_turn",
    ),
    (
        "sync verification: a window's source rows shifted the wrong way",
        "rl_megatron/resharding/verify.py",
        '            fields["src_offset"] = m.src_offset + (lo - m.dst_offset)',
        '            fields["src_offset"] = m.src_offset - (lo - m.dst_offset)',
        "tests/unit/test_sync_verify.py::"
        "test_a_windowed_restricted_plan_writes_exactly_those_rows_of_the_sync",
    ),
    (
        "sync verification: a window's mismatch named at its index in the window",
        "rl_megatron/resharding/verify.py",
        "        index = tuple(i + start if d == dim else i for d, i in enumerate(index))",
        "        index = tuple(index)",
        "tests/unit/test_sync_verify.py::"
        "test_sample_bounds_a_checks_bytes_by_the_window_and_names_the_whole_tensors_index",
    ),
    (
        "sync verification: scratch chunks sized by whole tensors, not their windows",
        "rl_megatron/resharding/verify.py",
        "                    rows = windows[sp.name][1] if sp.name in windows else sp.rows",
        "                    rows = sp.rows",
        "tests/unit/test_sync_verify.py::test_a_sample_check_is_one_chunk_sized_by_its_windows",
    ),
    (
        "sync verification: sample leaves out a kind (the norms)",
        "rl_megatron/resharding/verify.py",
        '    ("norm", ("norm",)),',
        "",
        "tests/unit/test_sync_verify.py::"
        "test_sample_covers_every_kind_each_time_and_every_parameter_in_turn",
    ),
    (
        "repacked layouts: a quant method's replaced post-processing is trusted",
        "rl_megatron/rollout/vllm/repacked.py",
        '    if "process_weights_after_loading" in vars(method):',
        "    if False:",
        "tests/unit/test_vllm_repacked.py::"
        "test_the_in_place_target_refuses_direct_and_falls_back_to_the_reload_with_auto",
    ),
    (
        "repacked layouts: vLLM's record of the checkpoint format is not compared",
        "rl_megatron/rollout/vllm/repacked.py",
        "            if was is not None and (",
        "            if False and (",
        "tests/unit/test_vllm_repacked.py::test_a_quantized_method_and_a_changed_dtype_are_found",
    ),
    (
        "LoRA checkpoint: the base saved into every step folder again",
        "rl_megatron/checkpoint/training_state.py",
        '                    part = "adapters"\n',
        '                    part = "all"\n',
        "tests/multirank/test_lora_checkpoints.py",
    ),
    (
        "LoRA checkpoint: resume skips the base copy",
        "rl_megatron/checkpoint/training_state.py",
        '                    self._load_role(copies[name], roles[name], saved, part="base")',
        "                    pass",
        "tests/multirank/test_lora_checkpoints.py",
    ),
    (
        "megatron_to_hf: an adapters-only step folder's weights not read from its base copy",
        "checkpoints_tools/megatron_to_hf.py",
        "                tensors = _load(base.dir, batch) + _load(args.ckpt, extra)",
        "                tensors = _load(args.ckpt, batch + extra)",
        "tests/multirank/test_peft_export.py::test_trainer_writes_the_adapter_beside_the_merged_model",
    ),
    (
        "LoRA checkpoint: the HF base's fingerprint is not compared",
        "rl_megatron/checkpoint/lora_base.py",
        '            if record["files"].get(name) != now.get(name):',
        "            if False:",
        "tests/multirank/test_lora_checkpoints.py",
    ),
    (
        "LoRA weight sync: the base weights sent, adapters not merged",
        "rl_megatron/resharding/lora_merge.py",
        "        if not adapters:\n",
        "        if True:\n",
        LORA_SYNC_TEST,
    ),
    (
        "LoRA weight sync: a merged sync keeps its copy views (the merges held between syncs)",
        "rl_megatron/resharding/weight_sync.py",
        "        views = self._views if sources is table else None",
        "        views = self._views",
        LORA_SYNC_TEST,
    ),
    (
        "LoRA weight sync: the verifier compares the engine with the unmerged weights",
        "rl_megatron/resharding/weight_sync.py",
        "self.verifier.verify(plan, rank, sources, group=self.group)",
        "self.verifier.verify(plan, rank, table, group=self.group)",
        "tests/vllm/test_vllm_lora_sync.py",
    ),
    (
        "PEFT export: k and v rows of the fused qkv adapter's B swapped",
        PEFT,
        "        pairs = [(name, a_shards[0], b) for name, b in parts]",
        "        pairs = [(n, a_shards[0], b) for (n, _), (_, b) in "
        "zip(parts, [parts[0], parts[2], parts[1]] if len(parts) == 3 else parts)]",
        PEFT_TEST + "::test_peft_export",
    ),
    (
        "PEFT export: an expert's gate and up rows swapped",
        PEFT,
        "        pairs = [(name, a_shards[0], b) for name, b in parts]",
        "        pairs = [(n, a_shards[0], b) for (n, _), (_, b) in "
        "zip(parts, parts[::-1] if rule.expert is not None else parts)]",
        PEFT_TEST + "::test_peft_export_of_experts",
    ),
    (
        "PEFT export: TP shards of B gathered in reverse order",
        PEFT,
        "b_shards = _gather_tp(b, e.rule, group) if",
        "b_shards = _gather_tp(b, e.rule, group)[::-1] if",
        PEFT_TEST + "::test_peft_export",
    ),
    (
        "PEFT export: lora_alpha written as r",
        PEFT,
        '        "lora_alpha": alpha,',
        '        "lora_alpha": rank,',
        PEFT_TEST + "::test_peft_export",
    ),
    (
        "megatron_to_hf.py: a LoRA checkpoint's adapters not merged",
        "checkpoints_tools/megatron_to_hf.py",
        "tensors[j] = merged_weight(tensors[j], lora)",
        "tensors[j] = tensors[j]",
        PEFT_TEST + "::test_trainer_writes_the_adapter_beside_the_merged_model",
    ),
    (
        "split: the generation ranks ignore the checkpoint's data position",
        SPLIT,
        'self.samplers[i].load_state_dict(first[i]["sampler"])',
        "pass",
        f"{SPLIT_TEST}::test_kills_during_a_save_and_an_update_lose_and_repeat_no_record",
    ),
    (
        "split: the generation ranks seed a batch as the next step's",
        SPLIT,
        "sampling = step_sampling(self.config, eos, step, i, d, len(records))",
        "sampling = step_sampling(self.config, eos, step + 1, i, d, len(records))",
        f"{SPLIT_TEST}::test_staleness_zero_is_the_synchronous_loop_on_the_training_ranks",
    ),
    (
        "split: the trainer stops without telling the generation ranks",
        TRAINER,
        "self.split.stop()  # the generation ranks end too",
        "pass",
        f"{SPLIT_TEST}::test_sigterm_stops_both_sides_and_the_run_resumes",
    ),
    (
        "split: every generation rank of a TP replica planned as its first",
        "rl_megatron/resharding/plan.py",
        "        key.target(key.info, t_g, r, key.generation_padded_vocab) for r in range(t_g)",
        "        key.target(key.info, t_g, 0, key.generation_padded_vocab) for r in range(t_g)",
        "tests/unit/test_split_schedule.py::"
        "test_the_remote_plan_sends_every_generation_row_once_from_a_training_rank",
    ),
    (
        "split: the weights sent to the generation ranks of no replica",
        "rl_megatron/trainer/split_rollouts.py",
        "            world.generation_rank(r) for r in generation",
        "            world.training_rank(r) for r in generation",
        "tests/unit/test_split_schedule.py::test_weight_peers_are_launch_ranks_of_both_sides",
    ),
    (
        "split: every generation rank of a TP replica receives as its first",
        "rl_megatron/resharding/remote.py",
        "        self.local = len(self.peers) - key.rollout_tp + gen_tp",
        "        self.local = len(self.peers) - key.rollout_tp + 0",
        "tests/multirank/test_split_weights.py",
    ),
]


def run(name: str, path: str, old: str, new: str, test: str, workdir: Path) -> bool:
    copy = workdir / "repo"
    shutil.rmtree(copy, ignore_errors=True)
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "build", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, copy, ignore=ignore)
    text = (copy / path).read_text()
    if text.count(old) != 1:
        print(f"STALE  {name}: the line to break is not in {path} exactly once", flush=True)
        return False
    (copy / path).write_text(text.replace(old, new))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
        cwd=copy,
        env={**os.environ, "PYTHONPATH": str(copy)},
        capture_output=True,
        text=True,
    )
    caught = result.returncode != 0
    print(f"{'CAUGHT' if caught else 'MISSED'} {name}  ({test})", flush=True)
    return caught


def main(words: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not words or any(w in m[0] for w in words)]
    with tempfile.TemporaryDirectory() as workdir:
        results = [run(*m, Path(workdir)) for m in chosen]
    print(f"{sum(results)} of {len(results)} mutations caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
