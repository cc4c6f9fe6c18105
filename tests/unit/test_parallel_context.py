"""The parallel layout reaches code one way: the run's `ParallelLayout` and `ParallelGroups`,
built in start-up and handed to every consumer. Nothing else reads megatron-core's global
`parallel_state` (or its old name `mpu`): this walks every module's syntax tree, lazy
imports included, and names each read by file:line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("rl_megatron", "checkpoints_tools", "launch")
FORBIDDEN = ("megatron.core.parallel_state", "megatron.core.mpu")
# The modules that build the context from megatron-core's state.
ALLOWED = {
    "rl_megatron/parallel.py",
    "rl_megatron/distributed.py",
}


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _dotted(node: ast.AST) -> list[str]:
    """`a.b.c` → ['a', 'b', 'c'] (empty when the chain does not start at a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def reads(source: str) -> list[int]:
    """Lines of `source` that import or reach into megatron-core's parallel_state / mpu.
    vLLM's own `vllm.distributed.parallel_state` is another module, not a read."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(_forbidden(alias.name) for alias in node.names):
                lines.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            if _forbidden(node.module) or any(_forbidden(n) for n in names):
                lines.add(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in ("parallel_state", "mpu"):
            chain = _dotted(node)
            if chain and chain[0] != "vllm":  # `core.parallel_state`, `megatron.core.mpu`
                lines.add(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # noqa: SIM102
            if _forbidden(node.value):  # importlib.import_module("megatron.core.mpu")
                lines.add(node.lineno)
    return sorted(lines)


def test_only_the_context_builders_read_parallel_state():
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            found += [f"{rel}:{line}" for line in reads(path.read_text())]
    assert not found, (
        "megatron-core's parallel_state read outside parallel.py / distributed.py (take the "
        f"run's ParallelLayout / ParallelGroups instead): {found}"
    )


def test_the_allowed_modules_exist():
    """A moved or renamed module must leave the allow-list, not linger in it."""
    missing = [rel for rel in ALLOWED if not (ROOT / rel).is_file()]
    assert not missing, f"allow-listed modules that do not exist: {missing}"


@pytest.mark.parametrize(
    "source",
    [
        "from megatron.core import parallel_state\n",
        "from megatron.core import parallel_state as ps\n",
        "from megatron.core import tensor_parallel, mpu\n",
        "import megatron.core.parallel_state\n",
        "import megatron.core.parallel_state as ps\n",
        "from megatron.core.parallel_state import get_tensor_model_parallel_rank\n",
        "def f():\n    from megatron.core.mpu import get_data_parallel_rank\n",
        "import megatron.core\nx = megatron.core.parallel_state.get_tensor_model_parallel_rank()\n",
        "from megatron import core\nx = core.parallel_state\n",
        "import importlib\nps = importlib.import_module('megatron.core.parallel_state')\n",
    ],
)
def test_the_guard_catches_each_spelling(tmp_path, source):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert reads(path.read_text()) == [source.count("\n")]


@pytest.mark.parametrize(
    "source",
    [
        "from vllm.distributed import parallel_state\n",
        "import vllm.distributed.parallel_state as vps\nx = vllm.distributed.parallel_state\n",
        "from megatron.core import tensor_parallel\n",
        "from rl_megatron.parallel import ParallelLayout\n",
        "x = 'parallel_state'  # a word in a string\n",
    ],
)
def test_the_guard_leaves_other_modules_alone(tmp_path, source):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert reads(path.read_text()) == []
