"""The typed configuration of a run: one dataclass per YAML section.

Every field has a default that works at small scale and a comment with its meaning and
unit. `load_config(path, overrides)` reads YAML + dotted overrides (see `config_io.py`);
`config_checks.validate(config, world_size)` holds every cross-field check, in one place,
and names the dotted key in each error.

Batch vocabulary (global counts, all ranks together):
    data.train_batch_size   prompts per training step
    rollout.n               responses per prompt → train_batch_size·n sequences per step
    actor.mini_batch_size   sequences per optimizer step (PPO mini-batch)
    actor.micro_batch_size  sequences per forward/backward on one DP rank
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl_megatron.config_io import ConfigError, from_dict, load_yaml, to_dict

__all__ = ["Config", "ConfigError", "load_config", "to_dict"]

Dtype = Literal["bf16", "fp16", "fp32"]
# The config's short dtype names → torch's (what vLLM and the checkpoint sidecars take).
DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
# k1/k2/k3/abs from the sampled tokens' log-probs; full: exact, from both full distributions
# (an extra reference forward per micro-batch; parallel.pp = 1).
KLEstimator = Literal["k1", "k2", "k3", "abs", "full"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]


@dataclass
class ModelConfig:
    # Hugging Face checkpoint directory (config.json + safetensors). When set, the
    # architecture fields below are read from its config.json and must not be given here;
    # the model is built with its rope_theta, rms_norm_eps and tie_word_embeddings too,
    # which the launcher writes into this config before printing and saving it
    # (`models.hf_config.resolve_model_config`).
    hf_path: str | None = None
    # Architecture for randomly initialised models (tests, the CPU demo, benchmarks).
    num_layers: int | None = None  # transformer layers
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None  # KV heads (GQA); None = num_attention_heads
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None  # true vocabulary size, before padding
    max_position_embeddings: int = 4096  # longest prompt + response, in tokens
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    # Pad the vocabulary to a multiple of this × tp (Megatron's convention).
    make_vocab_size_divisible_by: int = 128
    dtype: Dtype = "bf16"  # parameter / compute dtype; optimizer state stays fp32
    tokenizer_path: str | None = None  # HF tokenizer; None = hf_path
    # Pack each micro-batch's sequences into one (THD layout: no FLOP on padding) in the
    # training and scoring passes. Off by default: without Transformer Engine the packed
    # attention runs one SDPA call per sequence, and on one H200 (0.85B, responses of
    # equal length) the actor update ran at 21k tok/s packed vs 49k padded. Turn it on
    # for very uneven lengths or with TE (benchmarks/RESULTS.md).
    pack_sequences: bool = False
    # Log-probs and entropy of the LM-head roles (actor, reference) from the final hidden
    # states, this many tokens at a time and only where a response token is predicted
    # (models/chunked_logprobs.py), so that no [tokens, vocab] logits exist at once: on one
    # H200 (vocab 152k, 32k tokens) 46.4 -> 5.6 GiB for that step, ~6 % slower. 0: the
    # output layer's full logits (the exact KL, kl_penalty / kl_loss_type full, uses them).
    logprob_chunk_tokens: int = 4096
    # Mixture of experts (megatron-core's MoELayer, every layer). With model.hf_path these
    # are read from its config.json (Qwen3-MoE, Mixtral); for a random init, num_experts > 0
    # builds a Qwen3-MoE shape.
    num_experts: int = 0  # routed experts per layer; 0 = a dense model
    moe_ffn_hidden_size: int | None = None  # one expert's FFN width; None = ffn_hidden_size
    moe_router_topk: int = 2  # experts each token is routed to
    # Router losses added to the actor's loss in training (megatron-core's): the switch
    # load-balancing loss and the router z-loss, each times its coefficient; 0 = off (HF's
    # forward has neither, so log-probs and gradients then match the HF model's exactly).
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    vpp: int | None = None  # virtual pipeline chunks per stage (interleaved 1F1B); None = off
    cp: int = 1  # context-parallel size
    ep: int = 1  # expert-parallel size: the experts of each MoE layer split over ep ranks
    etp: int = 1  # expert-tensor-parallel size: each expert's weights split over etp ranks
    sequence_parallel: bool = False  # shard LayerNorm/dropout activations over tp
    # Seconds before a stuck collective fails the run instead of hanging it.
    timeout_s: int = 1800
    # Seconds the ranks of a launch without torchrun (srun, one shell per rank) wait for each
    # other at MASTER_ADDR:MASTER_PORT before failing with one line (torchrun: its
    # --rdzv_conf join_timeout, RDZV_TIMEOUT_S in launch/slurm/ppo.sbatch).
    rendezvous_timeout_s: int = 600


@dataclass
class MultiTurnConfig:
    # Turns of the policy per trajectory at most (with environment.function set); the
    # trajectory ends with finish reason "max_turns" after the last one's observation.
    max_turns: int = 4
    # Tokens one turn may sample; null: rollout.max_response_length. A turn cut here ends
    # its trajectory ("turn_length"). Every trajectory, prompt, turns and observations
    # together, stays within rollout.max_prompt_length + rollout.max_response_length.
    max_turn_tokens: int | None = None


@dataclass
class PartialRolloutConfig:
    # trainer.mode: colocated_async. Off: every sample runs to its end in the phase that
    # started it, one batch of records in flight (with rollout.max_staleness 0: exactly
    # the synchronous loop's batches).
    enable: bool = True
    # Tokens a sample may generate per engine call; between calls the step checks whether
    # it has its groups (all n samples of a record finished) and stops generating when it
    # has. null: rollout.max_response_length / (rollout.max_staleness + 1), rounded up:
    # every phase runs at least one chunk of every unfinished sample, so a sample of the
    # longest length then finishes within the staleness bound; with smaller chunks the
    # longest samples are restarted again and again and never trained (a warning says so).
    # Each call re-reads the sample's tokens so far as its prompt (prefix-cache hits on
    # vLLM, under the same weights).
    chunk_tokens: int | None = None
    # Batches of records (data.train_batch_size each) in flight: the step trains on the
    # first batch's worth of groups that finish; the others go on in the next phase.
    in_flight_batches: int = 2


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "megatron"] = "vllm"
    tp: int = 1  # generation tensor-parallel size t_g; must divide parallel.tp·parallel.pp
    n: int = 1  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_prompt_length: int = 512  # tokens
    max_response_length: int = 512  # tokens
    # A prompt longer than max_prompt_length: keep its last tokens, leave it out of the
    # dataset, or refuse the dataset naming the sample. Every case is counted and reported.
    prompt_overflow: Literal["truncate_left", "filter", "reject"] = "truncate_left"
    # Fraction of memory vLLM may hold per rank: GPU, of the device (weights + KV cache);
    # CPU build, of the RAM, trainer included (KV = share - process; VLLM_CPU_KVCACHE_SPACE).
    gpu_memory_utilization: float = 0.5
    enable_sleep_mode: bool = True  # free vLLM's KV cache and weights while training runs
    # What a sleeping engine keeps of its weights while the roles train. 2: nothing (every
    # sync rewrites all of them, so keeping them is wasted work: level 1 copies them to
    # host memory at every sleep and back at every wake, 2x the weights over PCIe per
    # step). 1: a host copy. 0: all of them, on the device: the roles train next to one
    # more copy of the weights (generation's layout), and the sync writes them without
    # mapping their memory back first (~4-9 ms/GB on an H200). Between the rounds of
    # dynamic sampling the engine sleeps at 1 (at 0 when 0 is set): the next round
    # generates with the same weights, without a sync. The KV cache is freed at all three.
    sleep_level: Literal[0, 1, 2] = 2
    # Map the engine's weights back while the device runs the actor's last optimizer step
    # of the step (levels 1 and 2), so that the next sync has nothing to wake; only when
    # they fit beside what the roles hold then, else the sync wakes them as before. The
    # weights then hold their memory from the update's end on (checkpoint saves included).
    wake_weights_during_update: bool = True
    enforce_eager: bool = False  # no CUDA graphs in generation (vLLM's, Megatron engine's)
    # Ask vLLM for each sampled token's log-prob (verl's key). null: exactly when
    # algorithm.rollout_correction needs them (the behaviour policy's log-probs); with them
    # the step also logs the mismatch metrics (rollout/logprob_diff_*, ...). vLLM builds
    # them in Python on every decode step: 0.77-0.81x the tokens/s of the same engine
    # without them on an H200 (benchmarks/runs/2026-11-30-h200x2-run05-update-host-waits.md). The Megatron engine has
    # them from its logits and always reports them.
    calculate_log_probs: bool | None = None
    weight_sync_bucket_mb: int = 512  # transfer bucket for 3D resharding, MiB
    # After a sync, read the engine's parameters back and compare them bitwise with what was
    # sent (DESIGN.md §3): off, sample (one tensor of each kind, rotating) or full.
    verify_sync: Literal["off", "sample", "full"] = "off"
    verify_sync_interval: int = 1  # verify every N-th sync (when verify_sync is not off)
    # A LoRA actor (actor.lora.rank > 0) on vLLM: merged = every sync sends the adapted
    # weights W + (alpha/r)·B·A (resharding/lora_merge.py); adapter = the engine keeps the
    # base and runs the adapter with vLLM's LoRA support, a sync sends A and B only
    # (rollout/vllm/lora_sync.py; dense models, sleep_level <= 1).
    lora_sync: Literal["merged", "adapter"] = "merged"
    # After each training step's sync, sample this many fixed prompts (the first held-out
    # ones) with a fixed seed and log the engine-vs-trainer log-prob mismatch on them
    # (sync_probe/*: mean, p99, max of |d|, mean exp|d|; rollout/sync_probe.py). 0: off.
    sync_probe_prompts: int = 0
    # New tokens per probe prompt (<= max_response_length); null: 32 or max_response_length.
    sync_probe_tokens: int | None = None
    # Generate with FP8 weights (vLLM; GPUs of compute capability >= 8.9): fp8 = one
    # float8_e4m3fn weight and a float32 scale per 128x128 block for every linear layer,
    # quantized from the trainer's weights inside each sync (resharding/fp8.py). With it,
    # algorithm.rollout_correction.level defaults to token (TIS, DESIGN.md §7). null: off.
    quantization: Literal["fp8"] | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # vLLM's KV cache; fp8: half the bytes
    # Further vllm.LLM arguments, passed as given (e.g. disable_custom_all_reduce: true,
    # compilation_config: {...}); the ones the trainer sets itself are refused here.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    val_temperature: float = 0.0  # 0 = greedy evaluation
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # Asynchronous modes (trainer.mode): no token trained on at step s was sampled by a
    # policy older than s - max_staleness. A sample that would be is restarted (its tokens
    # dropped, its record kept) or its record's group dropped for the epoch (on_stale).
    max_staleness: int = 1
    on_stale: Literal["restart", "drop"] = "restart"
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001  # initial β
    target_kl: float = 0.1  # adaptive only: per-token KL target
    horizon: int = 10000  # adaptive only: steps (in sequences) to reach the target


@dataclass
class RolloutCorrectionConfig:
    # Off-policy correction for the engine's mismatch (DESIGN.md §7, "Rollout correction"),
    # from r = pi_old / mu per token (mu: the engine's log-probs). `token`: each token's
    # ratio; `sequence`: the product over the response. null: off.
    level: Literal["token", "sequence"] | None = None
    # Importance weight on the policy loss: a number C (TIS: min(r, C)), or [lower, upper]
    # (IcePop: r inside the band, 0 outside); null: no weights (rejection only).
    threshold: float | list[float] | None = 2.0
    batch_normalize: bool = False  # divide the weights by their batch mean (mean 1)
    # Masked IS / rejection (MIS): [lower, upper]; tokens (or sequences) whose r leaves the
    # band leave the actor's loss and its normaliser. null: none.
    rejection: list[float] | None = None


@dataclass
class DynamicSamplingConfig:
    # DAPO's dynamic sampling: drop groups whose n rewards are all equal and generate more
    # prompts (data.train_batch_size per round) until the step has train_batch_size groups
    # that differ. Needs rollout.n >= 2.
    enable: bool = False
    # Extra rounds of generation a step may take; when they run out, the step trains with
    # the informative groups it found, filled up with uninformative ones (counted, warned).
    max_extra_rounds: int = 8


@dataclass
class AlgorithmConfig:
    adv_estimator: AdvEstimator = "gae"
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE λ
    norm_adv_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract β·KL(actor‖ref) from token rewards
    kl_penalty: KLEstimator = "k1"  # estimator for the reward penalty
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0  # floor of the cosine/linear decay
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    lr_decay_steps: int | None = None  # None = the run's total optimizer steps
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global grad-norm clip; 0 = off
    # Share of this rank's optimizer state (fp32 master weights + Adam moments, 12 bytes per
    # parameter: 96 GB of an 8B model at dp=1) kept in host memory for good, its Adam step
    # run on the CPU (megatron-core's HybridDeviceOptimizer, `optimizer_offload_fraction`):
    # 0 = off, 1 = all of it (the device keeps only the bf16 weights and fp32 gradients).
    # Each step copies the gradients to the host (into a pinned copy: 16 bytes of host memory
    # per offloaded parameter in all) and the updated weights back. Needs model.dtype=bf16.
    # Unlike `offload.optimizer`, the share never returns to the device.
    cpu_offload_fraction: float = 0.0
    # With it: overlap the gradient / weight copies with the CPU step, one parameter at a time
    # (megatron-core's overlap_cpu_optimizer_d2h_h2d, which Megatron-LM recommends).
    cpu_offload_overlap: bool = True


@dataclass
class OffloadConfig:
    params: bool = False  # move weights to pinned CPU memory between phases
    grads: bool = False  # move gradient buffers
    # move optimizer state (with optim.cpu_offload_fraction > 0: only its device share)
    optimizer: bool = False


@dataclass
class RecomputeConfig:
    # Activation recompute in this role's training passes (megatron-core's): the chosen
    # activations are not kept for the backward but computed again from their inputs.
    # none: keep everything (fastest). selective: `modules` of every layer — core_attn
    # (the attention scores of an unfused kernel; our SDPA attention keeps almost nothing
    # there: 0.3 % of the demo model's saved bytes), mlp (the MLP's FFN-wide activations:
    # 45 %), layernorm (the norms' outputs; needs Transformer Engine), moe /
    # shared_experts (MoE layers). full: whole layers keep only their input (10 %):
    # method uniform recomputes every layer in units of num_layers, block the first
    # num_layers layers of each pipeline stage. The shares are measured by
    # tests/multirank/test_recompute.py; GPU memory and speed in benchmarks/RESULTS.md.
    granularity: Literal["none", "selective", "full"] = "none"
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = 1

    def transformer_config(self) -> dict[str, Any]:
        """The megatron-core `TransformerConfig` fields for this setting."""
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        return {
            "recompute_granularity": "full",
            "recompute_method": self.method,
            "recompute_num_layers": self.num_layers,
        }


@dataclass
class LoraConfig:
    # LoRA adapters on the actor (models/lora.py): y = base(x) + (alpha/rank)·B(A(dropout(x))),
    # only A and B trained, the base frozen; the reference is then the actor with its
    # adapters disabled (no second model).
    rank: int = 0  # r, the adapters' inner width; 0 = off (full fine-tuning)
    alpha: float = 16.0  # the adapter output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input only, in [0, 1)
    # megatron-core module names: linear_qkv (HF q/k/v_proj), linear_proj (o_proj),
    # linear_fc1 (gate/up_proj), linear_fc2 (down_proj); in an MoE layer linear_fc1 / fc2
    # are also each expert's (experts.{e}.gate/up_proj, down_proj); output_layer (lm_head,
    # untied only) lets a randomly initialised model's frozen head be adapted too.
    target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    mini_batch_size: int = 8  # sequences per optimizer step (global)
    micro_batch_size: int = 1  # sequences per forward/backward per DP rank
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2  # ε_low of the PPO clip
    clip_ratio_high: float = 0.2  # ε_high (clip-higher, DAPO)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (vanilla); > 1
    # vanilla: PPO's clip; gspo: the sequence ratio (arXiv 2507.18071; use
    # loss_agg_mode seq-mean-token-mean and a small clip, e.g. 3e-4/4e-4); cispo: clipped,
    # stop-gradient IS weight times log-prob (arXiv 2506.13585).
    policy_loss: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False  # KL(actor‖ref) as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: KLEstimator = "k3"
    loss_agg_mode: LossAggMode = "token-mean"
    use_dynamic_batch: bool = False  # token-budget micro-batches instead of fixed size
    max_tokens_per_micro_batch: int = 16384  # with use_dynamic_batch
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    # Routing replay (R3) for MoE actors: the engine records each token's experts and the
    # actor's old-log-prob and training forwards route them there (DESIGN.md §7).
    router_replay: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class CriticConfig:
    enable: bool | None = None  # None = on exactly when algorithm.adv_estimator is gae
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    mini_batch_size: int = 8
    micro_batch_size: int = 1
    ppo_epochs: int = 1
    cliprange_value: float = 0.5  # clip of the value update
    loss_agg_mode: LossAggMode = "token-mean"  # how the value loss is averaged
    init_from: str | None = None  # checkpoint of a reward model; None = the actor's weights
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)


@dataclass
class ReferenceConfig:
    enable: bool | None = None  # None = on when a KL term is used
    micro_batch_size: int = 1
    offload_params: bool = True


@dataclass
class OverlongBufferConfig:
    # DAPO's soft overlong punishment: a response in the last `length` tokens before
    # rollout.max_response_length loses up to penalty_factor, linearly in its length.
    enable: bool = False
    length: int = 256  # L_cache, tokens; at most rollout.max_response_length
    penalty_factor: float = 1.0  # the penalty at the maximum length (reward units)


@dataclass
class RewardConfig:
    type: Literal["rule", "model"] = "rule"
    # Rule reward: a registry name (gsm8k, boxed_math, exact_match) or "module:function".
    # With multi-turn rollouts it scores each trajectory's final answer, added to the
    # environment's reward; null there: the environment's reward alone.
    function: str | None = "exact_match"
    model_path: str | None = None  # HF *ForSequenceClassification checkpoint, type=model
    micro_batch_size: int = 1
    # A reward function that raises on a sample: score it `error_score` and count it, or stop.
    on_error: Literal["score", "raise"] = "score"
    error_score: float = 0.0
    # Seconds one call of a user function ("module:function") may take; it runs in a worker
    # process that is killed past it, and the call fails as if it raised (on_error).
    # Below half of parallel.timeout_s: the other ranks wait for the scores that long.
    timeout_s: float = 30.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class EnvironmentConfig:
    # Multi-turn rollouts: the environment class, "path/to/file.py:Name",
    # "package.module:Name" or a built-in (tool_calling); null: single-turn generation.
    function: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the class, per trajectory
    # Seconds one call (start, step, close) may take; its worker process is killed past
    # it and the trajectory ends ("environment_error"). Below half of parallel.timeout_s.
    timeout_s: float = 60.0
    # Environment worker processes per rank at most; 0: one per trajectory in flight. A
    # worker holds one trajectory's environment from start to close, so a smaller cap
    # also caps how many trajectories generate at once (the rest wait for a worker).
    max_concurrent: int = 0
    # An observation's text (its messages together) is cut to this many characters.
    max_observation_chars: int = 16384


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL / Parquet
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # text field; or `messages` for chat data
    answer_key: str = "answer"  # field the rule reward compares against
    train_batch_size: int = 8  # prompts per step (global)
    val_batch_size: int = 16
    shuffle: bool = True
    apply_chat_template: bool = False
    # A task generated on the fly instead of files (`data/synthetic.py`): the CPU demo and
    # the end-to-end tests. It brings its own character tokenizer; model.vocab_size >= 100.
    synthetic_task: Literal["digit_echo", "key_lookup"] | None = None
    synthetic_size: int = 1024  # training prompts; validation uses data.val_batch_size
    # Prompts of this many tokens (k digits and their spaces: 2k - 1; an even length is
    # one short) instead of 5-11: the demo task at the lengths of a real one, for
    # throughput measurements. null: the demo's own.
    synthetic_prompt_length: int | None = None
    val_size: int | None = None  # synthetic validation prompts; None = data.val_batch_size


@dataclass
class TrainerConfig:
    total_steps: int | None = None  # None = total_epochs over the data
    total_epochs: int = 1
    # sync: generate a whole batch, train, sync (the default). colocated_async: partial
    # rollouts on the same GPUs (rollout.partial, rollout.max_staleness). split_async:
    # the last placement.rollout_ranks ranks only generate, the others only train, the
    # next batches generated while a step trains (rollout.max_staleness versions behind).
    mode: Literal["sync", "colocated_async", "split_async"] = "sync"
    total_epochs: int = 1
    seed: int = 1234
    deterministic: bool = False  # seeded + deterministic kernels: two runs match bit for bit
    output_dir: str = "runs"  # run folder = output_dir/experiment_name
    experiment_name: str = "default"
    val_interval: int = 0  # steps between evaluations; 0 = off
    dry_run: bool = False  # resolve, initialise, print the layout, exit
    # Python's automatic garbage collection off while training, a collection every
    # manual_gc_interval steps instead (0: only before the first), as Megatron-LM's
    # --manual-gc: an automatic collection pauses the host at a random point of a step,
    # and a launch-bound GPU waits for it.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    # A NaN/inf loss (any rank) or gradient norm: `stop` ends the run before the optimizer
    # step, with one line naming the step and the role; `skip` drops that optimizer step
    # (weights unchanged, counted as `<role>/steps_skipped`) and trains on.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # Write each step's trajectories (token ids, loss mask, log-probs, texts, turns,
    # finish reason, reward) as JSONL under the run folder, for debugging.
    dump_rollouts: bool = False


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # steps between checkpoints; 0 = only on SIGTERM and at the end
    keep_last: int = 2  # older checkpoints are deleted
    resume: Literal["auto", "never"] = "auto"  # auto = from the newest in the run folder
    resume_from: str | None = None  # a specific checkpoint directory (overrides resume)
    save_on_sigterm: bool = True
    verify: bool = True  # check every file's checksum before resuming (refuses old checkpoints)
    allow_reshard: bool = False  # resume at another layout (dp_reshardable optimizer: DP only)
    # Also write the actor as a Hugging Face model folder (config, tokenizer, safetensors) at
    # every checkpoint and at the end: <run>/hf/step_XXXXXXXX, the last keep_last kept.
    save_hf: bool = False
    # With actor.lora.rank > 0: also write the adapters alone in the HF PEFT layout
    # (adapter_config.json, adapter_model.safetensors; `peft.PeftModel.from_pretrained` on
    # model.hf_path) at every checkpoint and at the end: <run>/hf_adapter/step_XXXXXXXX.
    save_hf_adapter: bool = False


@dataclass
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    tensorboard: bool = False  # also write TensorBoard events (needs `tensorboard`)
    # Also log every step's metrics to Weights & Biases (needs `wandb`; rank 0 only). The
    # run is named trainer.experiment_name; WANDB_MODE=offline etc. work as usual.
    wandb: bool = False
    wandb_project: str = "rl_megatron"
    wandb_entity: str | None = None  # team or user; None = wandb's default
    log_interval: int = 1  # steps between console lines


@dataclass
class PlacementConfig:
    # trainer.mode: split_async: the last this many ranks of the launch only generate (the
    # rest train, at the parallel.* layout); a multiple of rollout.tp.
    rollout_ranks: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir) / self.trainer.experiment_name


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> Config:
    """Read YAML `path`, apply dotted `overrides` (`actor.optim.lr=1e-6`), type-check.

    Cross-field checks that need the world size live in `config_checks.validate`.
    Raises ConfigError with a one-line message naming the key or file.
    """
    raw = load_yaml(path, overrides or [])
    config = from_dict(Config, raw)
    _fill_architecture_from_hf(config)
    _resolve_defaults(config)
    return config


_HF_ARCH_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "vocab_size": "vocab_size",
}


def _fill_architecture_from_hf(config: Config) -> None:
    model = config.model
    if model.hf_path is None:
        return
    config_json = Path(model.hf_path) / "config.json"
    if not config_json.is_file():
        raise ConfigError(f"model.hf_path: {config_json} not found")
    try:
        hf = json.loads(config_json.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.hf_path: {config_json} is not valid JSON ({exc})") from None
    for ours, theirs in _HF_ARCH_FIELDS.items():
        given = getattr(model, ours)
        value = hf.get(theirs)
        if value is None and ours == "num_query_groups":
            value = hf.get("num_attention_heads")
        if given is not None and given != value:
            raise ConfigError(
                f"model.{ours}: {given} given, but {config_json} says {theirs}={value}; "
                "leave architecture fields out when model.hf_path is set"
            )
        setattr(model, ours, value)
    # Mixtures of experts: Qwen3-MoE (num_experts / num_local_experts, moe_intermediate_size)
    # and Mixtral (num_local_experts, intermediate_size = an expert's width).
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if experts:
        model.num_experts = int(experts)
        model.moe_router_topk = int(hf.get("num_experts_per_tok", model.moe_router_topk))
        model.moe_ffn_hidden_size = hf.get("moe_intermediate_size") or hf.get("intermediate_size")


def _resolve_defaults(config: Config) -> None:
    """Turn the `None = derived` defaults into concrete values."""
    model = config.model
    if model.num_query_groups is None:
        model.num_query_groups = model.num_attention_heads
    if model.tokenizer_path is None:
        model.tokenizer_path = model.hf_path
    if model.num_experts and model.moe_ffn_hidden_size is None:
        model.moe_ffn_hidden_size = model.ffn_hidden_size
    if config.critic.enable is None:
        config.critic.enable = config.algorithm.adv_estimator == "gae"
    if config.reference.enable is None:
        config.reference.enable = config.algorithm.use_kl_in_reward or config.actor.use_kl_loss
    correction = config.algorithm.rollout_correction
    if config.trainer.mode != "sync" and correction.level is None:
        # Stale tokens need the behaviour policy's log-probs: token-level truncated IS at
        # rollout_correction.threshold (2) on top of decoupled PPO-clip (DESIGN.md §7).
        correction.level = "token"
    if config.rollout.quantization is not None and correction.level is None:
        # FP8 generation samples from another policy than the bf16 one trained: token-level
        # truncated IS at threshold 2, which verl found necessary (DESIGN.md §7, "FP8 rollout").
        correction.level = "token"
    if config.rollout.partial.chunk_tokens is None:
        r = config.rollout
        r.partial.chunk_tokens = -(-r.max_response_length // (max(r.max_staleness, 0) + 1))
    if config.rollout.sync_probe_tokens is None:
        config.rollout.sync_probe_tokens = min(32, config.rollout.max_response_length)
    if config.rollout.calculate_log_probs is None:
        # The behaviour policy's log-probs are what the correction's weights are made of.
        config.rollout.calculate_log_probs = (
            config.algorithm.rollout_correction.level is not None
            or config.rollout.sync_probe_prompts > 0  # the probe compares them
        )


def save_resolved(config: Config, run_dir: Path) -> Path:
    """Write the resolved config next to the run's outputs (YAML, reloadable)."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.resolved.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    tmp.replace(path)
    return path
