"""Signed S3 GETs without the SDK (`pipeline.storage.s3_get`): the same signature botocore makes
for the same request, and used only where botocore would ask the store the same way. Reading
real objects through it is tested against a real S3 API in tests/integration/test_object_storage.py."""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore import auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from pipeline.storage.s3_get import EMPTY_SHA256, DirectS3, Endpoint, plain_bucket

NOW = datetime.datetime(2026, 12, 6, 3, 4, 5, tzinfo=datetime.timezone.utc)


def _botocore_authorization(
    credentials: Credentials, endpoint: Endpoint, path: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    monkeypatch.setattr(auth, "get_current_datetime", lambda *a, **k: NOW.replace(tzinfo=None))
    url = f"{endpoint.scheme}://{endpoint.host_header}{path}"
    request = AWSRequest(method="GET", url=url, headers={"X-Amz-Content-SHA256": EMPTY_SHA256})
    auth.S3SigV4Auth(credentials, "s3", endpoint.region).add_auth(request)
    return str(request.headers["Authorization"])


@pytest.mark.parametrize(
    "key",
    ["clip.wav", "spk 1/utt+2=3.flac", "dir/ünï cödé/a~b_c-d.e.wav", "a%20b/(x)!*'.ogg", "deep/er/key"],
)
@pytest.mark.parametrize("token", [None, "session-token/abc=="])
@pytest.mark.parametrize(
    "endpoint",
    [
        Endpoint("http", "127.0.0.1", 9000, "us-east-1"),
        Endpoint("https", "s3.eu-west-1.amazonaws.com", None, "eu-west-1"),
    ],
)
def test_the_signature_is_botocores_for_the_same_request(
    key: str, token: str | None, endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    direct = DirectS3(endpoint, credentials)
    path = "/" + urllib.parse.quote(f"my-bucket/{key}", safe="/~")
    headers = direct._signed_headers(path, NOW)
    assert headers["authorization"] == _botocore_authorization(credentials, endpoint, path, monkeypatch)
    assert headers.get("x-amz-security-token") == token
    assert headers["host"] == endpoint.host_header


def test_the_signing_key_is_derived_once_a_day() -> None:
    direct = DirectS3(Endpoint("http", "127.0.0.1", 9000, "us-east-1"), Credentials("a", "s"))
    direct._signed_headers("/b/k", NOW)
    first = direct._keys
    direct._signed_headers("/b/k", NOW + datetime.timedelta(hours=1))
    assert direct._keys is first  # the same day: the same key, not derived again
    direct._signed_headers("/b/k", NOW + datetime.timedelta(days=1))
    assert len(direct._keys) == 1 and direct._keys is not first  # yesterday's is dropped


def test_it_is_used_only_where_botocore_would_ask_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    direct = DirectS3.from_environment()
    assert direct is not None
    assert direct.endpoint == Endpoint("http", "127.0.0.1", 9000, "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    aws = DirectS3.from_environment()
    assert aws is not None and aws.endpoint == Endpoint(
        "https", "s3.eu-west-1.amazonaws.com", None, "eu-west-1"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/under/a/path")
    assert DirectS3.from_environment() is None  # an endpoint with a path: the SDK knows what it means
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert DirectS3.from_environment() is None  # behind a proxy: the SDK's connections


@pytest.mark.parametrize(
    ("bucket", "plain"),
    [
        ("corpus", True),
        ("my.bucket-1", True),
        ("UPPER", False),
        ("a", False),
        ("x" * 64, False),
        ("a_b", False),
    ],
)
def test_only_plain_bucket_names_are_read_path_style(bucket: str, plain: bool) -> None:
    assert plain_bucket(bucket) is plain


class _KeepAliveServer:
    """A loopback HTTP/1.1 server answering every GET with its path, on connections it keeps open
    (until `close_idle()`); it counts the connections it accepted."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.open.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        # A client may reset a connection it no longer needs: that ends it, as a close would.
        with conn, conn.makefile("rb") as requests, contextlib.suppress(ConnectionResetError):
            while line := requests.readline():
                while requests.readline() not in (b"\r\n", b""):
                    pass
                body = line.split()[1]
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def close_idle(self) -> None:
        for conn in self.open:
            with contextlib.suppress(OSError):  # closed already
                conn.shutdown(socket.SHUT_RDWR)
        self.open.clear()


@pytest.fixture
def keep_alive_server() -> Iterator[_KeepAliveServer]:
    server = _KeepAliveServer()
    yield server
    server.close_idle()
    server.listener.close()


def test_connections_outlive_the_threads_that_used_them(keep_alive_server: _KeepAliveServer) -> None:
    credentials = Credentials("AKIDEXAMPLE", "secret")
    direct = DirectS3(Endpoint("http", "127.0.0.1", keep_alive_server.port, "us-east-1"), credentials)

    def get(key: str) -> bytes | None:
        answer = direct.get("corpus", key, None, None)
        assert answer is not None
        return answer[1]

    for shard in range(3):  # a shard's read-ahead threads end with it; its connections do not
        with ThreadPoolExecutor(max_workers=1) as readers:
            assert readers.submit(get, f"s{shard}.wav").result() == f"/corpus/s{shard}.wav".encode()
    assert keep_alive_server.accepted == 1
    barrier = threading.Barrier(2)

    def get_together(key: str) -> bytes | None:
        barrier.wait()
        return get(key)

    with ThreadPoolExecutor(max_workers=2) as readers:
        assert sorted(readers.map(get_together, ["a", "b"])) == [b"/corpus/a", b"/corpus/b"]  # type: ignore[type-var]
    assert keep_alive_server.accepted in (1, 2)  # the second GET may find the first's connection idle
    keep_alive_server.close_idle()  # the server ends the idle connections: the next GETs make new ones
    accepted = keep_alive_server.accepted
    assert get("after") == b"/corpus/after"
    assert keep_alive_server.accepted == accepted + 1
