"""`python -m rl_megatron.data.prepare`: datasets as users have them → our prompt files.

Small fixture files in each supported layout (GSM8K as JSONL and as a downloaded Hub folder
of Parquet files, MATH and MATH-500, DAPO-Math-17k's nested columns, a generic JSON array
with a column mapping) are converted; every output is read back by the trainer's own
reader (`load_prompt_dataset`, the answer required) and its answers scored by the rule
reward the tool names, so the format is the one training consumes. Malformed rows are one
line naming the file and line or row, exit code 2, and nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_megatron.data.datasets import load_prompt_dataset
from rl_megatron.data.prepare import main
from rl_megatron.rewards.rules import RULES

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "48 / 2 = 24\n#### 72"},
    {"question": "Weng earns $12 an hour.", "answer": "12 * 100 = 1200\n#### 1,200"},
]


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _read(out: Path, reward: str) -> list[dict]:
    """The output as the trainer reads it, each answer checked by the named rule reward."""
    data = load_prompt_dataset([out], "prompt", required_keys=("answer",))
    for sample in data:
        messages = sample["prompt"]
        assert messages[-1]["role"] == "user" and messages[-1]["content"]
        response = {"gsm8k": f"so #### {sample['answer']}", "boxed_math": None}[reward]
        if response is None:
            response = f"The answer is $\\boxed{{{sample['answer']}}}$."
        assert RULES[reward](response, sample) == 1.0, sample
        assert RULES[reward]("#### 99999 \\boxed{99999}", sample) == 0.0, sample
    return list(data)


def test_gsm8k_jsonl(tmp_path, capsys):
    src = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    out = tmp_path / "out" / "gsm8k.parquet"
    code, stdout, _ = _run(capsys, src, "--preset", "gsm8k", "--out", out)
    assert code == 0
    assert f"wrote 2 records to {out} (2 read)" in stdout
    assert "data.apply_chat_template=true reward.type=rule reward.function=gsm8k" in stdout
    rows = _read(out, "gsm8k")
    assert [r["answer"] for r in rows] == ["72", "1200"]
    assert rows[0]["prompt"] == [
        {
            "role": "user",
            "content": "Natalia sold 48 clips. How many? Let's think step by step and output "
            'the final answer after "####".',
        }
    ]
    assert rows[1]["data_source"] == "gsm8k" and rows[1]["index"] == 1


def test_hub_folder_split_and_system_prompt(tmp_path, capsys):
    """A downloaded Hub dataset: main/train-*.parquet and main/test-*.parquet."""
    folder = tmp_path / "gsm8k"
    _parquet(folder / "main" / "train-00000-of-00001.parquet", GSM8K_ROWS)
    _parquet(folder / "main" / "test-00000-of-00001.parquet", GSM8K_ROWS[:1])
    out = tmp_path / "test.jsonl"
    args = [folder, "--split", "test", "--preset", "gsm8k", "--system", "Be brief."]
    code, stdout, _ = _run(capsys, *args, "--out", out)
    assert code == 0 and "wrote 1 records" in stdout
    (row,) = _read(out, "gsm8k")
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    args = [folder, "--split", "validation", "--preset", "gsm8k"]
    code, _, err = _run(capsys, *args, "--out", tmp_path / "validation.jsonl")
    assert code == 2 and "no .jsonl, .json or .parquet files for split 'validation'" in err


def test_math_and_math500(tmp_path, capsys):
    math = _parquet(
        tmp_path / "math.parquet",
        [
            {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "1"},
            {"problem": "Two plus two?", "solution": "So \\boxed{4}", "level": "2"},
        ],
    )
    math500 = _jsonl(
        tmp_path / "math500.jsonl",
        [{"problem": "Root of 9?", "solution": "\\boxed{3}", "answer": "3", "subject": "x"}],
    )
    out = tmp_path / "math.jsonl"
    code, stdout, _ = _run(capsys, math, math500, "--preset", "math", "--keep", "level",
                           "--skip-invalid", "--out", out)  # fmt: skip
    # MATH-500 has no `level`: kept where present, a row without it is skipped and counted.
    assert code == 0 and "reward.function=boxed_math" in stdout
    assert "3 read, 1 skipped (first: " in stdout and "math500.jsonl:1: no column 'level'" in stdout
    rows = _read(out, "boxed_math")
    assert [(r["answer"], r["level"]) for r in rows] == [("\\frac{1}{2}", "1"), ("4", "2")]
    assert rows[0]["prompt"][0]["content"].endswith("final answer within \\boxed{}.")
    code, _, _ = _run(capsys, math500, "--preset", "math", "--out", tmp_path / "m500.jsonl")
    assert code == 0
    assert [r["answer"] for r in _read(tmp_path / "m500.jsonl", "boxed_math")] == ["3"]


def test_dapo_math_nested_columns(tmp_path, capsys):
    src = _parquet(
        tmp_path / "dapo-math-17k.parquet",
        [
            {
                "data_source": "math_dapo",
                "prompt": [{"content": DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX, "role": "user"}],
                "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
            }
        ],
    )
    out = tmp_path / "dapo.parquet"
    code, _, _ = _run(capsys, src, "--preset", "dapo_math", "--out", out)
    assert code == 0
    (row,) = _read(out, "boxed_math")
    assert row["answer"] == "2"
    # DAPO's "Answer: $Answer" wrapper gone, the boxed instruction in its place.
    assert row["prompt"][0]["content"] == (
        "What is 1+1? Let's think step by step and output the final answer within \\boxed{}."
    )


def test_generic_json_array_with_column_mapping(tmp_path, capsys):
    src = tmp_path / "mine.json"
    src.write_text(json.dumps([{"q": {"text": "Capital of France?"}, "sol": "\\boxed{Paris}"}]))
    out = tmp_path / "mine.jsonl"
    args = [src, "--prompt-column", "q.text", "--answer-column", "sol", "--answer-from", "boxed"]
    code, stdout, _ = _run(capsys, *args, "--instruction", "", "--out", out)
    assert code == 0 and "reward.function=boxed_math" in stdout
    (row,) = _read(out, "boxed_math")
    assert row["prompt"] == [{"role": "user", "content": "Capital of France?"}]
    assert row["answer"] == "Paris" and row["data_source"] == "mine"


@pytest.mark.parametrize(
    "write, expected",
    [
        (
            lambda d: _jsonl(d / "bad.jsonl", GSM8K_ROWS[:2]).open("a").write("{oops\n"),
            "bad.jsonl:3: malformed JSON",
        ),
        (
            lambda d: _jsonl(d / "bad.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "7"}]),
            "bad.jsonl:2: column 'answer' has no number after '####': '7'",
        ),
        (
            lambda d: _parquet(d / "bad.parquet", [GSM8K_ROWS[0], {**GSM8K_ROWS[1], "question": None}]),
            "bad.parquet row 1: column 'question' is NoneType, expected text or chat messages",
        ),
        (
            lambda d: _jsonl(d / "bad.jsonl", [{"prompt": "q", "answer": "#### 1"}]),
            "bad.jsonl:1: no column 'question' (columns: prompt, answer); set --prompt-column",
        ),
    ],
)  # fmt: skip
def test_malformed_row_is_one_line_naming_the_row(tmp_path, capsys, write, expected):
    write(tmp_path)
    src = next(p for p in tmp_path.iterdir() if p.name.startswith("bad"))
    out = tmp_path / "out.jsonl"
    code, stdout, err = _run(capsys, src, "--preset", "gsm8k", "--out", out)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and expected in err, err
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))


def test_skip_invalid_counts_rows(tmp_path, capsys):
    src = _jsonl(tmp_path / "g.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "none"}])
    code, stdout, _ = _run(capsys, src, "--preset", "gsm8k", "--skip-invalid", "--out",
                           tmp_path / "o.jsonl")  # fmt: skip
    assert code == 0
    assert "wrote 1 records" in stdout and "(2 read, 1 skipped (first: " in stdout
    assert "g.jsonl:2: column 'answer' has no number" in stdout


def test_refusals(tmp_path, capsys, monkeypatch):
    src = _jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    existing = _jsonl(tmp_path / "exists.jsonl", [{"keep": 1}])
    code, _, err = _run(capsys, src, "--preset", "gsm8k", "--out", existing)
    assert code == 2 and "exists (pass --force to overwrite)" in err
    assert existing.read_text() == '{"keep": 1}\n'
    code, _, err = _run(capsys, src, "--preset", "gsm8k", "--out", tmp_path / "o.csv")
    assert code == 2 and "must end in .jsonl or .parquet" in err
    code, _, err = _run(capsys, src, "--out", tmp_path / "o.jsonl")
    assert code == 2 and "--prompt-column: required without --preset" in err
    # A name that is no file: a `datasets` name, which needs the package.
    monkeypatch.setitem(sys.modules, "datasets", None)
    code, _, err = _run(capsys, "openai/gsm8k", "--split", "train", "--preset", "gsm8k",
                        "--out", tmp_path / "o.jsonl")  # fmt: skip
    assert code == 2 and "needs the `datasets` package" in err and err.count("\n") == 1


def test_module_entry_point(tmp_path):
    """As users run it: `python -m rl_megatron.data.prepare`, exit codes and stderr."""
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    result = subprocess.run(
        [sys.executable, "-m", "rl_megatron.data.prepare", str(bad), "--preset", "gsm8k",
         "--out", str(tmp_path / "o.jsonl")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"python -m rl_megatron.data.prepare: error: {bad}:1: no column 'answer' "
        "(columns: question); set --answer-column (--skip-invalid skips such rows)"
    ]


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0].removeprefix("python -m rl_megatron.data.prepare: error: ")


@pytest.mark.parametrize("spelling", ["same", "relative", "out_link", "in_link", "folder_file"])
def test_out_that_is_read_is_refused_even_with_force(tmp_path, capsys, monkeypatch, spelling):
    """The conversion would replace the dataset it reads: refused however the two are spelled."""
    src = _jsonl(tmp_path / "data" / "main" / "train.jsonl", GSM8K_ROWS)
    before = src.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(src)
    monkeypatch.chdir(tmp_path)
    given, out, what = {
        "same": (src, src, "the input"),
        "relative": (src, Path("data/main/../main/train.jsonl"), "the input"),
        "out_link": (src, link, "the input"),
        "in_link": (link, src, "the input"),
        "folder_file": (tmp_path / "data", Path("data/main/train.jsonl"),
                        f"{src}, a file of the input"),
    }[spelling]  # fmt: skip
    code, stdout, err = _run(capsys, given, "--split", "train", "--preset", "gsm8k", "--out", out,
                             "--force")  # fmt: skip
    assert code == 2 and stdout == ""
    assert _one_line(err) == (
        f"--out: {out} is {what} {given}, which writing there would replace (--force or not); "
        "choose another output file"
    )
    assert src.read_bytes() == before and link.is_symlink()
    assert not list(tmp_path.rglob(".*.partial"))


def test_out_in_input_folder_not_read_is_written(tmp_path, capsys):
    """A file of the input folder outside the chosen split is not read: --force replaces it."""
    train = _jsonl(tmp_path / "data" / "train.jsonl", GSM8K_ROWS)
    other = _jsonl(tmp_path / "data" / "test.jsonl", [{"old": 1}])
    code, _, err = _run(capsys, tmp_path / "data", "--split", "train", "--preset", "gsm8k",
                        "--out", other, "--force")  # fmt: skip
    assert code == 0, err
    assert [r["answer"] for r in _read(other, "gsm8k")] == ["72", "1200"]
    assert train.read_text() == "".join(json.dumps(r) + "\n" for r in GSM8K_ROWS)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_out_a_directory_is_one_line(tmp_path, capsys, force):
    src = _jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    out = tmp_path / "out.jsonl"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = _run(capsys, src, "--preset", "gsm8k", "--out", out, *force)
    assert code == 2
    assert _one_line(err) == f"--out: {out} is a directory; give a .jsonl or .parquet file path"
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (
        out / "keep.txt"
    ).read_text() == "mine"
    assert not list(tmp_path.glob(".*.partial"))


def test_keep_of_mixed_types_is_refused_for_parquet_kept_in_jsonl(tmp_path, capsys):
    rows = [
        {**GSM8K_ROWS[0], "meta": {"level": 1}},
        {**GSM8K_ROWS[1], "meta": {"level": 2}},
        {**GSM8K_ROWS[0], "meta": {"level": None}},
        {**GSM8K_ROWS[1], "meta": {"level": "hard"}},
        {**GSM8K_ROWS[0], "meta": {"level": 2.5}},
    ]
    src = _jsonl(tmp_path / "g.jsonl", rows)
    out = tmp_path / "o.parquet"
    code, stdout, err = _run(capsys, src, "--preset", "gsm8k", "--keep", "meta.level", "--out", out)
    assert code == 2 and stdout == ""
    assert _one_line(err) == (
        f"--keep meta.level: the column mixes types, which Parquet cannot hold: int (first at "
        f"{src}:1), str (first at {src}:4), float (first at {src}:5); write .jsonl instead, "
        "or make the column one type"
    )
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))
    # One numeric type after all (ints and floats, nulls): Parquet takes it as double.
    src2 = _jsonl(tmp_path / "g2.jsonl", rows[:3] + rows[4:])
    code, _, err = _run(capsys, src2, "--preset", "gsm8k", "--keep", "meta.level", "--out", out)
    assert code == 0, err
    assert pq.read_table(out).column("meta_level").to_pylist() == [1.0, 2.0, None, 2.5]
    # JSONL holds each value as it is.
    out = tmp_path / "o.jsonl"
    code, _, err = _run(capsys, src, "--preset", "gsm8k", "--keep", "meta.level", "--out", out)
    assert code == 0, err
    kept = [json.loads(line)["meta_level"] for line in out.read_text().splitlines()]
    assert kept == [1, 2, None, "hard", 2.5]


@pytest.mark.parametrize(
    ("split", "key", "use"),
    [("test", "val_files", "validate"), ("validation", "val_files", "validate"),
     ("train", "train_files", "train"), (None, "train_files", "train")],
)  # fmt: skip
def test_hint_names_val_files_for_a_held_out_split(tmp_path, capsys, split, key, use):
    folder = tmp_path / "gsm8k" / "main"
    _jsonl(folder / f"{split or 'all'}-00000.jsonl", GSM8K_ROWS)
    out = tmp_path / "o.jsonl"
    code, stdout, _ = _run(capsys, tmp_path / "gsm8k", *(["--split", split] if split else []),
                           "--preset", "gsm8k", "--out", out)  # fmt: skip
    assert code == 0
    assert stdout.splitlines()[1] == (
        f"{use} with: data.{key}=[{out}] data.apply_chat_template=true reward.type=rule "
        "reward.function=gsm8k"
    )
