"""The headline table RESULTS.md opens with: one row per target, from benchmark JSON files.

    .venv/bin/python benchmarks/headline.py benchmarks/results/rollout_ab_h200.json [...]

Prints markdown: per target the measured median ratio, its spread (min–max over the
interleaved A/B rounds, `ab.py`), the target, whether it is met, and the command and JSON
that measured it. Met follows issue 21's rule (`ab.meets`): the median on the right side of
the target AND the worst round on the right side of the worst-round bound; a number without
a spread (one timed run, not an A/B) is never met.

Where rows come from: a JSON that lists `"targets"` (records made by `ab.target_record`, as
`rollout_ab.py` writes) needs nothing more. Control rows (no target, verdict "control")
give the spread of the same work in both slots: `rollout_ab.py`'s `*_aa` modes, and
`trainer_bench.py --interleave-update`'s plain loop against itself. A benchmark whose JSON
says its targets some other way gets a function in `EXTRACTORS` under its `"benchmark"`
name (`trainer_step`: the actor update against the plain loops that bracket it;
`reshard`: the sync against the flat copy). A run's `metrics.jsonl` gives the row of the
step after an evaluation.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ab import meets  # benchmarks/, this script's directory

Row = dict[str, Any]


def rows_from_targets(data: dict, path: Path) -> list[Row]:
    """The JSON's own "targets" list; its "json" field defaults to the file read. A
    rollout A/B's control modes (`*_aa`: the standalone engine in both slots) follow as
    control rows."""
    rows = [{k: v for k, v in t.items() if v != ""} | {"json": str(path)} for t in data["targets"]]
    for batch, modes in (data.get("batches") or {}).items():
        for mode, ab in modes.items():
            if mode.endswith("_aa") and ab.get("ratios"):
                name = f"control, the standalone engine in both slots: {mode}, batch {batch}"
                rows.append(control_row(name, ab["ratios"], json=str(path)))
    return rows


def _spread(name: str, ratios: list[float]) -> Row:
    """A row's name and its per-round ratios' median, min, max and count."""
    return {
        "name": name,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "repeats": len(ratios),
    }


def control_row(name: str, ratios: list[float], **extra) -> Row:
    """A row without a target: the same work in both slots of an A/B, whose spread is the
    host's alone (the floor under the spread of the rows with targets)."""
    return _spread(name, ratios) | {"target": None, "control": True, **extra}


def _row(name: str, ratios: list[float], target: float, higher_is_better: bool, **extra) -> Row:
    """A target row from per-round ratios (worst round bound = the target)."""
    return _spread(name, ratios) | {
        "target": target,
        "worst_target": target,
        "higher_is_better": higher_is_better,
        **extra,
    }


# Issue 19 (MoE) and issue 8 (dense): the actor update ≥ 0.9× a plain megatron-core loop.
UPDATE_VS_PLAIN_TARGET = 0.9


def rows_from_trainer_step(data: dict, path: Path) -> list[Row]:
    """trainer_bench.py: per algorithm, the actor update's tokens/s of each timed step over
    each plain loop's (the one before the trainers and the one after them), so the spread
    holds both the steps' and the host's drift. Not an interleaved A/B: the plain loops
    bracket the trainer's steps instead."""
    plain = [
        data[k]["tokens_per_s_per_gpu"] for k in ("plain_loop", "plain_loop_after") if k in data
    ]
    world = data.get("environment", {}).get("world_size", 1)
    rows = []
    for res in data.get("trainer", {}).values():  # `--interleave-update`: an A/B of its own
        if "update_vs_plain_ab" in res:
            ab = res["update_vs_plain_ab"]
            rows.append(ab["target"] | {"json": str(path)})
            if "control_plain_vs_plain" in ab:
                rows.append(
                    control_row(
                        "control, the plain loop in both slots (same rounds)",
                        ab["control_plain_vs_plain"]["ratios"],
                        json=str(path),
                    )
                )
    for algorithm, res in data.get("trainer", {}).items():
        steps = [s for s in res.get("timed_steps") or [] if s.get("timing_s/update_actor")]
        if not steps or not plain:
            continue
        model = res.get("config", {}).get("model", {})
        experts = model.get("num_experts") or 0
        shape = f"{model.get('num_layers')}L h{model.get('hidden_size')}"
        if experts:
            shape += f", {experts} experts top-{model.get('moe_router_topk')}"
        rates = [s["bench/actor_update_tokens"] / s["timing_s/update_actor"] / world for s in steps]
        rows.append(
            _row(
                f"{algorithm} actor update ÷ plain megatron-core loop ({shape})",
                [r / p for r in rates for p in plain],
                UPDATE_VS_PLAIN_TARGET,
                True,
                command=data.get("environment", {}).get("command", ""),
                json=str(path),
            )
        )
    return rows


# Issue 21: the step after an evaluation within 10 % of the median step.
AFTER_EVAL_TARGET = 1.10


def rows_from_metrics(lines: list[dict], path: Path) -> list[Row]:
    """A run's metrics.jsonl: each step right after an evaluation (the step before it
    reports `val/reward_mean`) generates in how many times the median step's time. The
    first step (graph capture, compilation) is left out of the median. (Not by
    `timing_s/evaluate`: records written before issue 36 carry it one step late.)"""
    generate = {r["step"]: r["timing_s/generate"] for r in lines if "timing_s/generate" in r}
    evaluated = [r["step"] for r in lines if "val/reward_mean" in r]
    after_eval = [step + 1 for step in evaluated if step + 1 in generate]
    later = [t for step, t in generate.items() if step > min(generate, default=0)]
    if not after_eval or not later:
        return []
    median = statistics.median(later)
    return [
        _row(
            "generate: the step after an evaluation ÷ the median step",
            [generate[step] / median for step in after_eval],
            AFTER_EVAL_TARGET,
            False,
            json=str(path),
        )
    ]


# Issues 19 and 21: a weight sync within 3× of a device copy of the same bytes.
SYNC_VS_COPY_TARGET = 3.0


def rows_from_reshard(data: dict, path: Path) -> list[Row]:
    """reshard_bench.py: per (layout, t_g) row timed against the flat copy as interleaved
    rounds (`floor.sync_vs_copy`, one rank), the sync ÷ the copy of each round."""
    rows = []
    for r in data.get("rows", []):
        ab = r.get("floor", {}).get("sync_vs_copy")
        if not ab:
            continue
        gb = r["target_bytes"] / 1e9
        layout = ",".join(str(r[k]) for k in ("t", "p", "d", "ep", "etp"))
        rows.append(
            _row(
                f"weight sync ÷ device copy, {data.get('model')} ({gb:.2f} GB), "
                f"layout {layout} → t_g {r['t_g']}",
                ab["ratios"],
                SYNC_VS_COPY_TARGET,
                False,
                json=str(path),
            )
        )
    return rows


# benchmark name → rows; benchmarks that write "targets" need no entry.
EXTRACTORS: dict[str, Callable[[dict, Path], list[Row]]] = {
    "trainer_step": rows_from_trainer_step,
    "reshard": rows_from_reshard,
}


def load_rows(path: Path) -> tuple[list[Row], str | None]:
    """Rows of one JSON file (or a run's metrics `.jsonl`), and a note when it has none."""
    if path.suffix == ".jsonl":
        rows = rows_from_metrics([json.loads(x) for x in path.read_text().splitlines()], path)
        return rows, None if rows else f"{path}: no step after an evaluation"
    data = json.loads(path.read_text())
    name = data.get("benchmark", "?")
    if name in EXTRACTORS:
        rows = EXTRACTORS[name](data, path)
        return rows, None if rows else f"{path}: no row of {name!r} has a target"
    if "targets" in data:
        return rows_from_targets(data, path), None
    return [], f"{path}: benchmark {name!r} lists no targets (see EXTRACTORS in headline.py)"


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def verdict(row: Row) -> str:
    if row.get("control"):
        return "— (control)"
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
        target = (
            "—"
            if r.get("control")
            else f"{sign} {r['target']}× (worst round {sign} {r['worst_target']}×)"
        )
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
