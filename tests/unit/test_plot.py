"""`python -m rl_megatron.plot`: curves from fixture run folders written by MetricsTracker."""

from __future__ import annotations

import subprocess
import sys

import pytest
from PIL import Image

from rl_megatron.plot import PANELS, build_figure, load_run, main, moving_average
from rl_megatron.utils.metrics import MetricsTracker


def _run_folder(path, steps=6, reward_scale=1.0, resumed_at=None):
    """A run folder as the trainer leaves it (metrics.jsonl written by MetricsTracker)."""
    tracker = MetricsTracker(path, rank=0)
    for step in range(1, steps + 1):
        metrics = {
            "reward/mean": reward_scale * step / 10,
            "rollout/response_length_mean": 8.0 - step / 10,
            "actor/entropy": 4.0 - step / 10,
            "actor/ppo_kl": 0.001 * step,
            "actor/pg_clipfrac": 0.01,
            "actor/grad_norm": float("nan") if step == 2 else 0.5,  # written as "nan"
            "perf/tokens_per_s_per_device": 300.0 + step,
            "timing_s/generate": 0.3,
            "timing_s/update_actor": 0.2,
            "timing_s/step": 0.6,
        }
        if step % 3 == 0:
            metrics["val/reward_mean"] = step / 5
        tracker.log(step, metrics)
    if resumed_at is not None:  # a resumed run logs its steps from the checkpoint again
        for step in range(resumed_at, steps + 1):
            tracker.log(step, {"reward/mean": -1.0, "timing_s/generate": 0.3})
    tracker.close()
    return path


def _lines(ax):
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


def test_panels_draw_the_logged_values(tmp_path):
    run = load_run(_run_folder(tmp_path / "a"))
    fig = build_figure([run])
    axes = fig.axes
    assert [ax.get_title() for ax in axes[: len(PANELS)]] == [p.title for p in PANELS]
    reward = _lines(axes[0])
    assert reward[0] == ([1, 2, 3, 4, 5, 6], pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
    assert reward[1] == ([3, 6], pytest.approx([0.6, 1.2]))  # validation, as dots
    kl = axes[3]  # no reference in this run: the PPO step's KL is drawn
    assert _lines(kl)[0][1] == pytest.approx([0.001 * s for s in range(1, 7)])
    grad = _lines(axes[5])[0]
    assert grad[0] == [1, 3, 4, 5, 6]  # the non-finite step is left out
    phases = axes[len(PANELS)]
    assert phases.get_title() == "time per phase (s)"
    assert [t.get_text() for t in phases.get_legend().get_texts()] == ["generate", "update_actor"]


def test_resumed_steps_count_once_with_their_last_values(tmp_path):
    run = load_run(_run_folder(tmp_path / "a", steps=4, resumed_at=3))
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4]
    assert [r["reward/mean"] for r in run.rows] == pytest.approx([0.1, 0.2, -1.0, -1.0])


def test_smoothing_is_a_trailing_mean():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    assert moving_average([1, 2, 3], 1) == [1, 2, 3]


def test_cli_writes_png_of_several_runs(tmp_path, capsys):
    a = _run_folder(tmp_path / "x" / "tiny", steps=5)
    b = _run_folder(tmp_path / "y" / "tiny", steps=3, reward_scale=2.0)
    out = tmp_path / "pics" / "compare.png"
    assert main([str(a), str(b / "metrics.jsonl"), "--out", str(out), "--smooth", "2"]) == 0
    assert f"wrote {out} (x/tiny: 5 steps, y/tiny: 3 steps)" in capsys.readouterr().out
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 1000 and image.size[1] > 400
        assert len(set(image.convert("L").getdata())) > 20  # not a blank canvas


def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rl_megatron.plot", str(tmp_path / "nope"), "--out", "x.png"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"python -m rl_megatron.plot: error: {tmp_path / 'nope'}: no metrics.jsonl "
        "(give a run folder, e.g. runs/tiny_cpu)"
    ]


def test_a_line_being_written_is_left_out_a_broken_one_is_counted(tmp_path):
    folder = _run_folder(tmp_path / "a", steps=3)
    metrics = folder / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 4, "reward/me')
    run = load_run(folder)
    assert [r["step"] for r in run.rows] == [1, 2, 3] and run.skipped == 0
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    run = load_run(folder)
    assert [r["step"] for r in run.rows] == [1, 2, 3]
    assert (run.skipped, run.first_skipped) == (2, "line 2: not JSON")  # and the last, ended


def _metrics(folder, *lines: bytes):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return folder


GOOD = [b'{"step": 1, "reward/mean": 0.5}', b'{"step": 3, "reward/mean": 0.7}']


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b'{"step": null, "reward/mean": 0.6}', '"step" is null, not an integer'),
        (b'{"step": "x", "reward/mean": 0.6}', '"step" is "x", not an integer'),
        (b'{"step": Infinity, "reward/mean": 0.6}', '"step" is Infinity, not an integer'),
        (b'{"step": NaN, "reward/mean": 0.6}', '"step" is NaN, not an integer'),
        (b'{"step": 1.5, "reward/mean": 0.6}', '"step" is 1.5, not an integer'),
        (b'{"step": true, "reward/mean": 0.6}', '"step" is true, not an integer'),
        (b'{"reward/mean": 0.6}', 'no "step"'),
        (b"[2, 0.6]", "a JSON list, not an object"),
        (b'{"step": 2, "reward/mean": 0.6\xff}', "not UTF-8"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_bad_lines_are_skipped_and_counted(tmp_path, line, why):
    folder = _metrics(tmp_path / "r", GOOD[0], line, line, GOOD[1])
    run = load_run(folder)
    assert [r["step"] for r in run.rows] == [1, 3]
    assert [r["reward/mean"] for r in run.rows] == pytest.approx([0.5, 0.7])
    assert (run.skipped, run.first_skipped, run.nonfinite) == (2, f"line 2: {why}", 0)


def test_cli_warns_once_per_file_and_draws(tmp_path, capsys):
    """As users see it: one warning line for the file, the plot written all the same."""
    folder = _metrics(tmp_path / "r", GOOD[0], b'{"step": null}', b"\xff", b'{"step": 2, '
                      b'"reward/mean": Infinity}', GOOD[1])  # fmt: skip
    out = tmp_path / "c.png"
    assert main([str(folder), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"python -m rl_megatron.plot: warning: {folder / 'metrics.jsonl'}: skipped 2 bad lines "
        '(first: line 2: "step" is null, not an integer); 1 non-finite value not drawn'
    ]
    assert captured.out == f"wrote {out} (r: 3 steps)\n" and out.stat().st_size > 10_000


def test_non_finite_values_are_counted_not_drawn(tmp_path, capsys):
    folder = _metrics(
        tmp_path / "r",
        b'{"step": 1, "reward/mean": Infinity, "actor/entropy": 2.0}',
        b'{"step": 2, "reward/mean": 0.5, "actor/entropy": "nan"}',
        b'{"step": 3, "reward/mean": 0.7, "actor/entropy": -Infinity}',
        b'{"step": 4, "reward/mean": "-inf", "actor/entropy": 1.0}',
    )
    run = load_run(folder)
    assert (run.skipped, run.nonfinite) == (0, 4)
    fig = build_figure([run])
    assert _lines(fig.axes[0])[0] == ([2, 3], pytest.approx([0.5, 0.7]))
    assert _lines(fig.axes[2])[0] == ([1, 4], pytest.approx([2.0, 1.0]))
    assert main([str(folder), "--out", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"python -m rl_megatron.plot: warning: {folder / 'metrics.jsonl'}: 4 non-finite values "
        "not drawn"
    ]


def test_no_readable_step_is_one_line(tmp_path, capsys):
    folder = _metrics(tmp_path / "r", b'{"step": null}', b"\xff\xfe")
    assert main([str(folder), "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"python -m rl_megatron.plot: error: {folder / 'metrics.jsonl'}: no steps logged yet "
        '(skipped 2 bad lines (first: line 1: "step" is null, not an integer))'
    ]
    assert not (tmp_path / "c.png").exists()


def test_unknown_format_lists_the_supported_ones(tmp_path):
    folder = _run_folder(tmp_path / "a", steps=2)
    out = tmp_path / "c.xyz"
    result = subprocess.run(
        [sys.executable, "-m", "rl_megatron.plot", str(folder), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    prefix = (
        f"python -m rl_megatron.plot: error: --out: {out}: unknown image format .xyz (supported: "
    )
    assert line.startswith(prefix) and line.endswith(")")
    listed = line.removeprefix(prefix)[:-1].split(", ")
    assert {".png", ".pdf", ".svg", ".jpg"} <= set(listed) and ".xyz" not in listed
    assert listed == sorted(listed)
    assert not out.exists()
    for fmt in (".svg", ".PDF"):  # listed ones are written (the extension's case aside)
        assert main([str(folder), "--out", str(tmp_path / f"c{fmt}")]) == 0, fmt
        assert (tmp_path / f"c{fmt}").stat().st_size > 1000


def test_out_a_directory_is_one_line(tmp_path, capsys):
    folder = _run_folder(tmp_path / "a", steps=2)
    out = tmp_path / "pics.png"
    out.mkdir()
    assert main([str(folder), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"python -m rl_megatron.plot: error: --out: {out}: cannot write (Is a directory)"
    ]
