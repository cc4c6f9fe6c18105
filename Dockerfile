# rl_megatron's GPU image: a torch, vLLM, Transformer Engine and megatron-core that agree.
#
#   docker build -t rl_megatron .
#   docker run --gpus all --rm -it rl_megatron bash docker/smoke.sh     # after every build
#
# Pins and why (tests/unit/test_container_pins.py checks them against setup.py and the
# versions benchmarks/RESULTS.md records for the GPU runs):
#   base nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04
#       CUDA 13.0, what torch's cu130 wheels are built for; Ubuntu 24.04's Python 3.12, the
#       Python of the GPU measurements; a devel image, since TE's torch extension compiles
#       here against the torch below.
#   torch 2.11.0 (cu130)      the exact torch vLLM 0.26.0 requires (torch==2.11.0, with
#                             torchvision 0.26.0 and torchaudio 2.11.0), and the one measured.
#   vllm 0.26.0               the newest vLLM built for torch 2.11 and the version every
#                             number in RESULTS.md was taken with (DESIGN.md §3).
#   transformer-engine 2.14.1 its core library from the CUDA 13 wheel, its PyTorch extension
#                             built in this image (--no-build-isolation) against the torch
#                             above, so the two cannot disagree.
#   megatron-core 0.16.1      what setup.py pins and every test runs.
#   apex                      not installed by default: with TE present megatron-core takes
#                             its fused Adam and fused norms from TE, and apex has no release
#                             on PyPI to pin. --build-arg APEX_COMMIT=<sha> builds it from
#                             source against the same torch.
# Why not NVIDIA's PyTorch container (the previous base, 25.09): its torch is NGC's own
# build (2.9), which no vLLM wheel accepts; `pip install vllm` replaced it with torch 2.11 and
# left the image's TE and apex compiled against a torch that was gone.
#
# A constraints file holds torch, torchvision and torchaudio at their pins through every
# later install: a package that wanted another torch fails the build instead of replacing it.
# Not built in the repository's CI (no Docker daemon there); docker/smoke.sh is the check.

ARG CUDA_IMAGE=nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCHVISION_VERSION=0.26.0
ARG TORCHAUDIO_VERSION=2.11.0
ARG TORCH_CUDA=cu130
ARG VLLM_VERSION=0.26.0
ARG TE_VERSION=2.14.1
ARG MCORE_VERSION=0.16.1
ARG APEX_COMMIT=
# Compile jobs for TE (and apex); each takes several GB of memory.
ARG MAX_JOBS=8

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_CONSTRAINT=/opt/constraints.txt \
    PATH=/opt/venv/bin:$PATH \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NCCL_NVLS_ENABLE=0 \
    RL_MEGATRON_TORCH_VERSION=${TORCH_VERSION} \
    RL_MEGATRON_VLLM_VERSION=${VLLM_VERSION} \
    RL_MEGATRON_TE_VERSION=${TE_VERSION} \
    RL_MEGATRON_MCORE_VERSION=${MCORE_VERSION}

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv git build-essential ninja-build ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip setuptools wheel packaging

RUN printf 'torch==%s\ntorchvision==%s\ntorchaudio==%s\n' \
        "${TORCH_VERSION}" "${TORCHVISION_VERSION}" "${TORCHAUDIO_VERSION}" > /opt/constraints.txt \
 && pip install --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
        "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
        "torchaudio==${TORCHAUDIO_VERSION}"

RUN pip install "vllm==${VLLM_VERSION}" "megatron-core==${MCORE_VERSION}" pybind11

RUN MAX_JOBS=${MAX_JOBS} NVTE_FRAMEWORK=pytorch pip install --no-build-isolation \
        "transformer_engine[pytorch,core_cu13]==${TE_VERSION}"

RUN if [ -n "${APEX_COMMIT}" ]; then \
        git clone https://github.com/NVIDIA/apex /tmp/apex \
     && git -C /tmp/apex checkout "${APEX_COMMIT}" \
     && MAX_JOBS=${MAX_JOBS} APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
        pip install --no-build-isolation /tmp/apex \
     && rm -rf /tmp/apex; \
    fi

WORKDIR /opt/rl_megatron
COPY setup.py pyproject.toml README.md ./
COPY rl_megatron ./rl_megatron
# Its dependencies are in place already; the constraints keep torch where it is.
RUN pip install -e ".[plot]"
COPY launch ./launch
COPY yaml_configs ./yaml_configs
COPY checkpoints_tools ./checkpoints_tools
COPY benchmarks ./benchmarks
COPY docker ./docker

# torchrun --nproc_per_node 8 launch/ppo.py --config yaml_configs/llama7b.yaml
CMD ["bash"]
