#!/usr/bin/env bash
# Issue 9 on two GPUs (NCCL): the multi-rank tests, resharding across GPUs, and the 7B
# pipeline-parallel trainer step with vLLM rollout (GRPO, then PPO+GAE).
#   bash benchmarks/gpu/two_gpus.sh    # ~9.5 min; results in $OUT/two_gpus.tgz
SUITE=two_gpus
source "$(dirname "$0")/common.sh"
# `make test-gpu` (its file list read from the Makefile where make is missing).
if command -v make >/dev/null; then
  step test_gpu 150 make test-gpu PYTHON=python3
else
  files=$(sed -n '/^test-gpu:/,/^$/p' Makefile | grep -o 'tests/[^ ]*\.py')
  step test_gpu 150 env RL_MEGATRON_TEST_DEVICE=cuda python3 -m pytest -q -rs \
    -p no:cacheprovider $files
fi
for algo in grpo gae; do
  step "trainer_7b_pp2_$algo" 150 $TR2 benchmarks/trainer_bench.py \
    --config yaml_configs/bench_h200x2_7b_pp2.yaml --algorithms $algo --steps 1 --no-plain \
    --out-json "$RES/trainer_h200x2_7b_pp2_$algo.json"
done
for model in llama-1b llama2-7b; do
  step "reshard_2gpu_$model" 50 $TR2 benchmarks/reshard_bench.py --model $model \
    --dtype bfloat16 --bucket-mb 512 --repeats 10 --layouts "1,1,2 1,2,1 2,1,1" \
    --rollout-tp 1,2 --out-json "$RES/reshard_h200x2_$model.json"
done
finish
