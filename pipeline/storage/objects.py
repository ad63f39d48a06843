"""Objects in a store (`s3://`, `gs://`, `http(s)://`) read as files are, with retries.

`open_url` (a seekable stream), `read_url` (the whole object, one GET), `url_size` (for the
`max_file_bytes` check before reading), `fetch_checked` (size checked before the bytes),
`url_exists`, `list_url` (one listing call), and `open_input` for a listing file or tar shard
local or at a URL. fsspec (s3fs, gcsfs, its own HTTP) does the I/O, imported on first use only: a
run on local files never imports it; but the GET of a whole S3 object (a clip, a shard file) is
signed and sent by the reading thread itself (`pipeline.storage.s3_get`), where that asks the
store exactly what the SDK would. Credentials and endpoints come from each store's own
environment variables and files (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `~/.aws/config`,
`GOOGLE_APPLICATION_CREDENTIALS`...), read by the store's client, never by voxmill; every message
here is made of voxmill's own words plus the URL and the error's class, so no secret reaches a
log line, a task message, an error or `report.json`.

Errors: a missing object is `not_found`; a store that refuses (permissions, no such bucket for a
write) or cannot be reached is `store_error`. Transient failures (connection reset, timeouts,
5xx) are retried `RETRY_ATTEMPTS` times with a doubling backoff, then are `store_error`. HTTP
redirects are refused (`forbidden_path`), never followed, and a redirect's body is never read as
the object.
"""

from __future__ import annotations

import os
import posixpath
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from pipeline.errors import FORBIDDEN_PATH, NOT_FOUND, STORE_ERROR, UNREADABLE, VoxmillError
from pipeline.storage.paths import ConfinedPath, open_confined
from pipeline.storage.s3_get import DirectS3, Missing, plain_bucket
from pipeline.storage.urls import StoreUrl, is_url, parse_url

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
        "IncompleteRead",
        "BadStatusLine",
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


T = TypeVar("T")
# Told an object's size before its bytes are read into memory: a reader that bounds what it holds
# (`pipeline.storage.prefetch`) waits there.
Reserve = Callable[[int], None]


# --------------------------------------------------------------------------- errors and retries


def _kind(exc: BaseException) -> str:
    """'missing', 'refused', 'transient' or 'other' for an exception a store client raised.

    fsspec's HTTP `info` raises FileNotFoundError for any failed HEAD-then-GET: its cause says
    whether the object is missing (404, 410) or the server failed (5xx, a dropped connection).
    """
    if isinstance(exc, FileNotFoundError):
        cause = exc.__cause__
        if cause is None or isinstance(cause, FileNotFoundError):
            return "missing"
        status = getattr(cause, "status", None)
        if isinstance(status, int) and status in (404, 410):
            return "missing"
        inner = _kind(cause)
        return "missing" if inner == "other" and not isinstance(status, int) else inner
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
_FILESYSTEMS_LOCK = threading.Lock()


def filesystem(scheme: str) -> Any:
    """This process's fsspec file system for `scheme` (imported and made on first use).

    Listings are never cached: the driver asks again and again whether a shard object exists.
    Keyed by process id: a forked worker makes its own (fsspec's event loop is per process).
    Made under a lock with its client session, since reads in flight call it from several threads.
    """
    return _made_once(scheme, lambda: _new_filesystem(scheme))


def _direct_s3() -> DirectS3 | None:
    """This process's signed S3 reader (`pipeline.storage.s3_get`), made on first use and kept
    beside the file systems (None where it cannot be used)."""
    direct: DirectS3 | None = _made_once("s3:direct", DirectS3.from_environment)
    return direct


def _made_once(name: str, make: Callable[[], Any]) -> Any:
    """What `make()` gave in this process under `name`: made once, under the lock."""
    key = (os.getpid(), name)
    if key not in _FILESYSTEMS:
        with _FILESYSTEMS_LOCK:
            if key not in _FILESYSTEMS:
                _FILESYSTEMS[key] = make()
    return _FILESYSTEMS[key]


def _new_filesystem(scheme: str) -> Any:
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
    if protocol in ("s3", "http", "https"):
        # Made lazily by the first request otherwise, and twice by two concurrent first requests.
        from fsspec.asyn import sync

        sync(fs.loop, fs.set_session)
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


def fetch_checked(url: str, max_bytes: int, reserve: Reserve | None = None) -> tuple[int, BinaryIO | None]:
    """(size, a seekable stream) of an object whose size is checked before its bytes are read;
    the stream is None when the object is empty or over `max_bytes` (the caller says which).

    S3: one GET, its body read only after its Content-Length was checked (HEAD + GET would be two
    requests per clip, and s3fs's whole-object read is HEAD + GET itself); an object too big to
    hold in memory is streamed with ranged GETs instead. Other stores: a HEAD, then the read.
    `reserve(size)` is called before an object's bytes are read into memory (not for a streamed one).
    """
    parsed = parse_url(url)
    if parsed.scheme != "s3":
        size = url_size(url)
        if not 0 < size <= max_bytes:
            return size, None
        if reserve is not None and size <= WHOLE_READ_BYTES:
            reserve(size)
        return size, open_url(url, size)
    import io

    size, data = _s3_get(parsed, min(max_bytes, WHOLE_READ_BYTES), reserve)
    if data is not None:
        return size, io.BytesIO(data)
    if 0 < size <= max_bytes:  # large: ranged reads
        return size, open_url(url, size)
    return size, None


def _s3_get(url: StoreUrl, max_bytes: int | None, reserve: Reserve | None = None) -> tuple[int, bytes | None]:
    """(size, body) of one S3 GET; the body is left unread (None) when empty or over `max_bytes`.
    `reserve(size)` is called in this thread, between the answer and its body. Signed and sent
    by this thread (`pipeline.storage.s3_get`) where that asks the store what the SDK would;
    else through s3fs, off fsspec's loop."""
    direct = _direct_s3()
    if direct is not None and direct.usable(url.bucket) and plain_bucket(url.bucket):

        def direct_get() -> tuple[int, bytes | None] | None:
            try:
                return direct.get(url.bucket, url.key, max_bytes, reserve)
            except Missing:
                raise FileNotFoundError(str(url)) from None

        got = with_retries(direct_get, str(url), "cannot read")
        if got is not None:
            return got
    return _s3_sdk_get(url, max_bytes, reserve)


def _s3_sdk_get(url: StoreUrl, max_bytes: int | None, reserve: Reserve | None) -> tuple[int, bytes | None]:
    from fsspec.asyn import sync

    fs = filesystem("s3")

    async def answer() -> tuple[int, Any]:
        """The object's size and its unread body (None, and closed, when it will not be read)."""
        response = await fs._call_s3("get_object", Bucket=url.bucket, Key=url.key)
        size, body = int(response["ContentLength"]), response["Body"]
        if size == 0 or (max_bytes is not None and size > max_bytes):
            body.close()
            return size, None
        return size, body

    async def read(body: Any) -> bytes:  # on the loop: aiohttp's response is not thread-safe
        try:
            data: bytes = await body.read()
            return data
        finally:
            body.close()

    async def close(body: Any) -> None:
        body.close()

    async def whole() -> tuple[int, bytes | None]:  # one hand-off to the loop when nothing waits between
        size, body = await answer()
        return size, (None if body is None else await read(body))

    def get() -> tuple[int, bytes | None]:
        if reserve is None:
            done: tuple[int, bytes | None] = sync(fs.loop, whole)
            return done
        size, body = sync(fs.loop, answer)
        if body is None:
            return size, None
        try:
            if reserve is not None:
                reserve(size)
        except BaseException:
            sync(fs.loop, close, body)
            raise
        return size, sync(fs.loop, read, body)

    return with_retries(get, str(url), "cannot read")


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


def list_url(url: str, folders: bool = False) -> list[str]:
    """The names of the objects directly below a prefix, sorted (one listing call); with
    `folders`, those of the prefixes below it too, each ending in '/'."""
    fs, parsed = _fs(url)

    def names() -> list[str]:
        try:
            entries = _ls(fs, parsed.fs_path)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry.get("type") != "directory":
                found.append(name)
            elif folders:
                found.append(f"{name}/")
        return sorted(found)

    return with_retries(names, str(parsed), "cannot list")


def _ls(fs: Any, path: str) -> list[dict[str, Any]]:
    """fsspec's detailed `ls` of a prefix. s3fs's lists the parent prefix too when this one holds
    nothing (to tell an object of that name from nothing, the same to a caller here): a new run's
    folder would cost two listings, the second as long as its parent's."""
    if type(fs).__module__.split(".")[0] == "s3fs":
        from fsspec.asyn import sync

        entries: list[dict[str, Any]] = sync(fs.loop, fs._lsdir, path.rstrip("/"))
        return entries
    return list(fs.ls(path, detail=True))


# --------------------------------------------------------------------------- listing files and tar shards


def open_input(path: str | Path | ConfinedPath) -> BinaryIO:
    """A binary stream over a listing file or a tar shard, local or at a URL; a `ConfinedPath`
    (a worker's tar shard) is opened without a window (`pipeline.storage.paths.open_confined`)
    and must be a regular file (a FIFO is refused without being opened: it would block the reader)."""
    if isinstance(path, str) and is_url(path):
        return open_url(path)
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
