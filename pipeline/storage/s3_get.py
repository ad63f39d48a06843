"""S3 GETs without the SDK on the way: SigV4-signed requests on a keep-alive connection per thread.

A clip read from a bucket is one GET. Through s3fs, botocore builds, signs and parses each one
and aiohttp and the hand-off to fsspec's loop thread add more: about 2 ms of a worker's CPU per
clip, as much as the tiny models' compute. `DirectS3` signs the request itself (the signing key
is derived once a day) and sends it with `http.client` from the reading thread: a few tenths of
a millisecond.

It is used only where it asks the store exactly what the SDK would: credentials, region and
endpoint come from botocore's own resolution (`AWS_ENDPOINT_URL`, `~/.aws/config`, an instance
role: read and refreshed by botocore), addressed path-style; never behind an HTTP proxy
(`HTTPS_PROXY`...). Anything it does not expect of a bucket (a redirect to another region, an
authorization or addressing error: any status but 200, or a 404 other than `NoSuchKey`) returns
None, and the bucket is read through the SDK from then on (`objects._s3_get`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import os
import re
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
TIMEOUT_S = 60.0  # botocore's own connect and read timeouts


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


class DirectS3:
    """Signed GETs of whole objects on a keep-alive connection per thread (module docstring)."""

    def __init__(self, endpoint: Endpoint, credentials: Any) -> None:
        self.endpoint = endpoint
        self._credentials = credentials  # botocore's: frozen per request, refreshed by botocore
        self._local = threading.local()
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
        response = self._send(path)
        if response.status != 200:
            body = response.read()
            if response.status == 404 and b"<Code>NoSuchKey</Code>" in body:
                raise Missing(key)
            if response.status in (500, 502, 503, 504):
                raise StoreBusy(response.status)
            self._refused.add(bucket)
            return None
        size = int(response.getheader("Content-Length") or 0)
        if size == 0 or (max_bytes is not None and size > max_bytes):
            self._drop_connection()  # its body unread: the connection cannot serve another request
            return size, None
        try:
            if reserve is not None:
                reserve(size)
            data = response.read()
        except BaseException:
            self._drop_connection()
            raise
        if len(data) != size:
            self._drop_connection()
            raise http.client.IncompleteRead(data, size - len(data))
        return size, data

    def _send(self, path: str) -> http.client.HTTPResponse:
        """The answer's status and headers; a kept-alive connection the server has closed since
        is replaced at once, as any HTTP client does."""
        for fresh in (False, True):
            connection, reused = self._connection()
            try:
                connection.request("GET", path, headers=self._signed_headers(path))
                return connection.getresponse()
            except (ConnectionError, http.client.BadStatusLine):
                self._drop_connection()
                if fresh or not reused:
                    raise
            except BaseException:
                self._drop_connection()
                raise
        raise AssertionError("unreachable")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it served a request before."""
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is not None:
            return connection, True
        host, port = self.endpoint.host, self.endpoint.port
        if self._context is not None:
            connection = http.client.HTTPSConnection(host, port, timeout=TIMEOUT_S, context=self._context)
        else:
            connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
        self._local.connection = connection
        return connection, False

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            connection.close()

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
