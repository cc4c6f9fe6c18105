"""Prompt datasets read from JSON Lines and Parquet files.

A record is one JSON object (JSONL line) or one row (Parquet) holding the prompt under
`prompt_key` — either a text string or a chat `messages` list of `{"role", "content"}`
dicts — plus whatever fields the reward needs (e.g. `answer`), kept as they are and handed
to the reward function as its `sample` dict.

Every record is read or the load fails: a malformed record, or text that is not UTF-8,
raises `DataError` with one line naming the file and the line (JSONL, 1-based) or row
(Parquet, 0-based). Nothing is skipped silently; the only lines not read as records are
blank ones in JSONL files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_megatron.config import Config

__all__ = [
    "DataError",
    "Prompt",
    "PromptDataset",
    "load_prompt_dataset",
    "dataset_from_config",
    "read_records",
    "validate_prompt",
]

# A text prompt, or chat messages [{"role": "user", "content": "..."}, ...].
Prompt = str | list[dict[str, str]]

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)


class DataError(ValueError):
    """The user's data is wrong; the message is one line naming the file and line/row."""


@dataclass
class PromptDataset:
    """Records of one split, in file order, each with the place it came from.

    `samples[i]` is the record as read (all its fields); `sources[i]` is `"file:line"` or
    `"file row n"`, used to name the record in error messages further down the pipeline.
    """

    samples: list[dict[str, Any]]
    sources: list[str]
    prompt_key: str = "prompt"
    files: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.samples)

    def prompt(self, index: int) -> Prompt:
        """The prompt of record `index`: text, or a list of chat messages."""
        return self.samples[index][self.prompt_key]

    def select(self, indices: Sequence[int]) -> PromptDataset:
        """A dataset of the records at `indices`, in that order (used by length filtering)."""
        return PromptDataset(
            samples=[self.samples[i] for i in indices],
            sources=[self.sources[i] for i in indices],
            prompt_key=self.prompt_key,
            files=list(self.files),
        )


def validate_prompt(value: Any, prompt_key: str, where: str) -> None:
    """Check that `value` is a non-empty text prompt or a well-formed chat message list.

    Raises DataError naming `where` (file:line) and `prompt_key`.
    """
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {prompt_key!r} is an empty string")
        return
    if isinstance(value, list):
        if not value:
            raise DataError(f"{where}: {prompt_key!r} is an empty list of messages")
        for i, message in enumerate(value):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise DataError(
                    f"{where}: {prompt_key!r}[{i}] must be a message "
                    f'{{"role": str, "content": str}}, got {_short(message)}'
                )
        return
    if value is None:
        raise DataError(f"{where}: {prompt_key!r} is null")
    raise DataError(
        f"{where}: {prompt_key!r} must be a string or a list of chat messages, "
        f"got {type(value).__name__}"
    )


def load_prompt_dataset(
    files: Sequence[str | Path],
    prompt_key: str = "prompt",
    required_keys: Sequence[str] = (),
    what: str = "data files",
) -> PromptDataset:
    """Read every record of `files` (JSONL or Parquet, by suffix), in order.

    Args:
        files: paths ending in `.jsonl` or `.parquet`.
        prompt_key: field holding the text prompt or the chat message list.
        required_keys: further fields every record must have (e.g. the reward's `answer`).
        what: how the caller's setting is named in errors (e.g. `data.train_files`).

    Raises DataError (one line, naming the file and line/row) for a missing or unreadable
    file, a malformed record, a missing key, or when no record is found at all.
    """
    if not files:
        raise DataError(f"{what}: no files given")
    samples: list[dict[str, Any]] = []
    sources: list[str] = []
    for file in files:
        for where, record in read_records(file, what):
            _check_record(record, where, prompt_key, required_keys)
            samples.append(record)
            sources.append(where)
    if not samples:
        raise DataError(f"{what}: no records in {', '.join(str(f) for f in files)}")
    return PromptDataset(samples, sources, prompt_key, [str(f) for f in files])


def read_records(
    file: str | Path, what: str = "data files", as_jsonl: bool = False
) -> Iterator[tuple[str, Any]]:
    """Yield (`where`, record) for every record of a `.jsonl` or `.parquet` file, in order.

    `where` is `"file:line"` (JSONL, 1-based) or `"file row n"` (Parquet, 0-based). Raises
    DataError (one line) for a missing file, another suffix or a malformed record.
    as_jsonl: read the file as JSON lines whatever its suffix.
    """
    path = Path(file)
    if not path.is_file():
        raise DataError(f"{what}: file not found: {path}")
    suffix = path.suffix.lower()
    if as_jsonl or suffix in JSONL_SUFFIXES:
        return _read_jsonl(path)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path)
    raise DataError(
        f"{what}: {path}: unsupported file type {suffix or '(none)'!r}; "
        "use .jsonl (one JSON object per line) or .parquet"
    )


def dataset_from_config(config: Config, split: str = "train") -> PromptDataset:
    """Load `data.train_files` or `data.val_files` with the config's keys.

    The answer field is required only when a built-in rule reward will read it; a user
    reward function (`module:function`) or a reward model may not need one.
    """
    from rl_megatron.rewards.rules import RULES

    data = config.data
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    files = data.train_files if split == "train" else data.val_files
    needs_answer = config.reward.type == "rule" and config.reward.function in RULES
    return load_prompt_dataset(
        files,
        prompt_key=data.prompt_key,
        required_keys=(data.answer_key,) if needs_answer else (),
        what=f"data.{split}_files",
    )


def _check_record(record: Any, where: str, prompt_key: str, required_keys: Sequence[str]) -> None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if prompt_key not in record:
        raise DataError(
            f"{where}: no {prompt_key!r} field (fields: {_keys(record)}); "
            "set data.prompt_key to the field holding the prompt"
        )
    validate_prompt(record[prompt_key], prompt_key, where)
    for key in required_keys:
        if key not in record or record[key] is None:
            raise DataError(
                f"{where}: no {key!r} field, which the reward needs (fields: {_keys(record)}); "
                "set data.answer_key"
            )


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (`"file:line"`, parsed object) for every non-blank line."""
    # Bytes, decoded line by line: a text-mode file would raise UnicodeDecodeError from
    # inside the iteration, with no line number. Lines end at b"\n" (as `sed -n Np` counts).
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte "
                    f"{exc.start + 1} of the line); JSON Lines files must be UTF-8, re-encode it"
                ) from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (`"file row n"`, row dict) for every row, a record batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
        row = 0
        # Batches keep memory bounded for large files; rows come back as plain Python
        # objects (nested message structs become dicts), the same shape JSONL gives.
        for batch in parquet.iter_batches():
            try:
                records = batch.to_pylist()
            except UnicodeDecodeError:
                # A string column holding bytes that are not UTF-8 (writers that skip
                # validation produce them): name the row, found one row at a time.
                bad = _first_undecodable_row(batch)
                raise DataError(
                    f"{path} row {row + bad}: not UTF-8 text in a string column; "
                    "re-write the file with UTF-8 strings"
                ) from None
            for record in records:
                yield f"{path} row {row}", record
                row += 1
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise DataError(f"{path}: cannot read Parquet ({type(exc).__name__}: {first})") from None


def _first_undecodable_row(batch: Any) -> int:
    """Index in `batch` (a pyarrow RecordBatch) of the first row that does not decode."""
    for i in range(batch.num_rows):
        try:
            batch.slice(i, 1).to_pylist()
        except UnicodeDecodeError:
            return i
    return 0


def _keys(record: dict) -> str:
    keys = list(record)
    text = ", ".join(map(str, keys[:8]))
    return text + (", ..." if len(keys) > 8 else "") if keys else "none"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
