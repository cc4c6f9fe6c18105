#!/usr/bin/env bash
# Issue 8's one-GPU benchmarks on a two-GPU machine: two chains, one per GPU, at once.
# Needs megatron-core (and vLLM for the vLLM rollout) importable by python3.
#   bash benchmarks/gpu/one_gpu_each.sh    # up to ~9.5 min; results in $OUT/one_gpu.tgz
SUITE=one_gpu
source "$(dirname "$0")/common.sh"
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  # 0.85B: plain megatron-core loop (before and after the trainers), GRPO and PPO+GAE
  # with a KL loss (reference on), one actor step and one plain step profiled.
  step trainer_1b 290 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_1b.yaml \
    --steps "${TRAINER_STEPS:-6}" --no-plain-masked --profile-dir "$RES" --profile-update \
    --out-json "$RES/trainer_h200_1b_$TAG.json" actor.use_kl_loss=true
  # ~7B layer shape at 16 layers: actor update vs the plain loop, GRPO.
  step trainer_7b_half 150 $TR1 benchmarks/trainer_bench.py --config yaml_configs/bench_h200_1b.yaml \
    --algorithms grpo --steps 1 --plain-iters 4 --plain-warmup 2 --no-plain-masked \
    --run-dir runs/trainer_bench_7b_half --out-json "$RES/trainer_h200_7b_half_$TAG.json" \
    "${HALF_7B[@]}"
  # Rollout without vLLM (transformers eager and static+compile, the Megatron engine with
  # and without CUDA graphs) was measured in runs/2026-11-29-h200x2-run03-*.md; ROLLOUT_MEGATRON=1 repeats it.
  if [ "${ROLLOUT_MEGATRON:-0}" = 1 ]; then
    step rollout_megatron 300 $TR1 benchmarks/rollout_bench.py $SHAPE_085B --dtype bfloat16 \
      --batches 64,256 --prompt-len 128 --max-new 256 \
      --engines hf,hf-static,megatron,megatron-eager --out-json "$RES/rollout_h200_megatron_$TAG.json"
  fi
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=${SECOND_GPU:-1}
  for model in llama-1b llama2-7b; do
    step "reshard_1gpu_$model" 45 $TR1 benchmarks/reshard_bench.py --model $model \
      --dtype bfloat16 --bucket-mb 512 --repeats 10 --out-json "$RES/reshard_h200_${model}_$TAG.json"
  done
  # vLLM: standalone vllm.LLM vs the in-trainer engine synced from Megatron, sleep/wake.
  # One process for both, so the ratio is measured within one run.
  step rollout_vllm 300 $TR1 benchmarks/rollout_bench.py $SHAPE_085B --dtype bfloat16 \
    --batches 64,256 --prompt-len 128 --max-new 256 --engines vllm-standalone,vllm \
    --gpu-memory-utilization 0.3 --repeats "${ROLLOUT_REPEATS:-5}" \
    --out-json "$RES/rollout_h200_vllm_$TAG.json"
  if ! grep -q "^rollout_vllm: rc=0" "$RES/steps.txt"; then
    # Should the standalone engine fail again, the in-trainer engine on its own still
    # gives its tokens/s and the sleep/wake memory.
    step rollout_vllm_trainer 150 $TR1 benchmarks/rollout_bench.py $SHAPE_085B \
      --dtype bfloat16 --batches 64,256 --prompt-len 128 --max-new 256 --engines vllm \
      --gpu-memory-utilization 0.3 --out-json "$RES/rollout_h200_vllm_trainer_$TAG.json"
  fi
}
# On a one-GPU machine (nvidia-h200), or with SERIAL=1, the chains run one after the
# other: the host-bound measurements lose up to 10 % beside another chain (runs/2026-11-30-h200x2-run05-update-host-waits.md).
if [ "${SERIAL:-0}" != 1 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  gpu0 &
  CHAIN0=$!
  gpu1 &
  CHAIN1=$!
  wait $CHAIN0 $CHAIN1  # not a bare wait: the GPU monitor (common.sh) runs in the background
else
  gpu0
  SECOND_GPU=0 gpu1
fi
finish
