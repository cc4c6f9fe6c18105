#!/usr/bin/env bash
# Issues 19 and 21 on one H200: the whole RL step against its parts, each ratio an
# interleaved A/B (benchmarks/ab.py). Needs megatron-core, and vLLM for every step but the
# moe_* ones without it. Run a subset with STEPS="glob ..." (common.sh); results in
# $OUT/whole_step.tgz.
#   STEPS="moe_* reshard_*" bash benchmarks/gpu/whole_step.sh  # no vLLM needed
#   STEPS="rollout_ab_085b" bash benchmarks/gpu/whole_step.sh
#   STEPS="sync_ab_* e2e_1.5b*" bash benchmarks/gpu/whole_step.sh
#   STEPS="e2e_8b" bash benchmarks/gpu/whole_step.sh  # alone: it needs most of a call
#   STEPS="async_ab_1.5b" bash benchmarks/gpu/whole_step.sh  # alone too (issue 39)
#   STEPS="fp8_rollout_8b" bash benchmarks/gpu/whole_step.sh  # alone too (issue 40); "fp8_rollout_8b_b64" too
#   STEPS="lora_8b_rank8 lora_8b_full" ...  # together (issue 41)
#   STEPS="lora_hf_8b", then "lora_8b_sync_merged", then "lora_8b_sync_adapter"  # (issue 41)
SUITE=whole_step
source "$(dirname "$0")/common.sh"
SHAPE_7B="--layers 32 --hidden 4096 --heads 32 --kv-heads 32 --ffn 11008 --vocab 32000"

# The weight sync's CUDA graphs for real (CPU CI runs them with a stand-in): a captured
# copy replayed behind writes to its sources, and whole syncs between CUDA tensors.
step reshard_tests 240 python3 -m pytest -q -rs -p no:cacheprovider tests/unit/test_reshard_caches.py

# MoE (issue 19): the actor update against a plain megatron-core MoE loop, and resharding
# the experts against a device copy of the same bytes.
# Responses of 64 (the config's 128 took ~70 s of eager MoE decode per step; the update's
# comparison with the plain loop is on whatever lengths the step makes), then the update
# and the plain loop as eight interleaved A/B rounds (runs/2026-12-01-h200-run10-sync-kept-mapped.md profiled them:
# add --profile-dir "$RES" --profile-update, ~80 s more).
# --update-diagnostics 8: eight more rounds splitting update ÷ plain into its factors
# (update_diagnostics.py: our role code, the model instance, the data; ~95 s more).
step moe_trainer 520 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_moe.yaml \
  --algorithms grpo --warmup-steps 1 --steps 2 --no-plain-masked --interleave-update 8 \
  --update-diagnostics 8 --out-json "$RES/trainer_h200_moe_$TAG.json" \
  rollout.max_response_length=64 model.max_position_embeddings=128
# The target's like-for-like form for an MoE (`same_tokens` factor, runs/2026-12-02-h200-run15-8b-step.md):
# the plain loop on the update's own micro-batches, in rounds of four calls of each side
# (a call of ~3.5 s spread ±12 % between neighbouring rounds on the H200; the plain loop
# against itself too). No diagnostics: their factors were measured in three runs.
step moe_trainer_same_tokens 520 $TR1 benchmarks/trainer_bench.py \
  --config yaml_configs/bench_h200_moe.yaml --algorithms grpo --warmup-steps 1 --steps 2 \
  --no-plain-masked --interleave-update 4 --update-calls-per-round 4 --plain-update-batches \
  --out-json "$RES/trainer_h200_moe_same_tokens_$TAG.json" \
  rollout.max_response_length=64 model.max_position_embeddings=128
# Three more calls profiled (--profile-dir): where the host time around 2 048 expert
# copies goes, op by op; and the sync with its copies replayed as CUDA graphs against the
# same sync issuing them directly, interleaved (graphs_vs_direct).
step moe_reshard 150 $TR1 benchmarks/reshard_bench.py --model qwen3-moe-2b --dtype bfloat16 \
  --bucket-mb 512 --repeats 10 --profile-dir "$RES" \
  --out-json "$RES/reshard_h200_qwen3-moe-2b_$TAG.json"

# The same for a dense shape (Llama-3.2-1B's, into a plain tensor store: no vLLM needed):
# what the CUDA graphs do where the copies are few and large.
step reshard_1b 120 $TR1 benchmarks/reshard_bench.py --model llama-1b --dtype bfloat16 \
  --bucket-mb 512 --repeats 10 --rollout-tp 1 --out-json "$RES/reshard_h200_llama-1b_$TAG.json"

# In-trainer vLLM vs standalone vLLM, 0.85B (issue 21: >= 0.98x median, >= 0.95x worst).
# Eight rounds: four spread by up to 26 % (runs/2026-12-01-h200-run09-whole-step-moe.md). Start-up is most of the time; the
# JSON is written after every mode, so a cut run keeps its rows.
step rollout_ab_085b 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 64,256 --prompt-len 128 --max-new 256 --samples 4 --modes greedy,greedy_llm,sampled \
  --repeats 8 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_085b_$TAG.json"
# Greedy only, sixteen rounds, with the standalone against itself (greedy_aa): the tenth
# run's rounds spread ±30 % on both sides; this says how much of that is the host's.
step rollout_ab_085b_greedy 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 64,256 --prompt-len 128 --max-new 256 --modes greedy,greedy_aa \
  --repeats 16 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_085b_greedy_$TAG.json"
# The same with each process's threads pinned to its own half of the cores (--pin): does
# the spread shrink?
step rollout_ab_085b_pinned 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 64,256 --prompt-len 128 --max-new 256 --modes greedy,greedy_aa --pin \
  --repeats 16 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_085b_pinned_$TAG.json"
# Greedy and its control as in rollout_ab_085b_greedy, in rounds of two calls of each
# engine (A B B A, then B A A B; a round's ratio is sum(B) / sum(A), ab.py): one call of
# ~1 s spreads ±25 % here (rollout_ab_h200_085b_greedy_run13.json's control: worst round 0.80x), and an even count
# of calls per round cancels a drift linear in time. Time, from rollout_ab_h200_085b_greedy_run13.json
# (…_run11.json's slower calls in brackets): start-up 235 s (standalone 187, in-trainer 48)
# + ~35 s of checkpoint and imports; a call 1.0 s at batch 64 (1.15), 2.2 s at batch 256
# (2.9). Per batch and mode (greedy, greedy_aa): a warm-up round of one call each + 6 rounds
# x 2 calls x 2 engines = 26 calls; batch 64: 2 x 26 x 1.0 = 52 s, batch 256: 2 x 26 x 2.2
# = 114 s; 166 s of calls (207 s) -> ~440 s (~480 s), under the 560 s limit. 8 rounds x 3
# calls (50 calls per batch and mode) would take ~590 s.
step rollout_ab_085b_long 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 64,256 --prompt-len 128 --max-new 256 --modes greedy,greedy_aa \
  --repeats 6 --calls-per-round 2 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_085b_long_$TAG.json"
# Rounds long enough for the worst-round bound, batch 64 only. rollout_ab_h200_085b_long_run16.json's calls of
# the same work took 0.63-1.27 s (the decode is CPU-bound; the GPU clock never moved), a
# spread of ~14 % per call: a round's ratio of sums over K calls of each spreads ~20 %/sqrt(K),
# so 0.95x at the worst of a few rounds needs K ~ 16. Time: start-up ~270 s + 2 modes x
# (1 warm-up call each + 3 rounds x 16 calls x 2 engines) x ~0.85 s = ~440 s (seventeenth
# run: 435 s; the control's rounds 0.96-1.07). --profile: one more call of each, under
# cProfile, with vLLM's in-process loop split (schedule, update_from_output, process_outputs).
step rollout_ab_085b_k16 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 64 --prompt-len 128 --max-new 256 --modes greedy,greedy_aa --profile \
  --repeats 3 --calls-per-round 16 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_085b_k16_$TAG.json"
# The same at batch 256, in rounds of 8 (a call ~2.2 s): start-up ~270 s + 2 modes x
# (1 + 3 x 8 x 2) x 2.2 s = ~490 s. Not yet run.
step rollout_ab_085b_b256_k8 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 256 --prompt-len 128 --max-new 256 --modes greedy,greedy_aa \
  --repeats 3 --calls-per-round 8 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_085b_b256_k8_$TAG.json"
# The trainer's engine drives vLLM's in-process engine core itself (rollout/vllm/core_loop.py)
# instead of stepping vLLM's LLMEngine, whose per-step output handling ran in the decode's
# one thread. greedy = that loop against the standalone (the target); greedy_llm = vLLM's
# own in-process loop (the trainer's path until then) against the same standalone, for the
# before/after in one process. Rounds as in rollout_ab_085b_k16 / _b256_k8 (~450 / ~490 s).
step rollout_core_b64 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 64 --prompt-len 128 --max-new 256 --modes greedy,greedy_llm --profile \
  --repeats 3 --calls-per-round 16 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_core_h200_085b_b64_$TAG.json"
step rollout_core_b256 560 $TR1 benchmarks/rollout_ab.py $SHAPE_085B --dtype bfloat16 \
  --batches 256 --prompt-len 128 --max-new 256 --modes greedy,greedy_llm \
  --repeats 3 --calls-per-round 8 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_core_h200_085b_b256_$TAG.json"
# Run 21 (H200): 0.857x and 0.866x, 141-155 s; --profile-dir adds two cProfiled calls of
# each side (~15 s). Since run 24 the JSON splits every call into engine-core steps and
# the time outside them (`engine_split`): 0.863x (H100, 182 s with the profile), 0.922x
# after `CoreLoop.add_turn` (run 24b); run 38 (H200): 0.985x and 0.931x, 221-230 s each.
# Multi-turn generation on the in-trainer engine (issue 38: >= 0.9x at the median): 64
# records x 4 trajectories x 3 turns of 128 tokens, an environment that answers at once
# with 16 tokens, against single-turn generate of 384 tokens per row (the same sampled
# tokens), interleaved. 141-182 s on an H100 or the H200 (runs 21-24): start-up ~80 s
# (checkpoint and engine) + 1 warm-up and 8 rounds x 2 calls of ~2.5-3.5 s each.
step multi_turn_085b 400 $TR1 benchmarks/multi_turn_generation.py $SHAPE_085B \
  --dtype bfloat16 --records 64 --samples 4 --turns 3 --prompt-len 128 --max-new 128 \
  --obs-len 16 --repeats 8 --gpu-memory-utilization 0.3 \
  --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 --profile-dir "$RES" \
  --out-json "$RES/multi_turn_h200_085b_$TAG.json"

# The trainer's weight-sync phase vs a device copy of the same bytes (issue 21: <= 3x).
step sync_ab_085b 150 $TR1 benchmarks/sync_ab.py $SHAPE_085B --repeats 7 \
  --out-json "$RES/sync_ab_h200_085b_$TAG.json"
# Issue 40: the same sync built with rollout.verify_sync=sample (one tensor of each kind
# read back through vLLM and compared with what was sent, every sync), then that sync
# without the verifier against with it, interleaved in the one trainer (--verify-ab):
# target <= 5 % at the median. ~100 s (sync_ab_085b's start-up and two sets of rounds).
# Run 21 (H200): 76 s, +36 % (17.9 vs 13.6 ms; 352 MB of 7 tensors read, ~5 ms a check),
# before the device-side word comparison and the cached programs (verify.py). Run 22 (H100):
# +24.5 % and +16.7 %, 3-5 ms a check, still host-bound. Since then: row windows of at most
# 8 MiB, a lockstep rotation whose sets compile at the first check, per-name engine reads.
# Run 23 (H100, 16 MiB windows): 0.993x, 1.034x, 1.116x at 7 rounds and 1.117x at 25; with
# 8 MiB windows 1.010x and 1.002x at 25, rounds 0.70-1.41: single calls fall in two modes
# (~10 and ~14 ms, on both sides). So rounds of 4 calls of each side, and the control (the
# sync without the verifier against itself, the same rounds): how far rounds of identical
# work fall apart here. Then three verified syncs profiled (torch.profiler and cProfile).
step sync_ab_085b_verify 150 $TR1 benchmarks/sync_ab.py $SHAPE_085B --repeats 25 --verify-ab \
  --verify-control --calls-per-round 4 --out-json "$RES/sync_ab_h200_085b_verify_$TAG.json"
step sync_ab_085b_verify_profile 150 $TR1 benchmarks/sync_ab.py $SHAPE_085B --repeats 3 \
  --verify-ab --profile-dir "$RES" --out-json "$RES/sync_ab_h200_085b_verify_profile_$TAG.json"
step sync_ab_7b 240 $TR1 benchmarks/sync_ab.py $SHAPE_7B --repeats 7 \
  --out-json "$RES/sync_ab_h200_7b_$TAG.json" actor.offload.optimizer=true
# The trainer's order at level 2 (rollout.wake_weights_during_update): the weights mapped
# back while the actor's last optimizer step runs, so the sync finds them awake; then what
# that wake adds to the update's end (with vs without it, interleaved).
step sync_ab_085b_wdu 200 $TR1 benchmarks/sync_ab.py $SHAPE_085B --repeats 11 \
  --wake-during-update --out-json "$RES/sync_ab_h200_085b_wdu_$TAG.json"
# The same at 7B, its optimizer 60 % on the host as in the 8B step (host Adam ~0.9 s per
# billion offloaded: ~3.7 s an update's end, ~12 of them with the rounds and the warm-up).
# Not yet run: the limit is an estimate (start-up ~100 s as sync_ab_7b).
step sync_ab_7b_wdu 320 $TR1 benchmarks/sync_ab.py $SHAPE_7B --repeats 5 --warmup 1 \
  --wake-during-update --out-json "$RES/sync_ab_h200_7b_wdu_$TAG.json" \
  actor.optim.cpu_offload_fraction=0.6
# rollout.sleep_level=0: the engine keeps its weights on the device while it sleeps. Fifteen
# rounds (sync_ab_h200_085b_l0_r15_run11.json spread 3.05-5.67x) and three syncs profiled after them.
step sync_ab_085b_l0 180 $TR1 benchmarks/sync_ab.py $SHAPE_085B --repeats 15 --sleep-level 0 \
  --profile-dir "$RES" --out-json "$RES/sync_ab_h200_085b_l0_$TAG.json"
step sync_ab_7b_l0 240 $TR1 benchmarks/sync_ab.py $SHAPE_7B --repeats 7 --sleep-level 0 \
  --profile-dir "$RES" --out-json "$RES/sync_ab_h200_7b_l0_$TAG.json" actor.offload.optimizer=true

# Issue 40: FP8 rollout (rollout.quantization: fp8, vLLM's fp8_per_block) against bf16 at
# Llama-3.1-8B's shape (benchmarks/fp8_rollout.py): first the sync's quantization (every
# linear weight quantized into fp8 + block scales vs a bf16 copy_, interleaved), then two
# standalone engines of one random checkpoint, sampled, batch 256 x 1 024 new tokens,
# interleaved rounds; target fp8 >= 1.3x bf16 tokens/s at the median (worst round >= 1.2x).
# Run 21 (H200, 2026-12-06) ran out of its 588 s inside the bf16 engine's start-up: the
# quantization part took ~10 s, the checkpoint ~35 s, and the fp8 engine's start 367 s, of
# which 180 s captured nine CUDA graphs (the Triton block-fp8 kernels compile per batch
# size) and most of the rest warmed the same kernels up. Hence one capture size: with
# ignore_eos every decode step of a call runs all 256 rows, so a graph of 256 serves
# them all (the prefill runs piecewise either way). Runs 22 and 24 (H100): fp8 start
# 196-211 s, bf16 51-52 s, 446 s and 520 s in all. In run 24 the fp8 engine's warm-up call
# and its first timed call took 54-58 s and its second 20 s (bf16: 26 s each), so one
# round was a warm-up's, at 0.45x. Runs 25b and 25d (two warm-up rounds; 25d without
# prefix caching) had a slow fp8 call after a fast one (43.5, 19.3, 30.6, 19.3 s), so a
# fixed number of warm-ups is not enough: the fp8 engine is now called alone until two
# calls in a row agree within 10 % (at most 5; `settle_fp8_s_*` in the JSON), then one
# warm-up round and the timed ones. Run 26 (H100, fresh machine: fp8 start-up 213 s, five
# settle calls) was cut by the limit after one timed round; runs 26b and 26c on the same
# machine afterwards (start-up 54-56 s, two settle calls) ran 3 and 4 rounds without a
# warm-up round: 1.343x, 1.344x, 1.340x. Hence no warm-up round (the settle calls warm the
# fp8 engine; bf16 is steady from its first call) and 3 rounds: 213 + 47 + 171 + 3 x 45 s
# ~ 566 s at worst on a fresh machine.
# Alone in a call (STEPS="fp8_rollout_8b"). JSON written after every round.
SHAPE_8B="--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256"
step fp8_rollout_8b 580 python3 benchmarks/fp8_rollout.py $SHAPE_8B --dtype bfloat16 \
  --batches 256 --prompt-len 128 --max-new 1024 --repeats 3 --warmup 0 --gpu-memory-utilization 0.4 \
  --cudagraph-capture-sizes 256 --out-json "$RES/fp8_rollout_h200_8b_$TAG.json"
# Issue 40's other batch: 64 prompts x 1 024 new tokens (not run yet). A call of its own:
# the start-ups and settle as above, rounds shorter (decode at 64 rows). Its first part
# (the sync's quantization) measures what fp8_rollout_8b's does.
step fp8_rollout_8b_b64 580 python3 benchmarks/fp8_rollout.py $SHAPE_8B --dtype bfloat16 \
  --batches 64 --prompt-len 128 --max-new 1024 --repeats 4 --warmup 0 --gpu-memory-utilization 0.4 \
  --cudagraph-capture-sizes 64 --out-json "$RES/fp8_rollout_h200_8b_b64_$TAG.json"
# The trainer's whole sync phase into an fp8 engine (staged per parameter, then quantized
# on the device: resharding/fp8.py) and into a bf16 one, at the same 8B shape: two runs,
# their medians compared (not interleaved: one trainer holds one engine). Estimates as
# sync_ab_7b's; whether vLLM's online fp8 starts from dummy weights is untested.
step sync_ab_8b_bf16 240 $TR1 benchmarks/sync_ab.py $SHAPE_8B --repeats 7 \
  --out-json "$RES/sync_ab_h200_8b_bf16_$TAG.json" actor.offload.optimizer=true
step sync_ab_8b_fp8 240 $TR1 benchmarks/sync_ab.py $SHAPE_8B --repeats 7 \
  --out-json "$RES/sync_ab_h200_8b_fp8_$TAG.json" actor.offload.optimizer=true \
  rollout.quantization=fp8

# The dense 0.85B shape's whole tensors copied each way, with the graph the sync replays
# (`sync_graph`: large pairs one copy_ each): the device side of the 0.85B sync.
step stacked_copy_dense 90 python3 benchmarks/stacked_copy_bench.py --shape dense-0.85b \
  --rounds 15

# The end-to-end headline (issue 21): a whole GRPO step of a 1.5B shape, vLLM rollout.
step e2e_1.5b 420 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_e2e_1.5b.yaml \
  --algorithms grpo --no-plain --warmup-steps 1 --steps 2 \
  --out-json "$RES/e2e_h200_1.5b_$TAG.json"
# The same step with the engine's weights kept on the device while it sleeps: the reshard
# phase without a wake, and what each phase holds then (memory_gb/*_device_used).
step e2e_1.5b_l0 420 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_e2e_1.5b.yaml \
  --algorithms grpo --no-plain --warmup-steps 1 --steps 2 \
  --out-json "$RES/e2e_h200_1.5b_l0_$TAG.json" rollout.sleep_level=0
# Issue 39: partial rollouts (trainer.mode: colocated_async) against the synchronous loop on
# the same trainer, interleaved rounds of 2 steps each, response lengths from async_ab.py's
# long-tailed sampler (70 % <= 128 tokens, 25 % 129-512, 5 % at 1 024: mean 176); target
# >= 1.3x trained tokens/s per GPU, median and worst round. Time (an estimate, not
# measured): e2e_h200_1.5b_run16.json's phases scaled to these lengths' tokens (45 %):
# ~22 s a synchronous step (generate still runs to 1 024 tokens), ~17 s an asynchronous
# one; (1 warm-up + 4) rounds x 78 s = 390 s, + ~90 s of imports and build (53 s
# there) ~ 480 s.
# Alone in a call (STEPS="async_ab_1.5b"). JSON written after every round.
step async_ab_1.5b 560 $TR1 benchmarks/async_ab.py --config yaml_configs/bench_h200_e2e_1.5b.yaml \
  --steps-per-round 2 --rounds 4 --warmup-rounds 1 --out-json "$RES/async_ab_h200_1.5b_$TAG.json"
# The same with rollout.max_staleness=3 (chunks of 256 by default: ceil(1 024 / 4)): more
# tokens may be two or three versions old, the phases stop earlier. (With chunks of 256 at
# staleness 1, an earlier default, long samples restarted for ever: the CPU smoke run
# trained none at the maximum; the default chunk now lets them finish.) Alone in a call.
step async_ab_1.5b_s3 560 $TR1 benchmarks/async_ab.py --config yaml_configs/bench_h200_e2e_1.5b.yaml \
  --steps-per-round 2 --rounds 4 --warmup-rounds 1 \
  --out-json "$RES/async_ab_h200_1.5b_s3_$TAG.json" rollout.max_staleness=3
# The ~7-8B step of issue 21 on one GPU: Llama-3.1-8B's shape, 32 prompts x 8, 60 % of
# the optimizer on the host, full recompute (memory and time arithmetic in the YAML's
# header). Run it ALONE in one device call (STEPS="e2e_8b"): ~400-530 s estimated, against
# 580 s here. The host's memory is logged every 5 s alongside, because its budget is
# the tighter one.
( free -m | head -1; while :; do echo "$(date +%T) $(free -m | grep Mem:)"; sleep 5; done ) \
  >"$RES/host_memory_e2e_8b.txt" 2>&1 &
HOST_MEMORY_PID=$!
step e2e_8b 580 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_e2e_8b.yaml \
  --algorithms grpo --no-plain --warmup-steps 1 --steps 1 \
  --out-json "$RES/e2e_h200_8b_$TAG.json"
# Issue 41: LoRA (rank 8 on qkv, o, gate/up, down) against full fine-tuning at the 8B
# shape: the actor update's seconds (timing_s/update_actor) and peak memory
# (memory_gb/update_actor_peak), one warm-up and two timed steps each. Both generate with
# the Megatron engine (a LoRA actor needs it until the vLLM sync merges adapters) and a
# small batch (4 prompts x 8, one optimizer step of 32 rows), so the update is what differs.
# Responses of at most 256 tokens (the Megatron engine's eager decode is the slow part;
# the update's rows stay 511 + up to 256 tokens), so both fit one call: rank 8 first.
# Run 38 (H200): 129 s and 197 s; update 0.87 vs 7.04 s, peak 22.3 vs 104.6 GiB allocated.
# On an H100 (80 GB) full fine-tuning does not fit at any offload (runs 23, 35: CUDA OOM at
# 0.8 and at 0.85 with grads offloaded, host OOM at 1.0); LORA_EXTRA="..." adds the same
# overrides to both sides.
LORA_8B="rollout.engine=megatron rollout.engine_kwargs={} data.train_batch_size=4 actor.mini_batch_size=32 rollout.max_response_length=256 ${LORA_EXTRA:-}"
step lora_8b_rank8 580 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_e2e_8b.yaml \
  --algorithms grpo --no-plain --warmup-steps 1 --steps 2 \
  --out-json "$RES/lora_h200_8b_rank8_$TAG.json" $LORA_8B actor.lora.rank=8
step lora_8b_full 580 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_e2e_8b.yaml \
  --algorithms grpo --no-plain --warmup-steps 1 --steps 2 \
  --out-json "$RES/lora_h200_8b_full_$TAG.json" $LORA_8B
kill $HOST_MEMORY_PID 2>/dev/null

# LoRA's two vLLM syncs at the 8B shape (issue 41): merged (every adapted weight, each step)
# against adapter (A and B only; vLLM's LoRA kernels in generation). Adapter needs vLLM to
# load the frozen base itself: lora_hf_8b writes a random HF checkpoint first (/tmp holds it
# while the machine stays warm), each step in a call of its own, in this order. Compare
# timing_s/reshard and timing_s/generate (and tokens/s) of the two JSONs. Run 24 (H100,
# they fit one): 29 s, 192 s and 226 s; merged won both (RESULTS.md).
LORA_HF=/tmp/llama8b_random_hf
step lora_hf_8b 400 python3 benchmarks/random_checkpoint.py --out $LORA_HF $SHAPE_8B \
  --dtype bfloat16 --prompt-len 496 --max-new 1024
LORA_SYNC="model.hf_path=$LORA_HF actor.lora.rank=8 rollout.sleep_level=1 data.train_batch_size=16"
step lora_8b_sync_merged 580 $TR1 benchmarks/trainer_bench.py \
  --config yaml_configs/bench_h200_e2e_8b.yaml --algorithms grpo --no-plain --warmup-steps 1 \
  --steps 2 --out-json "$RES/lora_h200_8b_sync_merged_$TAG.json" $LORA_SYNC rollout.lora_sync=merged
step lora_8b_sync_adapter 580 $TR1 benchmarks/trainer_bench.py \
  --config yaml_configs/bench_h200_e2e_8b.yaml --algorithms grpo --no-plain --warmup-steps 1 \
  --steps 2 --out-json "$RES/lora_h200_8b_sync_adapter_$TAG.json" $LORA_SYNC rollout.lora_sync=adapter

# vLLM's recorded routing against transformers' router on the same tokens (issue 19).
step moe_routing 180 $TR1 benchmarks/moe_routing_check.py --out-json "$RES/moe_routing_h200_$TAG.json"

# MoE in-trainer vLLM vs standalone (issue 19).
step rollout_ab_moe 360 $TR1 benchmarks/rollout_ab.py --family qwen3_moe --layers 16 --hidden 1024 \
  --heads 8 --kv-heads 4 --ffn 3072 --experts 64 --topk 8 --moe-ffn 512 --vocab 151936 \
  --dtype bfloat16 --batches 64 --prompt-len 128 --max-new 128 --samples 4 --repeats 3 \
  --modes greedy,sampled --gpu-memory-utilization 0.3 --cudagraph-capture-sizes 1,2,4,8,16,32,64,128,256 \
  --out-json "$RES/rollout_ab_h200_moe_$TAG.json"
finish
