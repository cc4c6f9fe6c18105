"""No module of `rl_megatron` imports from a floor above its own (DESIGN.md §4, "Layers")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rl_megatron"


def floors() -> dict[str, int]:
    """Top-level unit (module or sub-package) → its floor, as DESIGN.md lists them."""
    text = (ROOT / "DESIGN.md").read_text()
    out = {}
    for number, names in re.findall(r"^\s+floor (\d+): (.+)$", text, flags=re.MULTILINE):
        for name in names.split():
            out[name] = int(number)
    return out


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def imported_units(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level unit) of every rl_megatron import, lazy ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "rl_megatron":
                continue
            if len(parts) > 1:
                out.append((node.lineno, parts[1]))
            else:  # from rl_megatron import cpu_compat
                out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "rl_megatron" and len(parts) > 1:
                    out.append((node.lineno, parts[1]))
    return out


def test_design_lists_every_unit_once():
    listed = floors()
    units = {unit_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set(listed), f"not on any floor in DESIGN.md: {sorted(units - set(listed))}"


def test_no_import_goes_up_a_floor():
    listed = floors()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(path)
        if unit == "__init__":
            continue
        for line, other in imported_units(ast.parse(path.read_text())):
            if other != unit and listed.get(other, 0) > listed[unit]:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line}: {unit} (floor {listed[unit]}) imports "
                    f"{other} (floor {listed[other]})"
                )
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)
