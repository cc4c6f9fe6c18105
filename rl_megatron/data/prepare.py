"""Turn an RL dataset as a user has it into the trainer's prompt file (JSONL or Parquet).

    python -m rl_megatron.data.prepare ~/gsm8k/main --split train --preset gsm8k \
        --out data/gsm8k_train.parquet
    python -m rl_megatron.data.prepare MATH-500/test.jsonl --preset math --out data/math500.jsonl
    python -m rl_megatron.data.prepare mine.parquet --prompt-column question \
        --answer-column solution --answer-from boxed --out data/mine.jsonl
    python -m rl_megatron.data.prepare openai/gsm8k --hf-config main --split test \
        --preset gsm8k --out data/gsm8k_test.parquet    # a Hub name: needs `datasets`

Input: `.jsonl`, `.json` (an array or JSON lines) and `.parquet` files; a folder of them (a
downloaded Hub dataset: `--split` picks the files whose name or folder starts with it); a
folder written by `datasets`' `save_to_disk`, or a `datasets.load_dataset` name (both need
the `datasets` package; a name not found locally needs its cache or the network).

Each record written is

    {"prompt": [{"role": "user", "content": "<question> <instruction>"}],  # chat messages
     "answer": "<reference answer>", "data_source": "<preset or input>", "index": <row>}

with a system message first when `--system` is given, and the `--keep` columns as they are.
Train on it with `data.apply_chat_template=true` and the reward the preset names.

Presets (each sets the defaults of the column options below):

    gsm8k      question → prompt; the number after "####" in answer; reward gsm8k
    math       problem → prompt; `answer` when the row has one (MATH-500), else the last
               \\boxed{} of `solution` (MATH); reward boxed_math
    dapo_math  DAPO-Math-17k: the user message of `prompt` without DAPO's "Answer: $Answer"
               wrapper; `reward_model.ground_truth`; reward boxed_math

Every row is converted or the tool stops: a malformed row (bad JSON, a missing column, an
empty prompt, an answer that cannot be extracted) is one line naming the file and the line
or row, exit code 2, and nothing is written. `--skip-invalid` skips such rows instead and
counts them. The output is written to a hidden sibling and renamed into place; it may not
be a file the tool reads (`--force` or not). A `--keep` column of mixed types is refused for
Parquet (one type per column) and kept as it is in JSONL. A held-out `--split` (test, val,
dev) is suggested as `data.val_files`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_megatron.data.datasets import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    DataError,
    read_records,
    validate_prompt,
)
from rl_megatron.rewards.rules import extract_boxed, extract_gsm8k_answer
from rl_megatron.utils.disk_space import DiskFullError, is_disk_full, no_space_line

PROG = "python -m rl_megatron.data.prepare"
JSON_SUFFIXES = (".json",)
ANSWER_FROM = ("text", "gsm8k", "boxed")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# DAPO-Math-17k wraps each problem in an instruction for an "Answer: $Answer" last line,
# which no built-in reward reads; the problem is taken out and given the boxed instruction.
_DAPO_PREFIX = re.compile(
    r"^\s*Solve the following math problem step by step\. The last line of your response "
    r"should be of the form Answer: \$Answer \(without quotes\) where \$Answer is the "
    r"answer to the problem\.\s*"
)
_DAPO_SUFFIX = re.compile(
    r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$"
)


@dataclass(frozen=True)
class Preset:
    """Where a dataset keeps its prompt and answer, and what to ask the model."""

    prompt_column: str
    answers: tuple[tuple[str, str], ...]  # (column, how to read it), first present column wins
    instruction: str
    reward: str  # the reward.function to train with
    strip: tuple[re.Pattern, ...] = field(default=())  # removed from the prompt text


PRESETS = {
    "gsm8k": Preset("question", (("answer", "gsm8k"),), GSM8K_INSTRUCTION, "gsm8k"),
    "math": Preset(
        "problem", (("answer", "text"), ("solution", "boxed")), BOXED_INSTRUCTION, "boxed_math"
    ),
    "dapo_math": Preset(
        "prompt",
        (("reward_model.ground_truth", "text"),),
        BOXED_INSTRUCTION,
        "boxed_math",
        strip=(_DAPO_PREFIX, _DAPO_SUFFIX),
    ),
}


class RowError(ValueError):
    """One row cannot be converted; the message says why (the caller adds where)."""


# ------------------------------------------------------------------------------ reading


def iter_rows(
    source: str, split: str | None = None, hf_config: str | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield (`where`, row) for every row of `source`: a file, a folder, or a `datasets` name.

    `where` names the row as error messages show it (`file:line`, `file row n`).
    """
    path = Path(source).expanduser()
    if path.is_file():
        yield from _read_file(path)
    elif path.is_dir():
        if _is_saved_dataset(path):
            yield from _read_hf(source, split, hf_config, from_disk=True)
            return
        files = _data_files(path, split)
        for file in files:
            yield from _read_file(file)
    else:
        yield from _read_hf(source, split, hf_config, from_disk=False)


def _is_saved_dataset(folder: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (read through that library)."""
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def _data_files(folder: Path, split: str | None) -> list[Path]:
    """The data files under `folder`, sorted; with `split`, those whose file name or a
    folder below `folder` starts with it (`main/train-00000-of-00001.parquet`)."""
    suffixes = JSONL_SUFFIXES + PARQUET_SUFFIXES + JSON_SUFFIXES
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in suffixes
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if split is not None:
        files = [
            p for p in files if any(part.startswith(split) for part in p.relative_to(folder).parts)
        ]
    if not files:
        which = f" for split {split!r}" if split else ""
        raise DataError(f"{folder}: no .jsonl, .json or .parquet files{which}")
    return files


def _read_file(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() in JSON_SUFFIXES:
        yield from _read_json(path)
    else:
        yield from read_records(path, what="input")


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    """A `.json` file: one array of objects (`file item n`), or JSON lines (`file:line`)."""
    text = path.read_bytes()
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if isinstance(data, list):
        for i, row in enumerate(data):
            yield f"{path} item {i}", row
        return
    if isinstance(data, dict):
        raise DataError(f"{path}: a JSON object, not an array of rows or JSON lines")
    # JSON lines under a .json name (common on the Hub): read as such, line by line.
    yield from read_records(path, what="input", as_jsonl=True)


def _read_hf(
    name: str, split: str | None, hf_config: str | None, from_disk: bool
) -> Iterator[tuple[str, Any]]:
    """Rows through the `datasets` library (imported only here, and only when needed)."""
    try:
        import datasets
    except ImportError:
        what = "a folder written by datasets' save_to_disk" if from_disk else "no such file"
        raise DataError(
            f"{name}: {what}; reading it needs the `datasets` package (pip install datasets), "
            "or give .jsonl / .json / .parquet files"
        ) from None
    try:
        if from_disk:
            data = datasets.load_from_disk(name)
            if isinstance(data, datasets.DatasetDict):
                if split is None or split not in data:
                    raise DataError(f"{name}: pick a split with --split ({', '.join(data)})")
                data = data[split]
        else:
            if split is None:
                raise DataError(f"{name}: a `datasets` name needs --split (e.g. train)")
            data = datasets.load_dataset(name, hf_config, split=split)
    except DataError:
        raise
    except Exception as exc:  # the library raises many types (not found, offline, ...)
        first = (str(exc).splitlines() or [""])[0]
        raise DataError(
            f"{name}: datasets could not load it ({type(exc).__name__}: {first})"
        ) from None
    label = f"{name}[{split}]" if split else name
    for i, row in enumerate(data):
        yield f"{label} row {i}", row


# ---------------------------------------------------------------------------- converting


@dataclass(frozen=True)
class Mapping:
    """How one row becomes a record (a preset's defaults with the user's options)."""

    prompt_column: str
    answers: tuple[tuple[str, str], ...]
    instruction: str
    system: str | None
    keep: tuple[str, ...]
    data_source: str
    strip: tuple[re.Pattern, ...] = ()


def column(row: dict, name: str) -> Any:
    """`row[name]`, following dots into nested fields and list positions
    (`reward_model.ground_truth`, `messages.-1.content`); KeyError when absent."""
    value: Any = row
    for part in name.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and re.fullmatch(r"-?\d+", part) and value:
            try:
                value = value[int(part)]
            except IndexError:
                raise KeyError(name) from None
        else:
            raise KeyError(name)
    return value


def convert_row(row: Any, index: int, mapping: Mapping) -> dict[str, Any]:
    """The record for one input row (raises RowError naming the column and the problem)."""
    if not isinstance(row, dict):
        raise RowError(f"expected an object with columns, got {type(row).__name__}")
    question = _prompt_text(row, mapping)
    for pattern in mapping.strip:
        question = pattern.sub("", question)
    question = question.strip()
    if not question:
        raise RowError(f"column {mapping.prompt_column!r} holds an empty prompt")
    content = f"{question} {mapping.instruction}" if mapping.instruction else question
    messages = [{"role": "user", "content": content}]
    if mapping.system:
        messages.insert(0, {"role": "system", "content": mapping.system})
    record: dict[str, Any] = {
        "prompt": messages,
        "answer": _answer(row, mapping.answers),
        "data_source": mapping.data_source,
        "index": index,
    }
    for name in mapping.keep:
        try:
            record[name.replace(".", "_")] = column(row, name)
        except KeyError:
            raise RowError(f"no column {name!r} to keep (columns: {_columns(row)})") from None
    return record


def _prompt_text(row: dict, mapping: Mapping) -> str:
    """The question: a text column, or the last user message of a chat-messages column."""
    name = mapping.prompt_column
    try:
        value = column(row, name)
    except KeyError:
        raise RowError(
            f"no column {name!r} (columns: {_columns(row)}); set --prompt-column"
        ) from None
    if isinstance(value, list):
        try:
            validate_prompt(value, name, "row")
        except DataError as exc:
            raise RowError(str(exc).removeprefix("row: ")) from None
        users = [m["content"] for m in value if m["role"] == "user"]
        if not users:
            raise RowError(f"column {name!r} holds messages but no user message")
        return users[-1]
    if not isinstance(value, str):
        raise RowError(f"column {name!r} is {type(value).__name__}, expected text or chat messages")
    return value


def _answer(row: dict, answers: tuple[tuple[str, str], ...]) -> str:
    """The reference answer from the first of `answers` the row has."""
    for name, how in answers:
        try:
            value = column(row, name)
        except KeyError:
            continue
        if value is None or not str(value).strip():
            raise RowError(f"column {name!r} holds no answer")
        text = str(value)
        if how == "gsm8k":
            found = extract_gsm8k_answer(text, require_marker=True)
            if found is None:
                raise RowError(f"column {name!r} has no number after '####': {_short(text)}")
            return found
        if how == "boxed":
            found = extract_boxed(text)
            if found is None:
                raise RowError(f"column {name!r} has no closed \\boxed{{...}}: {_short(text)}")
            return found.strip()
        return text.strip()
    names = " or ".join(repr(name) for name, _ in answers)
    raise RowError(f"no column {names} (columns: {_columns(row)}); set --answer-column")


def _columns(row: dict) -> str:
    keys = list(row)
    return ", ".join(map(str, keys[:8])) + (", ..." if len(keys) > 8 else "") if keys else "none"


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


# ---------------------------------------------------------------------------- writing


def write_records(records: list[dict[str, Any]], out: Path) -> None:
    """Write `records` to `out` (.jsonl or .parquet) through a hidden sibling and a rename."""
    tmp = out.parent / f".{out.name}.partial"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if out.suffix.lower() in PARQUET_SUFFIXES:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        # What the records take as JSONL: exact for .jsonl, about it for .parquet.
        needed = sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in records)
        tmp.unlink(missing_ok=True)  # the space back before the line is made
        raise DiskFullError(no_space_line(out, needed)) from None
    finally:
        tmp.unlink(missing_ok=True)


def check_out(out: Path, inputs: list[str], split: str | None, force: bool) -> None:
    """Refuse an `--out` that is a directory, exists without `force`, or is a file the
    conversion reads (an input, through a link or a relative path, or a data file of an
    input folder): it would replace the dataset it reads, `--force` or not."""
    if out.is_dir():
        raise DataError(f"--out: {out} is a directory; give a .jsonl or .parquet file path")
    if not out.exists():
        return
    for source in inputs:
        path = Path(source).expanduser()
        if path.is_dir() and not _is_saved_dataset(path):
            read = _data_files(path, split)
        else:
            read = [path] if path.is_file() else []
        for file in read:
            if os.path.samefile(file, out):  # the same file, however either is spelled
                what = "the input" if file == path else f"{file}, a file of the input"
                raise DataError(
                    f"--out: {out} is {what} {source}, which writing there would replace "
                    "(--force or not); choose another output file"
                )
    if not force:
        raise DataError(f"--out: {out} exists (pass --force to overwrite)")


def check_parquet_columns(records: list[dict], wheres: list[str], keep: tuple[str, ...]) -> None:
    """Each kept column holds one Parquet type; else one line naming the column, the types
    seen and the first row of the second type (Parquet has one type per column, JSONL not)."""
    import pyarrow as pa

    for name in keep:
        key = name.replace(".", "_")
        values = [r[key] for r in records]
        try:
            pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            first: dict[str, int] = {}
            for i, value in enumerate(values):
                if value is not None:
                    first.setdefault(type(value).__name__, i)
            seen = ", ".join(f"{t} (first at {wheres[i]})" for t, i in first.items())
            if len(first) < 2:  # one Python type, mixed inside (nested fields): arrow's words
                seen = f"{seen}: {(str(exc).splitlines() or [''])[0]}"
            raise DataError(
                f"--keep {name}: the column mixes types, which Parquet cannot hold: {seen}; "
                "write .jsonl instead, or make the column one type"
            ) from None


def is_eval_split(split: str | None) -> bool:
    """Whether `split` names held-out data (test, validation, dev), to be given as
    data.val_files rather than data.train_files."""
    return bool(split) and split.lower().startswith(("test", "val", "dev", "eval"))


@dataclass
class Summary:
    read: int = 0
    written: int = 0
    skipped: int = 0
    first_skip: str | None = None


def prepare(
    sources: list[str],
    out: Path,
    mapping: Mapping,
    *,
    split: str | None = None,
    hf_config: str | None = None,
    skip_invalid: bool = False,
    limit: int | None = None,
) -> Summary:
    """Convert every row of `sources` and write `out`; DataError (one line) on a bad row."""
    records: list[dict[str, Any]] = []
    wheres: list[str] = []  # where each record came from, for errors found after reading
    summary = Summary()
    for source in sources:
        for index, (where, row) in enumerate(iter_rows(source, split, hf_config)):
            if limit is not None and len(records) >= limit:
                break  # the remaining sources are not even opened (below)
            summary.read += 1
            try:
                records.append(convert_row(row, index, mapping))
                wheres.append(where)
            except RowError as exc:
                if not skip_invalid:
                    raise DataError(f"{where}: {exc} (--skip-invalid skips such rows)") from None
                summary.skipped += 1
                summary.first_skip = summary.first_skip or f"{where}: {exc}"
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise DataError(f"{', '.join(sources)}: no rows converted ({summary.read} read)")
    if out.suffix.lower() in PARQUET_SUFFIXES:
        check_parquet_columns(records, wheres, mapping.keep)
    write_records(records, out)
    summary.written = len(records)
    return summary


# -------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a dataset (JSONL / JSON / Parquet files or folders, or a "
        "`datasets` name) into rl_megatron's prompt format: chat messages + answer.",
    )
    parser.add_argument("inputs", nargs="+", help="files, folders or a datasets name")
    parser.add_argument("--out", required=True, type=Path, help="output .jsonl or .parquet")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a known dataset's columns")
    parser.add_argument("--split", help="split: file/folder name prefix, or datasets' split")
    parser.add_argument("--hf-config", help="datasets configuration name (e.g. main)")
    parser.add_argument("--prompt-column", help="column holding the question or messages")
    parser.add_argument("--answer-column", help="column holding the answer (dots: nested)")
    parser.add_argument(
        "--answer-from",
        choices=ANSWER_FROM,
        default="text",
        help="read the answer column as text, the number after ####, or the last \\boxed{}",
    )
    parser.add_argument("--instruction", help="appended to each question (preset's default)")
    parser.add_argument("--system", help="a system message put before the question")
    parser.add_argument("--keep", action="append", default=[], help="also copy this column")
    parser.add_argument("--data-source", help="the data_source field (preset or input name)")
    parser.add_argument("--limit", type=int, help="stop after this many records")
    parser.add_argument("--skip-invalid", action="store_true", help="skip bad rows, count them")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    return parser.parse_args(argv)


def mapping_from_args(args: argparse.Namespace) -> tuple[Mapping, str | None]:
    """The row mapping and the reward to suggest; DataError when the columns are unknown."""
    preset = PRESETS.get(args.preset) if args.preset else None
    prompt_column = args.prompt_column or (preset.prompt_column if preset else None)
    if prompt_column is None:
        raise DataError("--prompt-column: required without --preset")
    if args.answer_column:
        answers: tuple[tuple[str, str], ...] = ((args.answer_column, args.answer_from),)
    elif preset:
        answers = preset.answers
    else:
        raise DataError("--answer-column: required without --preset")
    instruction = args.instruction if args.instruction is not None else ""
    if args.instruction is None and preset:
        instruction = preset.instruction
    reward = preset.reward if preset and not args.answer_column else None
    if reward is None:
        reward = {"gsm8k": "gsm8k", "boxed": "boxed_math"}.get(args.answer_from)
    source = args.data_source or args.preset or Path(args.inputs[0]).stem
    mapping = Mapping(
        prompt_column=prompt_column,
        answers=answers,
        instruction=instruction,
        system=args.system,
        keep=tuple(args.keep),
        data_source=source,
        strip=preset.strip if preset and not args.prompt_column else (),
    )
    return mapping, reward


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
            raise DataError(f"--out: {args.out} must end in .jsonl or .parquet")
        check_out(args.out, args.inputs, args.split, args.force)
        if args.limit is not None and args.limit < 1:
            raise DataError("--limit: must be >= 1")
        mapping, reward = mapping_from_args(args)
        summary = prepare(
            args.inputs,
            args.out,
            mapping,
            split=args.split,
            hf_config=args.hf_config,
            skip_invalid=args.skip_invalid,
            limit=args.limit,
        )
    except (DataError, DiskFullError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    skipped = (
        f", {summary.skipped} skipped (first: {summary.first_skip})" if summary.skipped else ""
    )
    print(f"wrote {summary.written} records to {args.out} ({summary.read} read{skipped})")
    key, use = ("val_files", "validate") if is_eval_split(args.split) else ("train_files", "train")
    hint = f"data.{key}=[{args.out}] data.apply_chat_template=true"
    if reward:
        hint += f" reward.type=rule reward.function={reward}"
    print(f"{use} with: {hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
