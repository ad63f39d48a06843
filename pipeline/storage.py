"""Where bytes live: local paths and object-store URLs (`s3://`, `gs://`, `http(s)://`), one layer.

Two halves:

- **Reading a URL** (audio, tar shards, listings): `open_url` (a seekable stream), `read_url`
  (the whole object, one GET), `url_size` (for the `max_file_bytes` check before reading),
  `url_exists`, `list_url` (one listing call). fsspec (s3fs, gcsfs, its own HTTP) does the I/O,
  imported on first use only: a run on local files never imports it. Credentials and endpoints
  come from each store's own environment variables and files (`AWS_ENDPOINT_URL`,
  `AWS_ACCESS_KEY_ID`, `~/.aws/config`, `GOOGLE_APPLICATION_CREDENTIALS`...), read by the store's
  client, never by voxmill; a URL that carries credentials (`user:pass@`) is refused, and every
  message here is made of voxmill's own words plus the URL and the error's class, so no secret
  reaches a log line, a task message, an error or `report.json`.
- **An output location** (`OutputLocation`): the folder of a run, `LocalFolder` (a file is written
  to a temporary name, fsynced and renamed: complete or absent) or `ObjectFolder` (an object is one
  PUT of the whole object, which a store makes visible complete or not at all). Both list a
  sub-folder in one call.

Errors: a missing object is `not_found`; a store that refuses (permissions, no such bucket for a
write) or cannot be reached is `store_error`. Transient failures (connection reset, timeouts,
5xx) are retried `RETRY_ATTEMPTS` times with a doubling backoff, then are `store_error`.

The URL jail (`url_within`, `check_url`) is pure: schemes compared exactly, `.` and `..` removed,
bucket (host) compared exactly, the path prefix compared on a `/` boundary. What is checked is what
is fetched, so a URL whose path a server could read differently is refused (`bad_request`), not
decoded: a percent-escape that stands for '.', '/', '\\', '%', ';' or a control character (or
starts an overlong UTF-8 sequence, %C0/%C1), a `..;` / `.;` segment (servlet containers drop the
`;...` and climb), and for HTTP a backslash. Decoding would need to guess how many times, and
with which separators, the server decodes; refusing leaves every server the same segments we
checked. HTTP redirects are refused (`forbidden_path`), never followed, and a redirect's body is
never read as the object. Every string is bounded (`max_chars`) before it is parsed.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, TypeVar

from pipeline.errors import (
    BAD_REQUEST,
    FORBIDDEN_PATH,
    NOT_FOUND,
    OUTPUT_ERROR,
    STORE_ERROR,
    UNREADABLE,
    VoxmillError,
)

if TYPE_CHECKING:
    from pipeline.paths import ConfinedPath

URL_SCHEMES = ("s3", "gs", "gcs", "http", "https")
WRITABLE_SCHEMES = ("s3", "gs", "gcs")
RETRY_ATTEMPTS = 3
RETRY_BASE_S = 0.25
# Objects up to this size are read in one GET; larger ones (a long recording read for one segment,
# a tar shard) are streamed through a read-ahead block cache of READ_BLOCK_BYTES.
WHOLE_READ_BYTES = 16 * 1024 * 1024
READ_BLOCK_BYTES = 4 * 1024 * 1024
# Exceptions that say the network hiccuped, by class name (the clients' own classes are not
# imported: they may not be installed, and a local run must not import them).
TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientConnectionError",
        "ClientConnectorError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientPayloadError",
        "TransportError",
        "ServiceUnavailable",
        "TooManyRequests",
        "InternalServerError",
        "BadGateway",
        "GatewayTimeout",
        "RetryError",
        "SlowDown",
    }
)

# Longest name, path or URL taken (the default of Settings.max_text_chars, Linux's PATH_MAX).
MAX_TEXT_CHARS = 4096
# What a percent-escape in a URL's path may not stand for: characters that would change its
# segments (or how often it must be decoded) once a server decodes it. Control characters too.
HIDDEN_BY_ESCAPES = frozenset("./\\%;")
# Lead bytes of overlong UTF-8 (%C0%AE is '.' to an old decoder); never valid UTF-8.
OVERLONG_LEADS = frozenset({0xC0, 0xC1})
_HEX = frozenset("0123456789abcdefABCDEF")

T = TypeVar("T")


# --------------------------------------------------------------------------- URLs (pure)


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


# --------------------------------------------------------------------------- errors and retries


def _kind(exc: BaseException) -> str:
    """'missing', 'refused', 'transient' or 'other' for an exception a store client raised."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, PermissionError):
        return "refused"
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & TRANSIENT_NAMES or isinstance(exc, (ConnectionError, TimeoutError)):
        return "transient"
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    if isinstance(status, int) and status >= 500:
        return "transient"
    return "other"


def store_failure(exc: BaseException, url: str, doing: str) -> VoxmillError:
    """The voxmill error for a failed store call: voxmill's own error if one is in `exc`'s cause
    chain (fsspec's HTTP `info` wraps a refused redirect in a FileNotFoundError), `not_found`, or
    `store_error` naming the URL, what was being done and the error's class (never its text,
    which may quote a request)."""
    own = _voxmill_cause(exc)
    if own is not None:
        return own
    kind = _kind(exc)
    if kind == "missing":
        return VoxmillError(NOT_FOUND, f"no such object: {url}")
    what = type(exc).__name__
    if kind == "refused":
        reason = "the store refused the request (permission denied)"
    elif kind == "transient":
        reason = f"the store could not be reached after {RETRY_ATTEMPTS} attempts"
    else:
        reason = "the store refused or failed the request"
    return VoxmillError(
        STORE_ERROR,
        f"{doing} {url}: {reason} ({what}); check the store's endpoint and credentials "
        "(AWS_ENDPOINT_URL, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS...)",
    )


def _voxmill_cause(exc: BaseException) -> VoxmillError | None:
    """The first VoxmillError in `exc`'s chain of causes and contexts (itself included)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, VoxmillError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def with_retries(
    call: Callable[[], T], url: str, doing: str, attempts: int = RETRY_ATTEMPTS, base_s: float = RETRY_BASE_S
) -> T:
    """`call()`, again after a transient failure (doubling sleeps from `base_s`), `attempts` times
    at most; any failure becomes a voxmill error (`store_failure`)."""
    for attempt in range(attempts):
        try:
            return call()
        except VoxmillError:
            raise
        except Exception as exc:  # the clients raise many unrelated classes
            if _kind(exc) != "transient" or attempt == attempts - 1:
                raise store_failure(exc, url, doing) from None
            time.sleep(base_s * 2**attempt)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- file systems


_FILESYSTEMS: dict[tuple[int, str], Any] = {}


def filesystem(scheme: str) -> Any:
    """This process's fsspec file system for `scheme` (imported and made on first use).

    Listings are never cached: the driver asks again and again whether a shard object exists.
    Keyed by process id: a forked worker makes its own (fsspec's event loop is per process).
    """
    key = (os.getpid(), scheme)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        import fsspec

        protocol = {"gs": "gcs"}.get(scheme, scheme)
        options: dict[str, Any] = {"skip_instance_cache": True}
        if protocol in ("s3", "gcs"):
            options["use_listings_cache"] = False
        if protocol in ("http", "https"):
            # Every request (HEAD, GET, ranged GET, listing) gets allow_redirects=False, and the
            # session's raise_for_status hook refuses the 3xx that aiohttp then returns as is.
            options["allow_redirects"] = False
            options["client_kwargs"] = {"raise_for_status": refuse_redirects}
        fs = fsspec.filesystem(protocol, **options)
        _FILESYSTEMS[key] = fs
    return fs


async def refuse_redirects(response: Any) -> None:
    """aiohttp's `raise_for_status` hook of voxmill's HTTP file system: a 3xx answer is
    `forbidden_path`. The roots were checked on the URL asked for, so a redirect is never
    followed and its body is never read as the object; other statuses go on to fsspec as before."""
    if 300 <= response.status < 400:
        asked = response.url.with_query(None).with_fragment(None)
        raise VoxmillError(
            FORBIDDEN_PATH,
            f"{asked} answered {response.status} (a redirect); redirects are refused, since the allowed "
            "roots are checked on the URL asked for: give the URL the object is really at",
        )


def _fs(url: str) -> tuple[Any, StoreUrl]:
    parsed = parse_url(url)
    return filesystem(parsed.scheme), parsed


def url_size(url: str) -> int:
    """The object's size in bytes (one HEAD); `not_found` or `store_error`."""
    fs, parsed = _fs(url)
    if parsed.scheme == "s3":  # HEAD only: s3fs's info() lists the prefix too after a 404
        head = with_retries(lambda: _s3_head(fs, parsed), str(parsed), "cannot stat")
        return int(head["ContentLength"])
    info = with_retries(lambda: fs.info(parsed.fs_path), str(parsed), "cannot stat")
    if info.get("type") == "directory":
        raise VoxmillError(NOT_FOUND, f"{parsed} is a prefix (a folder), not an object")
    size = info.get("size")
    if size is None:
        raise VoxmillError(STORE_ERROR, f"cannot stat {parsed}: the store gave no size")
    return int(size)


def url_exists(url: str) -> bool:
    """Whether the object exists; `store_error` when the store cannot say."""
    fs, parsed = _fs(url)

    def exists() -> bool:
        try:
            if parsed.scheme == "s3":
                _s3_head(fs, parsed)  # one HEAD, never a listing
            else:
                fs.info(parsed.fs_path)
        except FileNotFoundError:
            return False
        return True

    return with_retries(exists, str(parsed), "cannot look up")


def _s3_head(fs: Any, url: StoreUrl) -> dict[str, Any]:
    head: dict[str, Any] = fs.call_s3("head_object", Bucket=url.bucket, Key=url.key)
    return head


def fetch_checked(url: str, max_bytes: int) -> tuple[int, BinaryIO | None]:
    """(size, a seekable stream) of an object whose size is checked before its bytes are read;
    the stream is None when the object is empty or over `max_bytes` (the caller says which).

    S3: one GET, its body read only after its Content-Length was checked (HEAD + GET would be two
    requests per clip, and s3fs's whole-object read is HEAD + GET itself); an object too big to
    hold in memory is streamed with ranged GETs instead. Other stores: a HEAD, then the read.
    """
    parsed = parse_url(url)
    if parsed.scheme != "s3":
        size = url_size(url)
        return size, (open_url(url, size) if 0 < size <= max_bytes else None)
    import io

    size, data = _s3_get(parsed, min(max_bytes, WHOLE_READ_BYTES))
    if data is not None:
        return size, io.BytesIO(data)
    if 0 < size <= max_bytes:  # large: ranged reads
        return size, open_url(url, size)
    return size, None


def _s3_get(url: StoreUrl, max_bytes: int | None) -> tuple[int, bytes | None]:
    """(size, body) of one S3 GET; the body is left unread (None) when empty or over `max_bytes`."""
    from fsspec.asyn import sync

    fs = filesystem("s3")

    async def get() -> tuple[int, bytes | None]:
        response = await fs._call_s3("get_object", Bucket=url.bucket, Key=url.key)
        size = int(response["ContentLength"])
        body = response["Body"]
        try:
            if size == 0 or (max_bytes is not None and size > max_bytes):
                return size, None
            data: bytes = await body.read()
            return size, data
        finally:
            body.close()

    result: tuple[int, bytes | None] = with_retries(lambda: sync(fs.loop, get), str(url), "cannot read")
    return result


def read_url(url: str) -> bytes:
    """The whole object (one GET)."""
    fs, parsed = _fs(url)
    if parsed.scheme == "s3":  # s3fs's cat_file is HEAD + GET
        return _s3_get(parsed, None)[1] or b""
    data: bytes = with_retries(lambda: fs.cat_file(parsed.fs_path), str(parsed), "cannot read")
    return data


def open_url(url: str, size: int | None = None) -> BinaryIO:
    """A seekable binary stream over the object: the bytes in memory when it is small (one GET),
    else a read-ahead stream of ranged GETs. `size`: the object's size when already known."""
    import io

    known = url_size(url) if size is None else size
    if known <= WHOLE_READ_BYTES:
        return io.BytesIO(read_url(url))
    fs, parsed = _fs(url)
    stream: BinaryIO = with_retries(
        lambda: fs.open(parsed.fs_path, "rb", block_size=READ_BLOCK_BYTES, cache_type="readahead"),
        str(parsed),
        "cannot open",
    )
    return stream


def list_url(url: str) -> list[str]:
    """The names of the objects directly below a prefix, sorted (one listing call)."""
    fs, parsed = _fs(url)

    def names() -> list[str]:
        try:
            entries = fs.ls(parsed.fs_path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") != "directory"
        )

    return with_retries(names, str(parsed), "cannot list")


# --------------------------------------------------------------------------- output locations


@dataclass(frozen=True)
class LocalFolder:
    """A local output folder: today's files, written to a temporary name and renamed."""

    root: Path
    is_local: bool = True

    def ref(self, name: str) -> Path:
        return self.root / name if name else self.root

    def display(self, name: str = "") -> str:
        return str(self.ref(name))

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def names(self, folder: str) -> set[str]:
        try:
            with os.scandir(self.root / folder) as entries:
                return {e.name for e in entries if e.is_file() and not e.name.startswith(".")}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def writer(self, name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        from pipeline.writers import atomic_file  # today's temporary name and rename

        return atomic_file(self.root / name)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / name).unlink()

    def child(self, folder: str) -> LocalFolder:
        return LocalFolder(self.root / folder)


@dataclass(frozen=True)
class ObjectFolder:
    """A prefix in an object store: each file one object, written by one PUT of the whole object
    (a store shows an object complete or not at all), listed with one listing call."""

    url: StoreUrl
    is_local: bool = False

    def ref(self, name: str) -> str:
        return str(self.url.join(name)) if name else str(self.url)

    def display(self, name: str = "") -> str:
        return self.ref(name)

    def exists(self, name: str) -> bool:
        return url_exists(self.ref(name))

    def read_bytes(self, name: str) -> bytes:
        return read_url(self.ref(name))

    def names(self, folder: str) -> set[str]:
        return set(list_url(self.ref(folder)))

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[IO[bytes]]:
        """Spooled to a local temporary file, then PUT whole (a large one as a multipart upload,
        which the store also completes atomically); nothing is uploaded if the block fails."""
        target = self.ref(name)
        spool = tempfile.NamedTemporaryFile(prefix="voxmill-put-", delete=False)  # noqa: SIM115
        try:
            with spool:
                try:
                    yield spool
                except OSError as exc:
                    raise VoxmillError(OUTPUT_ERROR, f"cannot write {target}: {exc.strerror or exc}") from exc
            fs = filesystem(self.url.scheme)
            path = parse_url(target).fs_path
            try:
                with_retries(lambda: fs.put_file(spool.name, path), target, "cannot write")
            except VoxmillError as exc:
                raise VoxmillError(OUTPUT_ERROR, exc.message) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spool.name)

    def delete(self, name: str) -> None:
        fs = filesystem(self.url.scheme)
        path = parse_url(self.ref(name)).fs_path

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)

        with_retries(remove, self.ref(name), "cannot delete")

    def child(self, folder: str) -> ObjectFolder:
        return ObjectFolder(self.url.join(folder))


# A run's output folder: names inside it are '/'-separated and relative. Both kinds answer
# ref (a Path, or a URL string), display, exists, read_bytes, names (a sub-folder's file names,
# one listing call), writer (complete or absent), delete and child.
OutputLocation = LocalFolder | ObjectFolder


def mend_url(value: str | os.PathLike[str]) -> Path | str:
    """A URL as a string even when it went through `Path()` (`s3:/bucket/x`), else a Path (of a
    `ConfinedPath` too: an output folder is written by name)."""
    text = os.fspath(value)
    for scheme in URL_SCHEMES:
        if text.lower().startswith(f"{scheme}:/"):
            rest = text[len(scheme) + 1 :].lstrip("/")
            return f"{scheme}://{rest}"
    return value if isinstance(value, str) else Path(value)


def output_location(out: str | os.PathLike[str] | OutputLocation) -> OutputLocation:
    """The output location of a `--out` value: a URL (`s3://`, `gs://`) or a local folder."""
    if isinstance(out, (LocalFolder, ObjectFolder)):
        return out
    out = mend_url(out)
    if isinstance(out, str) and is_url(out):
        url = parse_url(out)
        if url.scheme not in WRITABLE_SCHEMES:
            raise VoxmillError(BAD_REQUEST, f"cannot write outputs to {url.scheme}:// (use s3:// or gs://)")
        return ObjectFolder(url)
    return LocalFolder(Path(out))


def location_name(out: Path | str) -> str:
    """The canonical name of an output location (a resolved path or a normalised URL): what a
    run's name and a shard spec's `out_dir` are made of."""
    out = mend_url(out)
    if isinstance(out, str) and is_url(out):
        return normalise_url(out)
    return str(Path(out).resolve())


def open_input(path: str | Path | ConfinedPath) -> BinaryIO:
    """A binary stream over a listing file or a tar shard, local or at a URL; a `ConfinedPath`
    (a worker's tar shard) is opened without a window (`pipeline.paths.open_confined`) and must be
    a regular file (a FIFO is refused without being opened: it would block the reader)."""
    if isinstance(path, str) and is_url(path):
        return open_url(path)
    from pipeline.paths import ConfinedPath, open_confined

    if not isinstance(path, ConfinedPath):
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    text = str(path)

    def regular(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise VoxmillError(UNREADABLE, f"{text} is not a regular file")

    fd = open_confined(path, regular)
    try:
        regular(os.fstat(fd))  # a FIFO swapped in after the lstat opened at once (O_NONBLOCK)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
