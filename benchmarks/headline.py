"""The headline table RESULTS.md opens with: one row per target, from benchmark JSON files.

    .venv/bin/python benchmarks/headline.py benchmarks/results/rollout_ab_h200.json [...]

Prints markdown: per target the measured median ratio, its spread (min–max over the
interleaved A/B rounds, `ab.py`), the target, whether it is met, and the command and JSON
that measured it. Met follows issue 21's rule (`ab.meets`): the median on the right side of
the target AND the worst round on the right side of the worst-round bound; a number without
a spread (one timed run, not an A/B) is never met.

Where rows come from: a JSON that lists `"targets"` (records made by `ab.target_record`, as
`rollout_ab.py` writes) needs nothing more. A benchmark whose JSON says its targets some
other way gets a function in `EXTRACTORS` under its `"benchmark"` name (the hooks for
`reshard` and `trainer_step` are there, empty until those benchmarks time A/B rounds).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ab import meets  # benchmarks/, this script's directory

Row = dict[str, Any]


def rows_from_targets(data: dict, path: Path) -> list[Row]:
    """The JSON's own "targets" list; its "json" field defaults to the file read."""
    return [{"json": str(path)} | {k: v for k, v in t.items() if v != ""} for t in data["targets"]]


# benchmark name → rows; benchmarks that write "targets" need no entry.
EXTRACTORS: dict[str, Callable[[dict, Path], list[Row]]] = {
    # "reshard": reshard_bench.py (sync ÷ copy floor, ≤ 3×; higher_is_better=False)
    # "trainer_step": trainer_bench.py (trainer ÷ plain megatron-core loop)
}


def load_rows(path: Path) -> tuple[list[Row], str | None]:
    """Rows of one JSON file, and a note when it has none."""
    data = json.loads(path.read_text())
    name = data.get("benchmark", "?")
    if name in EXTRACTORS:
        return EXTRACTORS[name](data, path), None
    if "targets" in data:
        return rows_from_targets(data, path), None
    return [], f"{path}: benchmark {name!r} lists no targets (see EXTRACTORS in headline.py)"


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def verdict(row: Row) -> str:
    lo, hi = row.get("ratio_min"), row.get("ratio_max")
    if lo is None or hi is None:
        return "no (no spread: not an A/B)"
    up = row.get("higher_is_better", True)
    ok = meets(row["ratio_median"], lo, hi, row["target"], row["worst_target"], up)
    return "**yes**" if ok else "**no**"


def table(rows: list[Row]) -> str:
    """Markdown, one line per target row."""
    lines = [
        "| target | measured (median) | spread (min–max) | target | met? | command | JSON |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sign = "≥" if r.get("higher_is_better", True) else "≤"
        spread = (
            "—"
            if r.get("ratio_min") is None
            else f"{fmt(r['ratio_min'])}–{fmt(r['ratio_max'])} ({r.get('repeats', '?')} rounds)"
        )
        target = f"{sign} {r['target']}× (worst round {sign} {r['worst_target']}×)"
        command = f"`{r['command']}`" if r.get("command") else "—"
        lines.append(
            f"| {r['name']} | {fmt(r['ratio_median'])}× | {spread} | {target} | {verdict(r)} "
            f"| {command} | `{r['json']}` |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    rows: list[Row] = []
    for arg in argv:
        got, note = load_rows(Path(arg))
        rows += got
        if note:
            print(note, file=sys.stderr)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
