"""What every format reader of a listing shares: the source, its files' lines, the reading's state,
and the paths it names made absolute.

A listing file is read as a stream of non-blank UTF-8 lines (local or at a URL, gzip when it ends
in `.gz`); an unreadable file or line is a problem of the listing, never an exception. Relative
audio paths are taken relative to the folder of the file that names them and made absolute
without resolving symlinks (workers check paths against the allowed roots themselves).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from pipeline.corpus.problems import Problems, quote
from pipeline.errors import VoxmillError
from pipeline.storage.objects import open_input
from pipeline.storage.urls import URL_SCHEMES, is_url, parse_url

if TYPE_CHECKING:
    from pipeline.corpus.listed_ids import ListedIds

MANIFEST_SUFFIX = ".jsonl"
GZ_MANIFEST_SUFFIX = ".jsonl.gz"
Source = Path | str


@dataclass(frozen=True)
class Line:
    """One non-blank line of a listing file: 1-based number and text without the line break."""

    number: int
    text: str


class NoIds:
    """The ids of a listing read only for its paths: none kept, none repeated."""

    def add(self, utt: str, line: int) -> None:
        """Nothing kept."""

    def repeats(self) -> dict[int, int]:
        return {}

    def contains(self, utt: str) -> bool:
        return False


class Reading:
    """A listing being read, as its format readers share it: the longest name or path a line may
    carry (`limit`, None: no limit), the problems found, the ids seen, how many utterances the
    listing has yielded so far (`count`, kept by `CorpusListing`, which is one) and whether they
    came with durations."""

    def __init__(self, limit: int | None, ids: ListedIds | NoIds) -> None:
        self.limit = limit
        self.problems = Problems()
        self.ids = ids
        self.count = 0
        self.durations_listed = False

    def check_ids(self, file: Source, id_of: Callable[[str], str]) -> None:
        """Report every utt listed twice; the ids were kept as digests, so the repeated lines are
        read again to name them."""
        repeats = self.ids.repeats()
        if not repeats:
            return
        names = {
            line.number: id_of(line.text) for line in read_lines(file, Problems()) if line.number in repeats
        }
        for line, first in sorted(repeats.items()):
            self.problems.add(file, line, f"duplicate utt {names.get(line, '?')!r} (first on line {first})")


def read_lines(file: Source, problems: Problems) -> Iterator[Line]:
    """Non-blank lines of a UTF-8 text file (local or at a URL; gzip when it ends in .gz), streamed;
    an unreadable file or line is reported."""
    try:
        raw: IO[bytes] = open_input(file)
    except VoxmillError as exc:
        problems.add(file, None, f"cannot be read ({exc.message})")
        return
    except OSError as exc:
        problems.add(file, None, f"cannot be read ({exc.strerror or exc})")
        return
    stream = cast(IO[bytes], gzip.GzipFile(fileobj=raw)) if str(file).endswith(".gz") else raw
    with raw, stream:
        number = 0
        try:
            for number, chunk in enumerate(stream, start=1):  # noqa: B007 - the count outlives the loop
                try:
                    text = chunk.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    problems.add(file, number, "is not valid UTF-8")
                    continue
                if number == 1:
                    text = text.removeprefix("\ufeff")
                if text.strip():
                    yield Line(number, text)
        except (OSError, EOFError) as exc:  # a truncated or corrupt .gz
            problems.add(file, number + 1, f"cannot be read further ({exc})")


def split_first(text: str) -> tuple[str, str]:
    """Split a line at its first run of whitespace: ('utt', 'rest stripped')."""
    parts = text.strip().split(maxsplit=1)
    if len(parts) < 2:
        return (parts[0] if parts else ""), ""
    return parts[0], parts[1].strip()


def parse_json(text: str) -> tuple[Any, str | None]:
    """(the value of one JSON line, None), or (None, what is wrong with it): a syntax error, a
    number of more digits than Python converts, nesting deeper than it recurses."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    except (ValueError, RecursionError) as exc:  # int digits beyond sys.get_int_max_str_digits, nesting
        return None, f"not valid JSON ({type(exc).__name__}: {quote(str(exc), 80)})"


def finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, NaN, Infinity, an int too
    large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def absolute(base: Path | str, path: str) -> str:
    """`path` made absolute relative to `base` (symlinks and '..' are kept as written); a URL stays
    as it is, and a relative path in a listing at a URL becomes a URL beside it. Plain string
    joins: this runs once per utterance of a listing."""
    if "://" in path and is_url(path):
        return path
    base_text = base if isinstance(base, str) else str(base.absolute())
    if "://" in base_text and is_url(base_text):
        return path if path.startswith("/") else str(parse_url(base_text).join(path))
    if "//" in path or "./" in path or path.endswith("/"):  # what pathlib would tidy: let it
        return str(Path(base_text, path))
    return path if path.startswith("/") else f"{base_text}/{path}"


def folder_of(file: Source) -> Path | str:
    """The folder of a listing file: a Path, or a URL for a listing at a URL."""
    if isinstance(file, str):
        return str(parse_url(file).parent)
    return file.parent.absolute()


def as_source(source: Source) -> Source:
    """An `extract` input as the corpus readers take it: a URL or a brace pattern stays a string,
    anything else is a Path. A URL that went through `Path()` (`s3:/bucket/x`) is mended."""
    text = str(source)
    for scheme in URL_SCHEMES:
        if text.startswith(f"{scheme}:/") and not text.startswith(f"{scheme}://"):
            text = f"{scheme}://{text[len(scheme) + 2 :]}"
            break
    if is_url(text) or is_pattern(text):
        return text
    return Path(source)


def is_pattern(text: str) -> bool:
    return "{" in text and "}" in text.split("{", 1)[1]


def is_jsonl(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(MANIFEST_SUFFIX) or lower.endswith(GZ_MANIFEST_SUFFIX)
