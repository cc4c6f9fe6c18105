"""Draw a run's training curves from its `metrics.jsonl`; several runs overlaid.

    python -m rl_megatron.plot runs/tiny_cpu --out curves.png
    python -m rl_megatron.plot runs/a runs/b --out compare.png --smooth 5

Panels: reward (training mean, and the validation mean as dots), response length, entropy,
KL (to the reference when there is one, else the PPO step's KL to the sampling policy),
clip fraction, grad norm (the critic's dashed), time per phase (stacked over the steps for
one run; for several, each run's mean step as one stacked bar) and tokens/s per device.
A panel whose metric no run logged says so. `--extra KEY` adds a panel for any other key.

A run folder or its `metrics.jsonl` may be given. A step logged twice (a run resumed from
an earlier checkpoint) counts once, with its last values. Needs matplotlib
(`pip install matplotlib`; `make test` installs it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

PROG = "python -m rl_megatron.plot"


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # the first key a run has is drawn (older names, alternatives)
    dashed: tuple[str, ...] = ()  # drawn as well, dashed (critic beside actor)
    dots: tuple[str, ...] = ()  # drawn as well, as dots (sparse: validation)


PANELS = (
    Panel("reward", ("reward/mean",), dots=("val/reward_mean",)),
    Panel("response length (tokens)", ("rollout/response_length_mean",)),
    Panel("entropy", ("actor/entropy", "actor/entropy_rollout")),
    Panel("KL", ("actor/kl_to_ref", "actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
    Panel("clip fraction", ("actor/pg_clipfrac",)),
    Panel("grad norm", ("actor/grad_norm",), dashed=("critic/grad_norm",)),
    Panel("tokens/s per device", ("perf/tokens_per_s_per_device",)),
)
TIMING = "timing_s/"
TIMING_TOTAL = "timing_s/step"  # the whole step; the phases are drawn, not it


class PlotError(ValueError):
    """Bad input (no metrics, unreadable file); one line for the user."""


@dataclass
class Run:
    name: str
    rows: list[dict[str, float]]  # one per step, in step order

    def series(self, key: str, smooth: int = 1) -> tuple[list[int], list[float]]:
        """(steps, values) where the run logged `key` (finite values only), smoothed."""
        points = [(r["step"], r[key]) for r in self.rows if math.isfinite(r.get(key, math.nan))]
        steps = [int(s) for s, _ in points]
        return steps, moving_average([v for _, v in points], smooth)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first points average what exists)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def load_run(path: str | Path) -> Run:
    """A run folder (or its metrics.jsonl) as one row per step, values as floats."""
    path = Path(path)
    folder = path.parent if path.name == "metrics.jsonl" else path
    if not (folder / "metrics.jsonl").is_file():
        raise PlotError(f"{path}: no metrics.jsonl (give a run folder, e.g. runs/tiny_cpu)")
    # Read here, not through utils.metrics (which imports torch): plotting needs no torch.
    raw = []
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw.append(json.loads(line))
        except ValueError as exc:
            if lineno == len(lines):  # the last line of a run being written right now
                break
            raise PlotError(f"{folder / 'metrics.jsonl'}:{lineno}: not JSON ({exc})") from None
    by_step: dict[int, dict[str, float]] = {}
    for row in raw:
        if "step" not in row:
            continue
        values = {}
        for key, value in row.items():
            try:
                values[key] = float(value)  # non-finite values are written as "nan", "inf"
            except (TypeError, ValueError):
                continue
        by_step[int(row["step"])] = values
    if not by_step:
        raise PlotError(f"{folder / 'metrics.jsonl'}: no steps logged yet")
    return Run(folder.name, [by_step[s] for s in sorted(by_step)])


def phase_keys(runs: list[Run]) -> list[str]:
    """Every phase any run timed, by total time (largest first), `timing_s/step` left out."""
    totals: dict[str, float] = {}
    for run in runs:
        for row in run.rows:
            for key, value in row.items():
                if key.startswith(TIMING) and key != TIMING_TOTAL and math.isfinite(value):
                    totals[key] = totals.get(key, 0.0) + value
    return sorted(totals, key=lambda k: -totals[k])


def plot_runs(
    runs: list[Run], out: Path, smooth: int = 1, extra: tuple[str, ...] = (), title: str = ""
) -> Path:
    """Draw the panels for `runs` into `out` (PNG, or any format matplotlib knows by suffix)."""
    import matplotlib.pyplot as plt

    fig = build_figure(runs, smooth, extra, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def build_figure(runs: list[Run], smooth: int = 1, extra: tuple[str, ...] = (), title: str = ""):
    """The matplotlib figure of `runs`: one axes per panel, in `PANELS` order, then
    `extra`, then time per phase."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plotting needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = [*PANELS, *(Panel(key, (key,)) for key in extra)]
    count = len(panels) + 1  # + time per phase
    cols = 4
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    flat = list(axes.flat)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(flat, panels):
        _draw_panel(ax, panel, runs, colors, smooth)
    _draw_phases(flat[len(panels)], runs, colors)
    for ax in flat[count:]:
        ax.set_visible(False)
    if len(runs) > 1:
        handles = [plt.Line2D([], [], color=colors[i % len(colors)]) for i in range(len(runs))]
        fig.legend(handles, [r.name for r in runs], loc="upper center", ncol=min(len(runs), 6))
    if title:
        fig.suptitle(title, y=1.0 if len(runs) > 1 else 0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.95 if len(runs) > 1 or title else 1))
    return fig


def _draw_panel(ax, panel: Panel, runs: list[Run], colors: list[str], smooth: int) -> None:
    drawn = []
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        key = next((k for k in panel.keys if any(k in r for r in run.rows)), None)
        if key is not None:
            ax.plot(*run.series(key, smooth), color=color, lw=1.2)
            drawn.append(key)
        for dashed in panel.dashed:
            steps, values = run.series(dashed, smooth)
            if steps:
                ax.plot(steps, values, color=color, lw=1.0, ls="--")
                drawn.append(dashed)
        for dots in panel.dots:
            steps, values = run.series(dots)
            if steps:
                ax.plot(steps, values, color=color, ls=":", marker="o", ms=4)
                drawn.append(dots)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, f"not logged\n({panel.keys[0]})", ha="center", va="center",
                transform=ax.transAxes, fontsize=8, color="gray")  # fmt: skip
        return
    legend = sorted(set(drawn), key=drawn.index)
    if len(legend) > 1 or legend[0] != panel.keys[0]:
        ax.text(0.02, 0.98, "\n".join(_legend_line(k, panel) for k in legend),
                transform=ax.transAxes, va="top", fontsize=7, color="dimgray")  # fmt: skip


def _legend_line(key: str, panel: Panel) -> str:
    style = "dots: " if key in panel.dots else "dashed: " if key in panel.dashed else ""
    return style + key


def _draw_phases(ax, runs: list[Run], colors: list[str]) -> None:
    """Seconds per phase: stacked over the steps (one run) or as mean-step bars (several)."""
    import matplotlib.pyplot as plt

    phases = phase_keys(runs)
    ax.set_title("time per phase (s)", fontsize=10)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if not phases:
        ax.text(0.5, 0.5, "not logged\n(timing_s/*)", ha="center", va="center",
                transform=ax.transAxes, fontsize=8, color="gray")  # fmt: skip
        return
    cmap = plt.get_cmap("tab20")
    phase_colors = [cmap(i % 20) for i in range(len(phases))]
    labels = [p.removeprefix(TIMING) for p in phases]
    if len(runs) == 1:
        run = runs[0]
        steps = [int(r["step"]) for r in run.rows]
        stacks = [[_finite(r.get(p, 0.0)) for r in run.rows] for p in phases]
        ax.stackplot(steps, stacks, labels=labels, colors=phase_colors)
        ax.set_xlabel("step", fontsize=8)
    else:
        for i, run in enumerate(runs):
            left = 0.0
            for p, color in zip(phases, phase_colors):
                mean = sum(_finite(r.get(p, 0.0)) for r in run.rows) / len(run.rows)
                ax.barh(i, mean, left=left, color=color, label=p if i == 0 else None)
                left += mean
        ax.set_yticks(range(len(runs)), [r.name for r in runs], fontsize=7)
        for tick, i in zip(ax.get_yticklabels(), range(len(runs))):
            tick.set_color(colors[i % len(colors)])
        ax.set_xlabel("mean seconds per step", fontsize=8)
        ax.legend(labels, fontsize=6, loc="lower right")
        return
    ax.legend(fontsize=6, loc="upper left", ncol=2)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (or their metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="image to write (default RUN/curves.png)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window, steps")
    parser.add_argument("--extra", action="append", default=[], help="another metric to draw")
    parser.add_argument("--title", default="", help="figure title")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.smooth < 1:
            raise PlotError("--smooth: must be >= 1")
        runs = [load_run(path) for path in args.runs]
        names = [r.name for r in runs]
        for run, path in zip(runs, args.runs):
            if names.count(run.name) > 1:  # runs/a/x and runs/b/x: tell them apart
                folder = Path(path)
                folder = folder.parent if folder.name == "metrics.jsonl" else folder
                run.name = f"{folder.parent.name}/{folder.name}"
        out = args.out or Path(args.runs[0]) / "curves.png"
        plot_runs(runs, out, smooth=args.smooth, extra=tuple(args.extra), title=args.title)
    except PlotError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    steps = ", ".join(f"{r.name}: {len(r.rows)} steps" for r in runs)
    print(f"wrote {out} ({steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
