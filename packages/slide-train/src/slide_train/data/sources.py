"""Reading dataset files into records (text documents or rows), each numbered and tagged with where it came from.

The file type comes from data.path: `.jsonl` (one JSON object a line), `.json` (a list of them), `.parquet`,
`.arrow`, or a folder written by HF datasets' `save_to_disk`; any other file is plain text (or JSON lines for
format `jsonl`). Parquet and arrow go through HF `datasets` and are read as they are iterated, never loaded
whole: a 10 GB file costs the memory of its tokens, not of its text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import DataError

JSON_SUFFIXES = (".jsonl", ".json")
ARROW_SUFFIXES = (".parquet", ".arrow")
ROW_FILES = ".jsonl, .json, .parquet, .arrow files or a folder written by datasets' save_to_disk"


@dataclass(frozen=True)
class Record:
    number: int  # 1-based: the line of a .jsonl row or a text document's first line, else the row
    where: str  # "file:line" or "file row N", for messages
    value: Any  # a row (dict) or a document (str)


@dataclass
class Records:
    """The records of one file in file order. `items` may be read once only (arrow-backed files stream them);
    `total` is their count when the file tells it up front, for progress bars."""

    path: Path
    items: Iterable[Record]
    total: int | None
    unit: str  # what `number` counts: "line" or "row"

    def __iter__(self) -> Iterator[Record]:
        return iter(self.items)


def has_rows(path: Path) -> bool:
    """Whether the file holds rows (objects with keys) by its type, rather than plain text."""
    return path.is_dir() or path.suffix.lower() in JSON_SUFFIXES + ARROW_SUFFIXES


def check_file(path: Path) -> None:
    if not path.exists():  # a relative path is read from the current folder: say which one that was
        where = "" if path.is_absolute() else f" (looked for {path.absolute()})"
        raise DataError(f"data.path: file not found: {path}{where}")
    if not (path.is_file() or path.is_dir()):
        raise DataError(f"data.path: not a file: {path}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from e


def read_documents(path: Path) -> Records:
    """Each document of a plain text file, numbered by its first line: documents are separated by blank lines."""
    docs: list[Record] = []
    lines: list[str] = []
    start = 0
    for number, line in enumerate([*_read_text(path).splitlines(), ""], start=1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            docs.append(Record(start, f"{path}:{start}", "\n".join(lines)))
            lines = []
    return Records(path, docs, len(docs), "line")


def read_rows(path: Path) -> Records:
    """The rows of a file of any type with rows (ROW_FILES); other files are read as JSON lines."""
    suffix = path.suffix.lower()
    if path.is_dir() or suffix in ARROW_SUFFIXES:
        return _arrow_rows(path)
    text = _read_text(path)
    if suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({_json_problem(e, f'line {e.lineno}, ')})") from e
        if not isinstance(items, list):
            raise DataError(
                f"{path}: a .json dataset must be a list of objects (use .jsonl for one per line)"
            )
        rows = [Record(i, f"{path} row {i}", item) for i, item in enumerate(items, start=1)]
        unit = "row"
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # blank lines (often a trailing one) are not rows
            try:
                rows.append(Record(number, f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({_json_problem(e)})") from e
        unit = "line"
    for row in rows:
        if not isinstance(row.value, dict):
            raise DataError(f"{row.where}: expected a JSON object, got {type(row.value).__name__}")
    return Records(path, rows, len(rows), unit)


def _json_problem(e: json.JSONDecodeError, line: str = "") -> str:
    """What the JSON parser found, with where: its message alone ends mid-sentence for some problems
    ("Unterminated string starting at"), the position being kept apart from it."""
    where = f"{line}column {e.colno}"
    return f"{e.msg} {where}" if e.msg.endswith(" at") else f"{e.msg} at {where}"


def _arrow_rows(path: Path) -> Records:
    """Rows of a parquet or arrow file or a save_to_disk folder, through HF datasets, read as they are iterated.

    Nothing is copied into the datasets cache: parquet streams row group by row group, and arrow files and
    save_to_disk folders are memory-mapped where they lie. Only local files are read, so nothing is downloaded.
    """
    import datasets  # here, not at the top: a second of start-up that jsonl and text datasets do not need
    import pyarrow as pa

    suffix = path.suffix.lower()
    total = None
    try:
        if path.is_dir():
            table = _split(datasets.load_from_disk(str(path)), path, datasets)
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            total = pq.read_metadata(path).num_rows  # from the footer: the rows are not read
            table = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
        else:
            try:
                table = datasets.Dataset.from_file(str(path))  # the IPC stream format, as datasets writes it
            except pa.ArrowInvalid:  # the IPC file format (Feather v2, pyarrow's ipc.new_file, polars' write_ipc)
                table = datasets.load_dataset("arrow", data_files=str(path), split="train", streaming=True)
    except DataError:
        raise
    except Exception as e:  # a damaged file, or a folder not written by save_to_disk
        raise DataError(f"{path}: cannot read it as {_type_name(path)} ({type(e).__name__}: {e})") from e
    if isinstance(table, datasets.Dataset):
        total = len(table)
    return Records(path, _rows_of(table, path), total, "row")


def _type_name(path: Path) -> str:
    return "a folder written by datasets' save_to_disk" if path.is_dir() else f"a {path.suffix.lower()} file"


def _split(loaded, path: Path, datasets):
    """The dataset a save_to_disk folder holds; of a DatasetDict, its `train` split or its only one."""
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if "train" in loaded:
        return loaded["train"]
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    raise DataError(
        f"{path}: a DatasetDict with splits {', '.join(loaded)} and none named 'train': set data.path to the "
        f"folder of the split to train on (e.g. {path / next(iter(loaded))})"
    )


def _rows_of(table, path: Path) -> Iterator[Record]:
    rows = iter(table)
    number = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # the reader's own errors (a damaged row group), not those of the rows' users
            raise DataError(f"{path} row {number + 1}: cannot read it ({type(e).__name__}: {e})") from e
        number += 1
        yield Record(number, f"{path} row {number}", _without_nulls(row))


def _without_nulls(value):
    """The row as it was written: arrow gives each row every column of the file and each struct every field
    of its type, null where the row had none (a `tokens` row without labels would have labels None, a message
    without a name the name None). A null is taken as an absent key."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def get_key(row: dict, key: str, where: str, kind: type | tuple[type, ...] = str, required: bool = True):
    """row[key], checked: a missing key or a value of the wrong type names the line and the key."""
    if key not in row:
        if not required:
            return None
        raise DataError(f"{where}: missing key {key!r} (row has keys: {', '.join(map(repr, row)) or 'none'})")
    value = row[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DataError(f"{where}: key {key!r} must be {names}, got {type(value).__name__}")
    return value
