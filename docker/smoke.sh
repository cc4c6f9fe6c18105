#!/bin/bash
# After building the image, on a machine with at least one NVIDIA GPU:
#
#   docker run --gpus all --rm rl_megatron bash docker/smoke.sh
#
# 1. imports and versions: torch, vLLM, Transformer Engine (its PyTorch extension loads, so
#    it was built against this torch) and megatron-core are the versions the Dockerfile
#    pins, CUDA is usable, and megatron-core picks TE's fused Adam;
# 2. `--dry-run` of a GPU config (yaml_configs/bench_h200_1b.yaml: random-init 0.85B Llama);
# 3. two GRPO steps of that config on one GPU with the in-process vLLM engine (weights
#    resharded into it each step) and `checkpoint.save_hf=true`; the exported model loads
#    with transformers.
# Exit code 0 and "smoke: OK" at the end when everything holds; the first failure stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${SMOKE_OUT:-$(mktemp -d)}
CONFIG=yaml_configs/bench_h200_1b.yaml
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

echo "smoke: 1/3 imports and versions"
python - <<'PY'
import os

import torch
import transformer_engine
import transformer_engine.pytorch  # noqa: F401  (the extension: fails if built for another torch)
import vllm
from megatron.core import __version__ as mcore_version
from megatron.core.optimizer import Adam

want = {
    "torch": os.environ["RL_MEGATRON_TORCH_VERSION"],
    "vllm": os.environ["RL_MEGATRON_VLLM_VERSION"],
    "transformer_engine": os.environ["RL_MEGATRON_TE_VERSION"],
    "megatron-core": os.environ["RL_MEGATRON_MCORE_VERSION"],
}
have = {
    "torch": torch.__version__.split("+")[0],
    "vllm": vllm.__version__,
    "transformer_engine": transformer_engine.__version__.split("+")[0],
    "megatron-core": mcore_version,
}
for name in want:
    print(f"  {name}: {have[name]} (pinned {want[name]})")
bad = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
assert not bad, f"versions differ from the Dockerfile's pins: {bad}"
assert torch.cuda.is_available(), "torch sees no GPU (run with --gpus all)"
print(f"  CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
assert Adam.__module__.startswith("transformer_engine"), f"megatron-core uses {Adam.__module__}"
PY

echo "smoke: 2/3 --dry-run of $CONFIG"
torchrun --standalone --nproc_per_node 1 launch/ppo.py --config "$CONFIG" --dry-run \
    trainer.output_dir="$OUT" trainer.experiment_name=dry_run

echo "smoke: 3/3 two GRPO steps on one GPU (vLLM engine, checkpoint.save_hf=true)"
torchrun --standalone --nproc_per_node 1 launch/ppo.py --config "$CONFIG" \
    trainer.output_dir="$OUT" trainer.experiment_name=two_steps trainer.total_steps=2 \
    rollout.engine=vllm rollout.max_response_length=32 checkpoint.save_hf=true
python - "$OUT/two_steps/hf/step_00000002" <<'PY'
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(sys.argv[1])
print(f"  {sys.argv[1]}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
PY
python -m rl_megatron.plot "$OUT/two_steps" --out "$OUT/two_steps/curves.png"
echo "smoke: OK ($OUT)"
