"""Logging set-up: plain text or one JSON object per line (`--log-format json`), never secrets."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

STANDARD_ATTRS = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
# What `(\w+://[^:/@\s]*:)[^@\s]+@` matches, as runs read from fixed places (`redact`).
USER_RUN = re.compile(r"[^:/@\s]*")
PASSWORD_RUN = re.compile(r"[^@\s]*")


def redact(text: str) -> str:
    """Replace the password of any `scheme://user:password@` in `text` by `***`.

    One pass: the pattern above as one regex backtracks from every start (40k characters of
    `a://b:` took 1.9 s); here a password run that met no '@' is never read again.
    """
    parts: list[str] = []
    copied = 0  # text[:copied] is in parts
    no_at_before = 0  # a password run starting before this meets whitespace or the end, not '@'
    found = text.find("://")
    while found != -1:
        if found > copied and (text[found - 1].isalnum() or text[found - 1] == "_"):
            user_end = USER_RUN.match(text, found + 3).end()  # type: ignore[union-attr]
            if text.startswith(":", user_end) and user_end + 1 >= no_at_before:
                end = PASSWORD_RUN.match(text, user_end + 1).end()  # type: ignore[union-attr]
                if text.startswith("@", end) and end > user_end + 1:
                    parts += [text[copied : user_end + 1], "***@"]
                    copied = end + 1
                    found = text.find("://", copied)
                    continue
                no_at_before = end
        found = text.find("://", found + 1)
    return "".join([*parts, text[copied:]]) if parts else text


class RedactingFormatter(logging.Formatter):
    """Text lines with URL passwords hidden."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once for a voxmill process."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(RedactingFormatter("[%(asctime)s %(levelname)s %(name)s] %(message)s"))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
