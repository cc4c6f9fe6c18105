"""benchmarks/headline.py: one markdown row per target, the verdict by the A/B rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import headline  # noqa: E402
from ab import ABResult, target_record  # noqa: E402


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def rollout_json(tmp_path: Path) -> Path:
    good = ABResult(a_s=[1.0] * 3, b_s=[1.0, 0.99, 1.02], a_first=[True, False, True])
    # Median 0.99 >= 0.98, but the worst round 0.94 < 0.95: not met.
    straddles = ABResult(a_s=[1.0] * 3, b_s=[0.99, 0.94, 1.1], a_first=[True, False, True])
    targets = [
        target_record("greedy, batch 64", good, 0.98, 0.95, command="torchrun x.py"),
        target_record("sampled, batch 64", straddles, 0.98, 0.95, command="torchrun x.py"),
    ]
    # The record claims "met" wrongly: the table recomputes it from the numbers.
    targets[1]["met"] = True
    return write(tmp_path / "ab.json", {"benchmark": "rollout_ab", "targets": targets})


def test_one_row_per_target_with_median_spread_and_verdict(tmp_path):
    path = rollout_json(tmp_path)
    rows, note = headline.load_rows(path)
    assert note is None and [r["name"] for r in rows] == ["greedy, batch 64", "sampled, batch 64"]
    assert rows[0]["json"] == str(path)  # no --out-json in the record: the file read
    lines = headline.table(rows).splitlines()
    assert len(lines) == 4
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:5] == [
        "greedy, batch 64",
        "1.000×",
        "0.990–1.020 (3 rounds)",
        "≥ 0.98× (worst round ≥ 0.95×)",
        "**yes**",
    ]
    assert cells[5] == "`torchrun x.py`" and cells[6] == f"`{path}`"
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[1:5] == [
        "0.990×",
        "0.940–1.100 (3 rounds)",
        "≥ 0.98× (worst round ≥ 0.95×)",
        "**no**",
    ]


def test_at_most_targets_and_rows_without_spread():
    rows = [
        {
            "name": "reshard ÷ copy floor",
            "ratio_median": 2.0,
            "ratio_min": 1.9,
            "ratio_max": 2.5,
            "target": 3.0,
            "worst_target": 3.5,
            "higher_is_better": False,
            "repeats": 10,
            "json": "r.json",
        },
        {
            "name": "single run",
            "ratio_median": 1.2,
            "target": 0.98,
            "worst_target": 0.95,
            "json": "s.json",
        },
    ]
    lines = headline.table(rows).splitlines()
    assert "≤ 3.0× (worst round ≤ 3.5×) | **yes**" in lines[2]
    assert "| — | ≥ 0.98× (worst round ≥ 0.95×) | no (no spread: not an A/B) |" in lines[3]


def test_files_without_targets_are_noted_and_extractors_are_used(tmp_path, monkeypatch, capsys):
    plain = write(tmp_path / "convert.json", {"benchmark": "convert", "rows": []})
    assert headline.load_rows(plain)[0] == []
    assert "lists no targets" in headline.load_rows(plain)[1]
    empty = write(tmp_path / "reshard.json", {"benchmark": "reshard", "rows": [{"floor": {}}]})
    assert headline.load_rows(empty) == ([], f"{empty}: no row of 'reshard' has a target")
    row = {"name": "from hook", "ratio_median": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
           "target": 0.98, "worst_target": 0.95, "json": "x"}  # fmt: skip
    monkeypatch.setitem(headline.EXTRACTORS, "convert", lambda data, path: [row])
    assert headline.main([str(plain), str(rollout_json(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 5  # header, rule, the hook's row, two rollout rows
    assert "| from hook | 1.000× |" in out


def test_actor_update_against_the_plain_loops_that_bracket_it(tmp_path):
    steps = [  # 1000 and 800 tokens/s
        {"timing_s/update_actor": 2.0, "bench/actor_update_tokens": 2000.0},
        {"timing_s/update_actor": 2.5, "bench/actor_update_tokens": 2000.0},
    ]
    model = {"num_layers": 2, "hidden_size": 64, "num_experts": 4, "moe_router_topk": 2}
    data = {
        "benchmark": "trainer_step",
        "environment": {"world_size": 2, "command": "torchrun t.py"},
        "plain_loop": {"tokens_per_s_per_gpu": 500.0},
        "plain_loop_after": {"tokens_per_s_per_gpu": 400.0},
        "trainer": {"grpo": {"timed_steps": steps, "config": {"model": model}}},
    }
    (row,) = headline.load_rows(write(tmp_path / "t.json", data))[0]
    # Per GPU: 500 and 400 tokens/s, over 500 and 400: 1.0, 0.8, 1.25, 1.0.
    assert (row["ratio_min"], row["ratio_max"], row["repeats"]) == (0.8, 1.25, 4)
    assert row["ratio_median"] == 1.0 and row["target"] == 0.9 and row["higher_is_better"]
    assert "4 experts top-2" in row["name"] and row["command"] == "torchrun t.py"


def test_the_interleaved_update_against_the_plain_loop_comes_first(tmp_path):
    target = {"name": "grpo actor update ÷ plain, interleaved", "ratio_median": 0.93,
              "ratio_min": 0.91, "ratio_max": 0.95, "repeats": 8, "target": 0.9,
              "worst_target": 0.9, "higher_is_better": True, "met": True}  # fmt: skip
    data = {
        "benchmark": "trainer_step",
        "trainer": {"grpo": {"update_vs_plain_ab": {"target": target}}},
    }
    rows, note = headline.load_rows(write(tmp_path / "t.json", data))
    assert note is None and rows == [target | {"json": str(tmp_path / "t.json")}]


def test_controls_follow_their_ab_without_a_target(tmp_path):
    """The same work in both slots: a row with its median and spread, never a verdict."""
    target = {"name": "update ÷ plain", "ratio_median": 0.93, "ratio_min": 0.77,
              "ratio_max": 1.17, "repeats": 3, "target": 0.9, "worst_target": 0.9,
              "higher_is_better": True}  # fmt: skip
    update = {"target": target, "control_plain_vs_plain": {"ratios": [1.0, 0.8, 1.3]}}
    trainer = {"benchmark": "trainer_step", "trainer": {"grpo": {"update_vs_plain_ab": update}}}
    rollout = json.loads(rollout_json(tmp_path).read_text())
    rollout["batches"] = {
        "64": {"greedy": {"ratios": [0.5]}, "greedy_aa": {"ratios": [0.9, 1.5, 1.0, 0.8]}}
    }
    rows = headline.load_rows(write(tmp_path / "t.json", trainer))[0]
    rows += headline.load_rows(write(tmp_path / "r.json", rollout))[0]
    controls = [r for r in rows if r.get("control")]
    assert [r["name"] for r in rows if not r.get("control")] == [
        "update ÷ plain", "greedy, batch 64", "sampled, batch 64"
    ]  # fmt: skip
    assert [
        (r["ratio_median"], r["ratio_min"], r["ratio_max"], r["repeats"]) for r in controls
    ] == [
        (1.0, 0.8, 1.3, 3),
        (0.95, 0.8, 1.5, 4),
    ]
    assert "greedy_aa, batch 64" in controls[1]["name"]
    lines = headline.table(rows).splitlines()[2:]
    assert [line.split(" | ")[4] for line in lines] == [
        "**no**", "— (control)", "**yes**", "**no**", "— (control)"
    ]  # fmt: skip
    assert lines[1].split(" | ")[3] == "—"  # no target


def test_the_step_after_an_evaluation_against_the_median_step(tmp_path):
    generate = [40.0, 1.0, 1.1, 1.3, 0.9, 1.0]  # step 1 captures; steps 4 and 6 follow evals
    lines = [{"step": i + 1, "timing_s/generate": t} for i, t in enumerate(generate)]
    for step in (3, 5, 6):  # evaluations, in their own rows; no step follows step 6's
        lines[step - 1].update({"val/reward_mean": 0.5, "timing_s/evaluate": 0.8})
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (row,) = headline.load_rows(path)[0]
    # Median of steps 2-6: 1.0; after evaluations 1.3 and 1.0.
    assert (row["ratio_min"], row["ratio_max"]) == (1.0, 1.3)
    assert row["target"] == 1.1 and not row["higher_is_better"]
    assert "**no**" in headline.table([row])


def test_the_sync_against_the_copy_from_reshard_bench(tmp_path):
    """reshard_bench.py's interleaved rounds (copy in A, sync in B): a round's ratio is
    sync ÷ copy, lower is better, met when the median and the worst round are ≤ 3×; a row
    without the rounds (several ranks: the floor is an all-gather) gives none."""
    ab = ABResult(a_s=[1.0, 2.0, 1.0], b_s=[2.0, 5.0, 3.5], a_first=[True, False, True])
    row = {"t": 1, "p": 1, "d": 1, "ep": 1, "etp": 1, "t_g": 1, "target_bytes": 3.9e9}
    data = {
        "benchmark": "reshard",
        "model": "qwen3-moe-2b",
        "rows": [row | {"floor": {"sync_vs_copy": ab.as_dict()}}, row | {"floor": {}}],
    }
    (got,), note = headline.load_rows(write(tmp_path / "r.json", data))
    assert note is None and "qwen3-moe-2b (3.90 GB), layout 1,1,1,1,1 → t_g 1" in got["name"]
    assert (got["ratio_median"], got["ratio_min"], got["ratio_max"]) == (2.5, 2.0, 3.5)
    assert got["target"] == 3.0 and not got["higher_is_better"]
    assert headline.verdict(got) == "**no**"  # the worst round, 3.5×, is over 3×
    ab.b_s[2] = 2.9
    (got,), _ = headline.load_rows(write(tmp_path / "r.json", data | {"rows": [
        row | {"floor": {"sync_vs_copy": ab.as_dict()}}]}))  # fmt: skip
    assert headline.verdict(got) == "**yes**"
