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
# Resharding across the GPUs was measured in runs/2026-11-29-h200x2-run03-*.md; RESHARD_2GPU=1 repeats it.
[ "${RESHARD_2GPU:-0}" = 1 ] && for model in llama-1b llama2-7b; do
  step "reshard_2gpu_$model" 50 $TR2 benchmarks/reshard_bench.py --model $model \
    --dtype bfloat16 --bucket-mb 512 --repeats 10 --layouts "1,1,2 1,2,1 2,1,1" \
    --rollout-tp 1,2 --out-json "$RES/reshard_h200x2_$model.json"
done
finish
