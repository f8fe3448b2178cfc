"""Reading dataset files into records (text documents or JSON rows), each tagged with where it came from."""

from __future__ import annotations

import json
from pathlib import Path

from .config import DataError

JSON_SUFFIXES = (".jsonl", ".json")


def check_file(path: Path) -> None:
    if not path.exists():
        raise DataError(f"data.path: file not found: {path}")
    if not path.is_file():
        raise DataError(f"data.path: not a file: {path}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from e


def read_documents(path: Path) -> list[tuple[str, str]]:
    """(where, text) for each document of a plain text file: documents are separated by blank lines."""
    docs: list[tuple[str, str]] = []
    lines: list[str] = []
    start = 0
    for number, line in enumerate([*_read_text(path).splitlines(), ""], start=1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            docs.append((f"{path}:{start}", "\n".join(lines)))
            lines = []
    return docs


def read_rows(path: Path) -> list[tuple[str, dict]]:
    """(where, row) for each JSON object of a .jsonl file (one a line) or a .json file (a list of them)."""
    text = _read_text(path)
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(items, list):
            raise DataError(
                f"{path}: a .json dataset must be a list of objects (use .jsonl for one per line)"
            )
        rows = [(f"{path} item {i}", item) for i, item in enumerate(items)]
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # blank lines (often a trailing one) are not rows
            try:
                rows.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    for where, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return rows


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
