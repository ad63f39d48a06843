"""S3 GETs without the SDK on the way: SigV4-signed requests on keep-alive connections.

A clip read from a bucket is one GET. Through s3fs, botocore builds, signs and parses each one
and aiohttp and the hand-off to fsspec's loop thread add more: about 2 ms of a worker's CPU per
clip, as much as the tiny models' compute. `DirectS3` signs the request itself (the signing key
is derived once a day), writes it on an idle keep-alive connection (kept for whichever thread
reads next, not by one thread) and reads the answer's status line and headers by hand (`Link`):
a few tenths of a millisecond.

It is used only where it asks the store exactly what the SDK would: credentials, region and
endpoint come from botocore's own resolution (`AWS_ENDPOINT_URL`, `~/.aws/config`, an instance
role: read and refreshed by botocore), addressed path-style; never behind an HTTP proxy
(`HTTPS_PROXY`...). Anything it does not expect of a bucket (a redirect to another region, an
authorization or addressing error: any status but 200, 5xx or a 404 `NoSuchKey`; a body of
unknown length) returns None, and the bucket is read through the SDK from then on
(`objects._s3_get`). A 5xx is `StoreBusy`, retried as the SDK's would be.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import re
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
TIMEOUT_S = 60.0  # botocore's own connect and read timeouts
READ_BUFFER_BYTES = 64 * 1024
MAX_LINE_BYTES = 65536
MAX_HEADERS = 100
ERROR_BODY_BYTES = 64 * 1024
MAX_IDLE_LINKS = 32  # more than a process's readers (a shard's and a merge's) ever hold at once


class Missing(Exception):
    """The store says the key does not exist (404 NoSuchKey)."""


class StoreBusy(Exception):
    """A 5xx answer: worth another attempt (`objects.with_retries` reads `status`)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: `scheme://host[:port]`, in `region`."""

    scheme: str
    host: str
    port: int | None
    region: str

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port in (None, default) else f"{self.host}:{self.port}"

    @classmethod
    def from_url(cls, url: str, region: str) -> Endpoint | None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
            return None
        return cls(parsed.scheme, parsed.hostname, parsed.port, region)


@dataclass(frozen=True)
class Answer:
    """A response's status line and the headers a GET needs."""

    status: int
    length: int | None  # Content-Length; None: not given (chunked, or until the connection closes)
    keep_alive: bool


class Link:
    """One HTTP/1.1 connection: a request written whole, its answer read by hand (http.client
    parses every header through the email package: a tenth of a millisecond of a GET's CPU)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb", buffering=READ_BUFFER_BYTES)

    @classmethod
    def open(cls, endpoint: Endpoint, context: ssl.SSLContext | None) -> Link:
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
        sock = socket.create_connection((endpoint.host, port), timeout=TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=endpoint.host)
        return cls(sock)

    def send(self, request: bytes) -> None:
        self.sock.sendall(request)

    def answer(self) -> Answer:
        line = self.reader.readline(MAX_LINE_BYTES)
        if not line:
            raise http.client.RemoteDisconnected("the store closed the connection without an answer")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise http.client.BadStatusLine(line.decode("latin-1", "replace"))
        headers: dict[bytes, bytes] = {}
        for _ in range(MAX_HEADERS):
            header = self.reader.readline(MAX_LINE_BYTES)
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.partition(b":")
            headers[name.strip().lower()] = value.strip()
        else:
            raise http.client.HTTPException("too many headers")
        length = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        close = headers.get(b"connection", b"").lower() == b"close" or parts[0] != b"HTTP/1.1"
        known = length is not None and length.isdigit() and not chunked
        return Answer(int(parts[1]), int(length) if known and length else None, not close and known)

    def read_body(self, answer: Answer, limit: int) -> bytes:
        """The body, `answer.length` bytes (at most `limit` of one of unknown length)."""
        if answer.length is None:
            some: bytes = self.reader.read(limit) or b""
            return some
        data: bytes = self.reader.read(answer.length)
        if len(data) != answer.length:
            raise http.client.IncompleteRead(data, answer.length - len(data))
        return data

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def _request(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"GET {path} HTTP/1.1", *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")


class DirectS3:
    """Signed GETs of whole objects on keep-alive connections (module docstring)."""

    def __init__(self, endpoint: Endpoint, credentials: Any) -> None:
        self.endpoint = endpoint
        self._credentials = credentials  # botocore's: frozen per request, refreshed by botocore
        self._idle: list[Link] = []  # connections that answered whole: reused by any thread
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], bytes] = {}  # (day, secret) -> signing key
        self._refused: set[str] = set()  # buckets read through the SDK
        self._context = (
            ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
            if endpoint.scheme == "https"
            else None
        )

    @classmethod
    def from_environment(cls) -> DirectS3 | None:
        """As botocore resolves the store for this process, or None where it cannot be used."""
        if any(os.environ.get(name) for name in PROXY_VARIABLES):
            return None
        try:
            import botocore.session

            session = botocore.session.get_session()
            credentials = session.get_credentials()
            if credentials is None:  # anonymous access: the SDK's unsigned requests
                return None
            client = session.create_client("s3")
            region = client.meta.region_name or "us-east-1"
            endpoint = Endpoint.from_url(client.meta.endpoint_url, region)
            client.close()
        except Exception:  # noqa: BLE001 - botocore cannot resolve the store: the SDK will say why
            return None
        return None if endpoint is None else cls(endpoint, credentials)

    def usable(self, bucket: str) -> bool:
        return bucket not in self._refused

    def get(
        self, bucket: str, key: str, max_bytes: int | None, reserve: Callable[[int], None] | None
    ) -> tuple[int, bytes | None] | None:
        """(size, body) of the object, the body None when empty or over `max_bytes` (`reserve(size)`
        is called before it is read); `Missing`; `StoreBusy`; None when the store answered what
        only the SDK may handle (the bucket is refused from then on). A connection error is
        raised (`OSError`, `http.client.HTTPException`) for the caller to retry."""
        path = "/" + urllib.parse.quote(f"{bucket}/{key}", safe="/~")
        link, answer = self._ask(path)
        served = False  # the answer was read whole: the connection may serve another request
        try:
            if answer.status != 200:
                body = link.read_body(answer, ERROR_BODY_BYTES)
                served = True
                if answer.status == 404 and b"<Code>NoSuchKey</Code>" in body:
                    raise Missing(key)
                if answer.status in (500, 502, 503, 504):
                    raise StoreBusy(answer.status)
                self._refused.add(bucket)
                return None
            size = answer.length
            if size is None:  # a body of unknown length (chunked): the SDK's to read
                self._refused.add(bucket)
                return None
            if size == 0 or (max_bytes is not None and size > max_bytes):
                served = size == 0  # an unread body: the connection cannot serve another request
                return size, None
            if reserve is not None:
                reserve(size)
            body = link.read_body(answer, size)
            served = True
            return size, body
        finally:
            if served and answer.keep_alive:
                self._give_back(link)
            else:
                link.close()

    def _ask(self, path: str) -> tuple[Link, Answer]:
        """Send the GET; its answer's status and headers. An idle connection the server has
        closed since is replaced by a new one at once, as any HTTP client does."""
        request = _request(path, self._signed_headers(path))
        for fresh in (False, True):
            link, reused = self._take(fresh)
            try:
                link.send(request)
                return link, link.answer()
            except (ConnectionError, http.client.BadStatusLine):
                link.close()
                if fresh or not reused:
                    raise
            except BaseException:
                link.close()
                raise
        raise AssertionError("unreachable")

    def _take(self, fresh: bool) -> tuple[Link, bool]:
        """An idle connection (unless `fresh`) or a new one, and whether it served a request before."""
        if not fresh:
            with self._lock:
                if self._idle:
                    return self._idle.pop(), True
        return Link.open(self.endpoint, self._context), False

    def _give_back(self, link: Link) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE_LINKS:
                self._idle.append(link)
                return
        link.close()

    def _signed_headers(self, path: str, now: datetime.datetime | None = None) -> dict[str, str]:
        """SigV4 headers of a GET of `path` (no query, no body), signed at `now` (UTC)."""
        frozen = self._credentials.get_frozen_credentials()
        now = now or datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": self.endpoint.host_header, "x-amz-content-sha256": EMPTY_SHA256}
        headers["x-amz-date"] = stamp
        if frozen.token:
            headers["x-amz-security-token"] = frozen.token
        names = ";".join(sorted(headers))
        canonical = "\n".join(
            ["GET", path, "", *(f"{n}:{headers[n]}" for n in sorted(headers)), "", names, EMPTY_SHA256]
        )
        scope = f"{day}/{self.endpoint.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._key(day, frozen.secret_key), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={frozen.access_key}/{scope}, SignedHeaders={names}, "
            f"Signature={signature}"
        )
        return headers

    def _key(self, day: str, secret: str) -> bytes:
        found = self._keys.get((day, secret))
        if found is None:
            found = ("AWS4" + secret).encode()
            for part in (day, self.endpoint.region, "s3", "aws4_request"):
                found = hmac.new(found, part.encode(), hashlib.sha256).digest()
            self._keys = {(day, secret): found}  # yesterday's key is not needed again
        return found


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def plain_bucket(bucket: str) -> bool:
    """A bucket name a path-style URL carries as it is."""
    return bool(_BUCKET.match(bucket))
