"""pipeline/redaction.py: URL passwords are hidden in one pass, whatever the line holds."""

from __future__ import annotations

import random
import re

import pytest

from pipeline.redaction import redact

# The pattern `redact` replaces (what it did before it was written as one pass).
PATTERN = re.compile(r"(\w+://[^:/@\s]*:)[^@\s]+@")
PIECES = ("://", "redis://", "s3://", ":pw@", "@", ":", "/", " ", "\t", "a", "_", "é", "9", ".")


def by_pattern(text: str) -> str:
    return PATTERN.sub(r"\1***@", text)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("redis://:secret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("broker redis://user:p/a:ss@host/0 ok", "broker redis://user:***@host/0 ok"),
        ("two s3://a:b@c and https://d:e@f", "two s3://a:***@c and https://d:***@f"),
        ("no password redis://host:6379/0", "no password redis://host:6379/0"),
        ("empty password redis://user:@host", "empty password redis://user:@host"),
        ("nested x://u:y://v:p@h", "nested x://u:***@h"),
    ],
)
def test_passwords_are_hidden(line: str, expected: str) -> None:
    assert redact(line) == expected


def test_the_same_as_the_pattern_on_random_lines() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        line = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 24)))
        assert redact(line) == by_pattern(line), line


@pytest.mark.parametrize(
    "line, expected",
    [
        # every start is a candidate and no '@' follows: one regex over this is quadratic
        ("a://b:" * 100_000, "a://b:" * 100_000),
        ("x://" + "u" * 500_000 + ":" + "p" * 500_000, "x://" + "u" * 500_000 + ":" + "p" * 500_000),
        ("a://:" * 100_000 + "@ end", "a://:***@ end"),
    ],
    ids=["many-starts", "long-runs", "one-far-at"],
)
def test_long_hostile_lines(line: str, expected: str) -> None:
    """Lines of half a million characters and more: a quadratic scan would not finish."""
    assert redact(line) == expected
