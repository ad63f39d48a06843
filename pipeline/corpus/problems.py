"""What is wrong with a corpus listing: problems collected per file, and the words they are told in.

Every problem is "FILE line N: what is wrong" (or "FILE: ..." for the whole file); a name or value
quoted in one is cut to about 120 characters, so a message never carries a whole long line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.records import encodable

NO_SHELL = "voxmill never runs a shell command named by a corpus file"


class Problems:
    """Problems found while reading, kept per file, files in the order they were registered."""

    def __init__(self) -> None:
        self.by_file: dict[str, list[tuple[int, str]]] = {}

    def register(self, *files: Path | str) -> None:
        """The files of a listing, in the order their problems are reported."""
        for file in files:
            self.by_file.setdefault(str(file), [])

    def add(self, file: Path | str, line: int | None, what: str) -> None:
        """Record one problem; `line` None for a problem of the whole file."""
        text = f"{file}: {what}" if line is None else f"{file} line {line}: {what}"
        self.by_file.setdefault(str(file), []).append((line or 0, text))

    @property
    def items(self) -> list[str]:
        return [text for found in self.by_file.values() for _, text in sorted(found, key=lambda p: p[0])]


def name_problem(what: str, value: str, limit: int | None) -> str | None:
    """What is wrong with a name or path a listing gives (an utt, a speaker, a path or URL), or
    None: longer than `limit` characters, a NUL byte, not valid Unicode. Told by length and
    membership alone, before any path or pattern call sees it."""
    if limit is not None and len(value) > limit:
        return f"{what} is {len(value)} characters long; the limit is {limit} (max_text_chars)"
    if "\x00" in value:
        return f"{what} holds a NUL byte"
    if not encodable(value):
        return f"{what} is not valid Unicode (a lone surrogate)"
    return None


def text_problem(key: str, value: str, limit: int | None) -> str | None:
    """A speaker is a name (`name_problem`); a text only has to be valid Unicode."""
    if key == "text":
        return None if encodable(value) else f"field {key!r} is not valid Unicode (a lone surrogate)"
    return name_problem(f"field {key!r}", value, limit)


def quote(text: str, width: int = 120) -> str:
    """`text` as repr, cut to about `width` characters: a message never carries a whole long line."""
    quoted = repr(text)
    return quoted if len(quoted) <= width else f"{quoted[: width - 20]}... ({len(text)} characters)"


def shown(value: Any, width: int = 120) -> str:
    """A value of a JSON line for a message: a string as repr, anything else as JSON."""
    return quote(value, width) if isinstance(value, str) else shown_json(value, width)


def shown_json(value: Any, width: int = 120) -> str:
    """A JSON value for a message, as JSON, cut to about `width` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= width else f"{text[: width - 20]}... ({len(text)} characters)"
