#!/usr/bin/env bash
# Issue 9 on two GPUs (NCCL): the multi-rank tests, resharding across GPUs, and the 7B
# pipeline-parallel trainer step with vLLM rollout (GRPO, then PPO+GAE).
#   bash benchmarks/gpu/two_gpus.sh [tests|bench]   # both: up to ~16 min, more than one
#   call allows, so give each part its own call; results in $OUT/two_gpus.tgz
PART=${1:-all}
SUITE=two_gpus
source "$(dirname "$0")/common.sh"
if [ "$PART" != bench ]; then
# `make test-gpu`'s files, one step each: a file cut by its deadline then costs no other
# file's report (pytest prints failures only at its end).
for file in $(sed -n '/^test-gpu:/,/^$/p' Makefile | grep -o 'tests/[^ ]*\.py'); do
  step "test_gpu_$(basename "$file" .py)" "${TEST_LIMIT:-110}" env RL_MEGATRON_TEST_DEVICE=cuda python3 -m pytest \
    -q -rA --tb=short -p no:cacheprovider "$file"
done
fi
[ "$PART" = tests ] && exit 0
# vLLM's torch symmetric-memory all-reduce is left off with NVLink multicast (see the
# config's engine_kwargs for the rest).
for algo in grpo gae; do
  step "trainer_7b_pp2_$algo" 200 env VLLM_ALLREDUCE_USE_SYMM_MEM=0 $TR2 benchmarks/trainer_bench.py \
    --config yaml_configs/bench_h200x2_7b_pp2.yaml --algorithms $algo --steps 1 --no-plain \
    --out-json "$RES/trainer_h200x2_7b_pp2_$algo.json"
done
# Issue 39 (b): split placement (one GPU generates with vLLM, one trains; one step off)
# against the synchronous loop co-located on both, the 1.5B GRPO step with async_ab.py's
# long-tailed response lengths: whole launches alternate (benchmarks/split_ab.py), 3
# rounds of 2 warm-up + 4 timed steps per side. Not run yet: the multi-GPU kinds are not
# lent. Estimate from async_ab_1.5b's steps on one H100 (~20-30 s each) and ~60 s per
# launch's start: ~6 launches x ~3 min, more than one call allows, so SPLIT_ROUNDS=1 per
# call (STEPS="split_ab_1.5b"), the rounds' JSONs merged by hand (the order alternates
# with the round index: SPLIT_FIRST_ROUND=k).
step split_ab_1.5b 580 python3 benchmarks/split_ab.py --config yaml_configs/bench_h200_e2e_1.5b.yaml \
  --gpus 2 --rounds "${SPLIT_ROUNDS:-1}" --first-round "${SPLIT_FIRST_ROUND:-0}" \
  --warmup-steps 2 --steps 4 \
  --out-json "$RES/split_ab_h200x2_1.5b_$TAG.json" rollout.max_staleness=1
# Resharding across the GPUs was measured in runs/2026-11-29-h200x2-run03-*.md; RESHARD_2GPU=1 repeats it.
[ "${RESHARD_2GPU:-0}" = 1 ] && for model in llama-1b llama2-7b; do
  step "reshard_2gpu_$model" 50 $TR2 benchmarks/reshard_bench.py --model $model \
    --dtype bfloat16 --bucket-mb 512 --repeats 10 --layouts "1,1,2 1,2,1 2,1,1" \
    --rollout-tp 1,2 --out-json "$RES/reshard_h200x2_$model.json"
done
finish
