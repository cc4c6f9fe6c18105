# rl_megatron on NVIDIA's PyTorch container, which ships Transformer Engine and apex.
#
# Pins and why:
#   nvcr.io/nvidia/pytorch:25.09-py3  PyTorch 2.9 + CUDA 13 + Transformer Engine + apex;
#                                     vLLM's wheels must match its torch (see below).
#   megatron-core==0.16.1             the release our CPU tests run against.
#   vllm==0.26.0                      newest vLLM we have measured (DESIGN.md §3), and the
#                                     in-process `external_launcher` path we rely on.
# vLLM pins an exact torch; if the image's torch differs, pip replaces it. Check
# `python -c "import torch, vllm, transformer_engine"` after building.
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PIP_NO_CACHE_DIR=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_NVLS_ENABLE=0

WORKDIR /opt/rl_megatron
COPY setup.py pyproject.toml README.md ./
COPY rl_megatron ./rl_megatron
RUN pip install "megatron-core==0.16.1" "vllm==0.26.0" \
 && pip install --no-deps -e .
COPY launch ./launch
COPY yaml_configs ./yaml_configs
COPY checkpoints_tools ./checkpoints_tools
COPY benchmarks ./benchmarks

# torchrun --nproc_per_node 8 launch/ppo.py --config yaml_configs/llama7b.yaml
CMD ["bash"]
