"""The benchmarks' latency knob (`benchmarks.delay_proxy`) against a real HTTP server on loopback
that closes every connection, as moto's does: each answer held until the delay after its request,
the client's connection kept for the next request as a store keeps it, a dropped request reset;
and a proxy in a process of its own, told its delay over a pipe."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from benchmarks.delay_proxy import DelayProxy, ProxyProcess


class _Closing(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.connections += 1  # type: ignore[attr-defined]
        body = self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def do_PUT(self) -> None:
        self.server.connections += 1  # type: ignore[attr-defined]
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.send_response_only(100)
            self.end_headers()
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body[::-1])
        self.close_connection = True


@pytest.fixture
def upstream() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Closing)
    server.daemon_threads = True
    server.connections = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_answers_are_delayed_on_a_connection_kept_for_the_next_request(upstream: ThreadingHTTPServer) -> None:
    with DelayProxy(upstream.server_address[1], delay_ms=40) as proxy:
        client = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        sockets = set()
        for n in range(3):
            started = time.monotonic()
            client.request("GET", f"/clip{n}.wav")
            answer = client.getresponse()
            assert answer.read() == f"/clip{n}.wav".encode()
            assert time.monotonic() - started >= 0.04
            assert answer.getheader("Connection") is None  # the upstream's close is not passed on
            sockets.add(id(client.sock))
        client.request("PUT", "/out.parquet", body=b"shard", headers={"Expect": "100-continue"})
        assert client.getresponse().read() == b"drahs"
        sockets.add(id(client.sock))
        client.close()
        assert len(sockets) == 1 and upstream.connections == 4  # type: ignore[attr-defined]
        assert proxy.requests == 4


def test_a_dropped_request_is_reset_unanswered(upstream: ThreadingHTTPServer) -> None:
    with DelayProxy(upstream.server_address[1]) as proxy:
        proxy.drop(1)
        time.sleep(0.05)  # the drop reaches the proxy's loop
        client = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        client.request("GET", "/a.wav")
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            client.getresponse()
        client.close()
        client.request("GET", "/a.wav")  # a new connection is answered
        assert client.getresponse().read() == b"/a.wav"
        assert proxy.dropped == 1 and upstream.connections == 1  # type: ignore[attr-defined]


def test_a_proxy_in_a_process_of_its_own_is_told_its_delay_and_counts_its_requests(
    upstream: ThreadingHTTPServer,
) -> None:
    proxy = ProxyProcess(upstream.server_address[1], delay_ms=60)
    try:
        client = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        started = time.monotonic()
        client.request("GET", "/a.wav")
        assert client.getresponse().read() == b"/a.wav" and time.monotonic() - started >= 0.06
        proxy.delay_ms = 0
        client.request("GET", "/b.wav")
        assert client.getresponse().read() == b"/b.wav"
        client.close()
        assert proxy.requests == 2 and proxy.delay_ms == 0
    finally:
        proxy.stop()
