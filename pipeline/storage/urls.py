"""URLs of object stores (`s3://`, `gs://`, `http(s)://`): parsed, checked and compared, pure.

The URL jail (`url_within`, `check_url`): schemes compared exactly, `.` and `..` removed, bucket
(host) compared exactly, the path prefix compared on a `/` boundary. What is checked is what is
fetched, so a URL whose path a server could read differently is refused (`bad_request`), not
decoded: a percent-escape that stands for '.', '/', '\\', '%', ';' or a control character (or
starts an overlong UTF-8 sequence, %C0/%C1), a `..;` / `.;` segment (servlet containers drop the
`;...` and climb), and for HTTP a backslash. Decoding would need to guess how many times, and
with which separators, the server decodes; refusing leaves every server the same segments we
checked. A URL that carries credentials (`user:pass@`) is refused without being echoed. Every
string is bounded (`max_chars`) before it is parsed.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BAD_REQUEST, FORBIDDEN_PATH, VoxmillError

URL_SCHEMES = ("s3", "gs", "gcs", "http", "https")
# Longest name, path or URL taken (the default of Settings.max_text_chars, Linux's PATH_MAX).
MAX_TEXT_CHARS = 4096
# What a percent-escape in a URL's path may not stand for: characters that would change its
# segments (or how often it must be decoded) once a server decodes it. Control characters too.
HIDDEN_BY_ESCAPES = frozenset("./\\%;")
# Lead bytes of overlong UTF-8 (%C0%AE is '.' to an old decoder); never valid UTF-8.
OVERLONG_LEADS = frozenset({0xC0, 0xC1})
_HEX = frozenset("0123456789abcdefABCDEF")


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether `text` is a URL voxmill reads through the store layer (a str; a Path never is)."""
    if not isinstance(text, str):
        return False
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in URL_SCHEMES


@dataclass(frozen=True)
class StoreUrl:
    """A parsed URL: scheme (lower case, `gcs` spelled `gs`), bucket or host[:port], key path."""

    scheme: str
    bucket: str
    key: str  # without a leading '/'; '' for the bucket itself

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    @property
    def fs_path(self) -> str:
        """The path fsspec wants: `bucket/key` for object stores, the whole URL for HTTP."""
        if self.scheme in ("http", "https"):
            return str(self)
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def join(self, *parts: str) -> StoreUrl:
        key = posixpath.join(self.key, *parts) if self.key else posixpath.join(*parts)
        return StoreUrl(self.scheme, self.bucket, _normalise_key(key))

    @property
    def parent(self) -> StoreUrl:
        return StoreUrl(self.scheme, self.bucket, posixpath.dirname(self.key))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)


def mend_url(value: str | os.PathLike[str]) -> Path | str:
    """A URL as a string even when it went through `Path()` (`s3:/bucket/x`), else a Path (of a
    `ConfinedPath` too: an output folder is written by name)."""
    text = os.fspath(value)
    for scheme in URL_SCHEMES:
        if text.lower().startswith(f"{scheme}:/"):
            rest = text[len(scheme) + 1 :].lstrip("/")
            return f"{scheme}://{rest}"
    return value if isinstance(value, str) else Path(value)


def check_length(text: str, what: str, max_chars: int = MAX_TEXT_CHARS) -> None:
    """`bad_request` when `text` is longer than `max_chars`: before any pattern or path call."""
    if len(text) > max_chars:
        raise VoxmillError(
            BAD_REQUEST, f"{what} is {len(text)} characters long; the limit is {max_chars} (max_text_chars)"
        )


def parse_url(text: str, max_chars: int = MAX_TEXT_CHARS) -> StoreUrl:
    """`text` as a `StoreUrl`, `.` and `..` segments removed; `bad_request` for a URL that is not
    one of `URL_SCHEMES`, names no bucket, holds a NUL byte, carries credentials, is longer than
    `max_chars`, or spells its path so that a server could read other segments (module docstring)."""
    check_length(text, "URL", max_chars)
    if "\x00" in text:
        raise VoxmillError(BAD_REQUEST, "URL contains a NUL byte")
    scheme, sep, rest = text.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in URL_SCHEMES:
        raise VoxmillError(BAD_REQUEST, f"not a supported URL (schemes: {', '.join(URL_SCHEMES)})")
    authority, _, path = rest.partition("/")
    if "@" in authority:
        # Never echo the URL: what is before the '@' is a secret.
        raise VoxmillError(
            BAD_REQUEST,
            f"a {scheme}:// URL must not carry credentials (user:password@); give them to the store's "
            "client through its standard environment variables or config files",
        )
    if "?" in path or "#" in path:
        path = path.split("?", 1)[0].split("#", 1)[0]
    if not authority:
        raise VoxmillError(BAD_REQUEST, f"{scheme}:// URL names no bucket or host")
    if scheme == "gcs":
        scheme = "gs"
    if scheme in ("http", "https"):
        authority = authority.lower()
        if "\\" in path:
            raise VoxmillError(
                BAD_REQUEST, f"{scheme}:// URL has a backslash in its path, which some servers read as '/'"
            )
    _check_escapes(scheme, path)
    return StoreUrl(scheme, authority, _normalise_key(path))


def _check_escapes(scheme: str, path: str) -> None:
    """`bad_request` for a percent-escape or a segment a server could decode into other segments."""
    start = path.find("%")
    while start != -1:
        pair = path[start + 1 : start + 3]
        if len(pair) == 2 and set(pair) <= _HEX:
            value = int(pair, 16)
            if chr(value) in HIDDEN_BY_ESCAPES or value < 0x20 or value == 0x7F or value in OVERLONG_LEADS:
                raise VoxmillError(
                    BAD_REQUEST,
                    f"{scheme}:// URL has the percent-escape %{pair} in its path; escapes of . / \\ % ; "
                    "control characters and overlong UTF-8 (%C0, %C1) are refused, since a server would "
                    "decode them into another path than the one checked: spell the path plainly",
                )
        start = path.find("%", start + 1)
    for part in path.split("/"):
        head, semicolon, _ = part.partition(";")
        if semicolon and head in (".", ".."):
            raise VoxmillError(
                BAD_REQUEST,
                f"{scheme}:// URL has the segment {part[:40]!r}: a dot segment with ';' parameters, which "
                f"servers read as {head!r}",
            )


def _normalise_key(path: str) -> str:
    """A key path with `.`, `..` and empty segments removed ('..' never climbs above the bucket)."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/".join(parts)


def normalise_url(text: str) -> str:
    """The canonical spelling of a URL (see `parse_url`)."""
    return str(parse_url(text))


def url_within(url: StoreUrl, root: StoreUrl) -> bool:
    """Whether `url` is `root` or lies below it: same scheme, same bucket, key prefix on a `/`."""
    if url.scheme != root.scheme or url.bucket != root.bucket:
        return False
    return not root.key or url.key == root.key or url.key.startswith(root.key + "/")


def check_url(text: str, roots: Sequence[str], max_chars: int = MAX_TEXT_CHARS) -> str:
    """The normalised URL if inside one of the URL `roots`, else `forbidden_path` (`bad_request`
    for a malformed URL, one with credentials or one over `max_chars` characters)."""
    url = parse_url(text, max_chars)
    parsed = [parse_url(root) for root in roots]
    if not any(url_within(url, root) for root in parsed):
        allowed = ", ".join(str(root) for root in parsed) or "no URL prefix configured"
        raise VoxmillError(
            FORBIDDEN_PATH,
            f"{url} is outside the allowed roots ({allowed}); add its prefix (such as "
            f"{url.scheme}://{url.bucket}/...) to the workers' VOXMILL_ALLOWED_ROOTS",
        )
    return str(url)


def split_roots(text: str) -> list[str]:
    """`VOXMILL_ALLOWED_ROOTS` split on ':', keeping URLs (`s3://b/p`, `https://host:8443/p`) whole."""
    tokens = text.split(":")
    roots: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if token.lower() in URL_SCHEMES and following is not None and following.startswith("//"):
            joined = f"{token}:{following}"
            index += 2
            # host:port of an HTTP URL: the next token starts with the port's digits
            if index < len(tokens) and tokens[index].split("/", 1)[0].isdigit() and "/" not in following[2:]:
                joined += ":" + tokens[index]
                index += 1
            roots.append(joined)
            continue
        if token:
            roots.append(token)
        index += 1
    return roots


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace patterns: `{000..127}` (zero-padded numeric range), `{a,b}` (choices);
    several in one pattern expand left to right. A pattern without braces is itself."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    end = pattern.find("}", start)
    if end < 0:
        raise VoxmillError(BAD_REQUEST, f"unclosed '{{' in the pattern {pattern!r}")
    inner, head, tail = pattern[start + 1 : end], pattern[:start], pattern[end + 1 :]
    if ".." in inner:
        low, _, high = inner.partition("..")
        if not (low.isdigit() and high.isdigit()):
            raise VoxmillError(BAD_REQUEST, f"range {{{inner}}} in {pattern!r} is not numeric")
        width = len(low) if low.startswith("0") or len(low) == len(high) else 0
        step = 1 if int(high) >= int(low) else -1
        choices = [str(n).zfill(width) for n in range(int(low), int(high) + step, step)]
    else:
        choices = inner.split(",")
    return [head + choice + rest for choice in choices for rest in expand_braces(tail)]
