"""Readers of the text, JSON and JSON Lines files users give the commands (stdlib only).

Every failure is a `ValueError` that names the file and, where there is one, the line: bytes that are not UTF-8,
invalid JSON, a value of the wrong type, an empty file. `errors="replace"` is never used: a bad byte is reported
here, not later as a garbled token inside a tokenizer or a `datasets.map`."""

from __future__ import annotations

import json
import os

__all__ = ["read_json", "read_jsonl", "read_text", "read_text_lines"]


def _label(path: str, what: str) -> str:
    return f"{what} {path!r}".strip() if what else repr(path)


def read_text(path: str | os.PathLike, what: str = "") -> str:
    """The text of a UTF-8 file. A missing path, a directory, a symlink loop or a byte that is not UTF-8 →
    `ValueError` naming the file (and the line and column of the bad byte)."""
    path = os.fspath(path)
    label = _label(path, what)
    if os.path.isdir(path):
        raise ValueError(f"{label} is a directory; expected a file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if os.path.islink(path):
            raise ValueError(f"{label} is a broken symbolic link") from None
        raise ValueError(f"{label} does not exist") from None
    except OSError as err:  # ELOOP (a symlink loop), EACCES, EIO: the system's own words, with the file's name
        raise ValueError(f"{label} cannot be read: {err.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column}); save "
                         "the file as UTF-8") from None


def read_text_lines(path: str | os.PathLike, what: str = "") -> list[tuple[int, str]]:
    """(line number, line) of every non-blank line of a UTF-8 text file (line ends stripped)."""
    text = read_text(path, what)
    return [(n, line.rstrip("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def _parse(text: str, path: str, line: int | None = None):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        at = f"{path}:{line}" if line is not None else f"{path}:{err.lineno}"
        raise ValueError(f"{at}: invalid JSON (column {err.colno}: {err.msg})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def read_json(path: str | os.PathLike, what: str = "", expect: type | tuple[type, ...] | None = None):
    """The JSON value of a file; `expect` (dict → an object, list → a list) is checked, naming the type found."""
    path = os.fspath(path)
    text = read_text(path, what)
    if not text.strip():
        raise ValueError(f"{_label(path, what)} is empty; expected JSON")
    value = _parse(text, path)
    if expect is not None and not isinstance(value, expect):
        want = " or ".join("a JSON " + _kind(t()) for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise ValueError(f"{_label(path, what)}: expected {want}, got a JSON {_kind(value)}")
    return value


def read_jsonl(path: str | os.PathLike, what: str = "", objects: bool = True) -> tuple[list, list[int] | None]:
    """Rows of a JSON Lines file (one value per line, blank lines skipped; `.json` files in this form too, as
    `datasets` reads them) or of a file holding one JSON list (its text starts with `[`). Returns (rows, line number
    of each row); the line numbers are None for a JSON list. With `objects`, every row must be a JSON object. An
    empty file is an error."""
    path = os.fspath(path)
    text = read_text(path, what)
    label = _label(path, what)
    if not text.strip():
        raise ValueError(f"{label} is empty: expected one JSON object per line")
    if text.lstrip().startswith("["):
        rows = _parse(text, path)
        if not isinstance(rows, list):
            raise ValueError(f"{label}: expected a JSON list, got a JSON {_kind(rows)}")
        if not rows:
            raise ValueError(f"{label} is an empty JSON list")
        if objects:
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ValueError(f"{path}: item {bad + 1} of the JSON list is a JSON {_kind(rows[bad])}; expected "
                                 "an object {...}")
        return rows, None
    rows, lines = [], []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        row = _parse(line, path, number)
        if objects and not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object {{...}}, got a JSON {_kind(row)}")
        rows.append(row)
        lines.append(number)
    return rows, lines
