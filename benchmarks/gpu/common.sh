# Sourced by the suite scripts: where results go, and how each benchmark is launched.
# RES collects logs and JSON; the suite tars it into $OUT (the device tool returns at most
# 8 files). Every step runs under its own `timeout`, so one that hangs or fails costs its
# own slot only and the suite still ends (and tars) inside the call's limit.
# STEPS="name glob ..." runs only the steps it names (a follow-up run of a few of them).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
# The repository on the path: benchmarks run as scripts (sync_ab.py imports rl_megatron, and
# run 21's first try failed on it when launched outside these suites).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
RES=${RES:-/tmp/res}
mkdir -p "$RES"
TR1="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
TR2="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
SHAPE_085B="--layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 5632 --vocab 32000"
# Llama-2-7B's layer shape at half its depth: 3.4B parameters, whose weights, fp32 grads,
# master copy and Adam state (61 GB) fit one H200 without offload.
# Micro-batches of 16, as measured in runs 4 and 5 (peak 81 GiB in the actor update).
HALF_7B=(model.num_layers=16 model.hidden_size=4096 model.num_attention_heads=32
         model.num_query_groups=32 model.ffn_hidden_size=11008 actor.micro_batch_size=16
         critic.micro_batch_size=16 reference.micro_batch_size=16)

SUITE=${SUITE:-results}
TAG=${TAG:-run}  # suffix of the JSON names: one per GPU run (RESULTS.md cites them)

# Every GPU's power, temperature, utilisation and clocks once a second while the suite
# runs: whether a slow phase ran at lower clocks, or the GPU waited at full ones.
nvidia-smi dmon -s puc -d 1 -o T >"$RES/dmon_$SUITE.txt" 2>&1 &
DMON_PID=$!
trap 'kill $DMON_PID 2>/dev/null' EXIT

finish() {  # pack $RES into $OUT/$SUITE.tgz (after every step: a call cut short keeps it)
  nvidia-smi >"$RES/nvidia-smi.txt" 2>&1
  # Per-process temporary name: both chains of a suite pack concurrently. Profiler traces
  # travel as files of their own (each file back is limited to 16 MiB), the small ones only.
  tar czf "$OUT/.$SUITE.$BASHPID" --exclude='trace_*' -C "$RES" . &&
    mv "$OUT/.$SUITE.$BASHPID" "$OUT/$SUITE.tgz"
  find "$RES" -maxdepth 1 -name 'trace_*.json.gz' -size -15M -exec cp {} "$OUT/" \;
}

step() {  # step NAME SECONDS COMMAND...: run with a deadline, log to $RES/NAME.log
  local name=$1 limit=$2 pattern wanted=1
  shift 2
  if [ -n "${STEPS:-}" ]; then  # STEPS="glob ...": run only the steps it names
    wanted=0
    read -ra patterns <<<"$STEPS"
    for pattern in "${patterns[@]}"; do [[ $name == $pattern ]] && wanted=1; done
  fi
  [ $wanted = 1 ] || return 0
  local start=$SECONDS
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  echo "$name: rc=$? ${limit}s limit, $((SECONDS - start))s" | tee -a "$RES/steps.txt"
  finish
}
