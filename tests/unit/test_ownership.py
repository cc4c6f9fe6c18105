"""State lives with its owner: read from the source, no imports run.

* `rl_megatron/resharding/` keeps no module-level mutable state: what a weight sync keeps
  between syncs (plan, program, source tables, copy views, agreed inputs) is state of its
  `WeightSync`, created with the engine and dropped with it. Checked on the syntax tree:
  module- or class-level assignments of a dict / list / set (literal, comprehension or
  constructor, weak dictionaries included), `global` statements, and `lru_cache` /
  `cache` decorators anywhere.
* `trainer/ppo_trainer.py` names no engine kind: what differs between engines is the
  engine's business (`RolloutEngine.sync_from`, `generates_with_trainer_modules`, sleep,
  wake), so the loop has no `rollout.engine` branch, no "vllm" / "megatron" string and no
  engine class or resharding target of its own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rl_megatron"
RESHARDING = PACKAGE / "resharding"
PPO_TRAINER = PACKAGE / "trainer" / "ppo_trainer.py"

MUTABLE_CONSTRUCTORS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
CACHE_DECORATORS = {"lru_cache", "cache", "cached"}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
ENGINE_KINDS = {"vllm", "megatron"}


def _name(node: ast.AST) -> str | None:
    """`f` of `f`, `mod.f`, `f(...)`, `mod.f(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _mutable(value: ast.AST | None) -> bool:
    if isinstance(value, MUTABLE_LITERALS):
        return True
    return isinstance(value, ast.Call) and _name(value) in MUTABLE_CONSTRUCTORS


def _assigned_names(stmt: ast.stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return [t.id if isinstance(t, ast.Name) else ast.unparse(t) for t in targets]


def module_state(path: Path) -> list[str]:
    """Module- and class-level mutable assignments, `global`s and cache decorators."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def scan_body(body: list[ast.stmt], where: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                names = _assigned_names(stmt)
                if "__all__" not in names and _mutable(stmt.value):
                    found.append(f"{path.name}:{stmt.lineno}: {where}{', '.join(names)}")
            elif isinstance(stmt, ast.ClassDef):
                scan_body(stmt.body, f"{stmt.name}.")

    scan_body(tree.body, "")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{path.name}:{node.lineno}: global {', '.join(node.names)}")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for dec in node.decorator_list:
                if _name(dec) in CACHE_DECORATORS:
                    found.append(f"{path.name}:{node.lineno}: @{_name(dec)} on {node.name}")
    return found


def test_resharding_keeps_no_module_level_state():
    files = sorted(RESHARDING.glob("*.py"))
    assert len(files) > 5
    found = [line for path in files for line in module_state(path)]
    assert not found, "module-level mutable state in rl_megatron/resharding/:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_global_cache(tmp_path):
    """The check itself: each way of keeping a global cache is caught, constants are not."""
    source = tmp_path / "caches.py"
    source.write_text(
        "import functools, weakref\n"
        "__all__ = ['f']\n"
        "KINDS = ('vllm', 'megatron')\n"
        "_PLANS = {}\n"
        "_SEEN: list[int] = []\n"
        "_BOUND = weakref.WeakKeyDictionary()\n"
        "class Table:\n"
        "    rows = {}\n"
        "@functools.lru_cache(maxsize=8)\n"
        "def f(x):\n"
        "    global _LAST\n"
        "    return x\n"
    )
    found = "\n".join(module_state(source))
    for name in ("_PLANS", "_SEEN", "_BOUND", "Table.rows", "global _LAST", "@lru_cache on f"):
        assert name in found, (name, found)
    assert "KINDS" not in found and "__all__" not in found


def engine_kind_mentions(path: Path) -> list[str]:
    """Where `path` names an engine kind: a "vllm" / "megatron" string, a read of
    `<config>.engine` (i.e. `rollout.engine`), or an engine class, module or target."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.strip().lower() in ENGINE_KINDS:
                found.append(f"line {line}: the string {node.value!r}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "engine"
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ):
            found.append(f"line {line}: reads {ast.unparse(node)}")
        names = []
        if isinstance(node, ast.Name | ast.Attribute):
            names.append(_name(node) or "")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names += [a.name for a in node.names] + [getattr(node, "module", None) or ""]
        for name in names:
            if re.search(r"vllm|megatron_?engine|engine_?target", name, re.IGNORECASE):
                found.append(f"line {line}: the name {name}")
    found += [
        f"line {i}: {line.strip()}"
        for i, line in enumerate(source.splitlines(), 1)
        if re.search(r"rollout\.engine\b(?! import)", line)  # the interface module is fine
    ]
    return found


def test_the_trainer_names_no_engine_kind():
    """The loop and everything it is built from (trainer/build.py included) reach an engine
    through `rollout/engines.py` and the `RolloutEngine` interface only."""
    files = sorted((PACKAGE / "trainer").glob("*.py"))
    assert PPO_TRAINER in files and PACKAGE / "trainer" / "build.py" in files
    found = [f"{path.name}: {line}" for path in files for line in engine_kind_mentions(path)]
    assert not found, "rl_megatron/trainer/ names an engine kind:\n" + "\n".join(found)


def rollout_imports(path: Path) -> list[str]:
    """Imports of `rl_megatron.rollout` (any module of it, lazy ones included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        if any(m == "rl_megatron.rollout" or m.startswith("rl_megatron.rollout.") for m in modules):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_resharding_imports_no_engine():
    """Plans, the executor and the copy program know no engine: each engine's target and
    parameter layout live in its own package (`rollout/vllm/target.py`, `specs.py`)."""
    found = [line for path in sorted(RESHARDING.glob("*.py")) for line in rollout_imports(path)]
    assert not found, "rl_megatron/resharding/ imports from rollout/:\n" + "\n".join(found)


def test_the_import_check_sees_lazy_and_plain_imports(tmp_path):
    source = tmp_path / "plan.py"
    source.write_text(
        "import rl_megatron.rollout.vllm.specs\n"
        "def f():\n"
        "    from rl_megatron.rollout.vllm import target\n"
        "    from rl_megatron.resharding import shards\n"
    )
    found = rollout_imports(source)
    assert [line.split(":")[1] for line in found] == ["1", "3"], found


def test_the_check_sees_an_engine_branch(tmp_path):
    source = tmp_path / "loop.py"
    source.write_text(
        "from rl_megatron.resharding.targets import VllmEngineTarget\n"
        "class T:\n"
        "    def sync(self):\n"
        "        r = self.config.rollout\n"
        "        if r.engine == 'megatron':\n"
        "            return self.engine.sync_from(self.actor, 0)\n"
    )
    found = "\n".join(engine_kind_mentions(source))
    for what in ("VllmEngineTarget", "reads r.engine", "the string 'megatron'"):
        assert what in found, (what, found)
    assert "self.engine" not in found
