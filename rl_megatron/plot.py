"""Draw a run's training curves from its `metrics.jsonl`; several runs overlaid.

    python -m rl_megatron.plot runs/tiny_cpu --out curves.png
    python -m rl_megatron.plot runs/a runs/b --out compare.png --smooth 5

Panels: reward (training mean, and the validation mean as dots), response length, entropy,
KL (to the reference when there is one, else the PPO step's KL to the sampling policy),
clip fraction, grad norm (the critic's dashed), time per phase (stacked over the steps for
one run; for several, each run's mean step as one stacked bar) and tokens/s per device.
A panel whose metric no run logged says so. `--extra KEY` adds a panel for any other key.

A run folder or its `metrics.jsonl` may be given. A step logged twice (a run resumed from
an earlier checkpoint) counts once, with its last values. A line that cannot be read (not
UTF-8, not JSON, no integer step) is skipped; non-finite values (NaN, ±inf) are not drawn;
both are counted in one warning line per file. A last line without its newline is one being
written and is left out silently. Needs matplotlib (`pip install matplotlib`; `make test`
installs it); `--out`'s extension picks one of the formats it writes.
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
    skipped: int = 0  # lines of metrics.jsonl that could not be read
    first_skipped: str = ""  # the first of them: "line n: why"
    nonfinite: int = 0  # values NaN or ±inf in `rows` (kept, not drawn)

    def warning(self) -> str:
        """What was left out of the drawing, as one clause list ("" when nothing)."""
        parts = []
        if self.skipped:
            parts.append(f"skipped {_count(self.skipped, 'bad line')} "
                         f"(first: {self.first_skipped})")  # fmt: skip
        if self.nonfinite:
            parts.append(f"{_count(self.nonfinite, 'non-finite value')} not drawn")
        return "; ".join(parts)

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
    """A run folder (or its metrics.jsonl) as one row per step, values as floats; lines
    that cannot be read are skipped and counted."""
    path = Path(path)
    folder = path.parent if path.name == "metrics.jsonl" else path
    file = folder / "metrics.jsonl"
    if not file.is_file():
        raise PlotError(f"{path}: no metrics.jsonl (give a run folder, e.g. runs/tiny_cpu)")
    # Read here, not through utils.metrics (which imports torch): plotting needs no torch.
    # Bytes, split by hand: one undecodable line must not cost the others.
    lines = file.read_bytes().split(b"\n")
    being_written = lines.pop()  # b"" when the file ends with its newline
    run = Run(folder.name, [])
    by_step: dict[int, dict[str, float]] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parsed = _parse_line(line)
        if isinstance(parsed, str):
            run.skipped += 1
            run.first_skipped = run.first_skipped or f"line {lineno}: {parsed}"
            continue
        by_step[parsed[0]] = parsed[1]
    if being_written.strip():  # complete after all (a file written without a last newline)
        parsed = _parse_line(being_written)
        if not isinstance(parsed, str):
            by_step[parsed[0]] = parsed[1]
    if not by_step:
        what = f" ({run.warning()})" if run.skipped else ""
        raise PlotError(f"{file}: no steps logged yet{what}")
    run.rows = [by_step[s] for s in sorted(by_step)]
    run.nonfinite = sum(not math.isfinite(v) for row in run.rows for v in row.values())
    return run


def _parse_line(line: bytes) -> tuple[int, dict[str, float]] | str:
    """(step, {key: float}) of one metrics.jsonl line, or why it cannot be read."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except ValueError:
        return "not JSON"
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    if "step" not in row:
        return 'no "step"'
    step = row["step"]
    # Python's json reads Infinity and NaN; a float step must be a whole number.
    if (
        isinstance(step, bool)
        or not isinstance(step, (int, float))
        or not math.isfinite(step)
        or step != int(step)
    ):
        return f'"step" is {json.dumps(step)[:40]}, not an integer'
    values = {}
    for key, value in row.items():
        if isinstance(value, (int, float, str)):  # non-finite ones are written "nan", "inf"
            try:
                values[key] = float(value)
            except ValueError:  # a text field: not a metric
                continue
    values["step"] = float(int(step))
    return int(step), values


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


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
    check_format(out)
    fig = build_figure(runs, smooth, extra, title)
    import matplotlib.pyplot as plt

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=90)
    except OSError as exc:  # a directory in the way, no permission, disk full
        raise PlotError(f"--out: {out}: cannot write ({exc.strerror or exc})") from None
    except RuntimeError as exc:  # a format that needs a missing program (.pgf: xelatex)
        first = (str(exc).splitlines() or [""])[0]
        raise PlotError(f"--out: {out}: matplotlib cannot write it here ({first})") from None
    finally:
        plt.close(fig)
    return out


def check_format(out: Path) -> None:
    """Refuse an `--out` extension matplotlib cannot write (no extension: its default, PNG)."""
    suffix = out.suffix.lower().removeprefix(".")
    if not suffix:
        return
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise PlotError("plotting needs matplotlib (pip install matplotlib)") from None
    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    if suffix not in supported:
        raise PlotError(f"--out: {out}: unknown image format .{suffix} (supported: "
                        f"{', '.join('.' + s for s in supported)})")  # fmt: skip


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
        out = args.out or Path(args.runs[0]) / "curves.png"
        check_format(out)  # before reading the runs: a typo costs nothing
        runs = [load_run(path) for path in args.runs]
        names = [r.name for r in runs]
        for run, path in zip(runs, args.runs):
            if names.count(run.name) > 1:  # runs/a/x and runs/b/x: tell them apart
                folder = Path(path)
                folder = folder.parent if folder.name == "metrics.jsonl" else folder
                run.name = f"{folder.parent.name}/{folder.name}"
        plot_runs(runs, out, smooth=args.smooth, extra=tuple(args.extra), title=args.title)
    except PlotError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for run, path in zip(runs, args.runs):
        if run.warning():
            folder = Path(path)
            folder = folder.parent if folder.name == "metrics.jsonl" else folder
            print(f"{PROG}: warning: {folder / 'metrics.jsonl'}: {run.warning()}", file=sys.stderr)
    steps = ", ".join(f"{r.name}: {len(r.rows)} steps" for r in runs)
    print(f"wrote {out} ({steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
