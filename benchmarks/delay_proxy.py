"""A TCP proxy on loopback that gives a local server a remote store's latency, and can drop
connections: the latency knob of the benchmarks and tests.

`DelayProxy(upstream_port, delay_ms)` listens on 127.0.0.1 (a port of its own) and forwards each
connection to 127.0.0.1:`upstream_port`. The first byte of every response is held until
`delay_ms` after the request that asked for it (a store's time to first byte; a server slower than
that adds nothing more). Like a store, it keeps the client's connection open for the next request
(each request goes upstream on a connection of its own: moto's server closes every one) when the
answer's length is known. `drop(n)`: the connections of the next `n` requests are reset,
unanswered, as soon as the request arrives (for retries). `delay_ms` may be changed while it
runs. One asyncio loop in a thread of its own; HTTP/1.1 clients send one request at a time per
connection (no pipelining), which is all it assumes.

    python -m benchmarks.delay_proxy PORT [--delay-ms N]   # one in a process of its own

`ProxyProcess` runs one in a process of its own and tells it its delay over a pipe: a benchmark
whose own process runs voxmill's driver then shares no interpreter with the proxy, as with a
remote store.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from types import TracebackType

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024


class DelayProxy:
    """A delaying, dropping TCP proxy in front of a loopback server (module docstring)."""

    def __init__(self, upstream_port: int, delay_ms: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_ms = delay_ms
        self.port = 0
        self.requests = 0  # requests forwarded (each first chunk after an answered one)
        self.dropped = 0
        self._to_drop = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> DelayProxy:
        self._thread.start()
        started = asyncio.start_server(self._serve, LOOPBACK, 0)
        self._server = asyncio.run_coroutine_threadsafe(started, self._loop).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def drop(self, requests: int) -> None:
        """Reset the connections of the next `requests` requests, unanswered, once they arrive."""
        self._loop.call_soon_threadsafe(self._add_drops, requests)

    def _add_drops(self, requests: int) -> None:
        self._to_drop += requests

    def stop(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()

        with contextlib.suppress(RuntimeError):  # already stopped
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)
        try:
            while request := await _next_request(client_reader):
                if not await self._exchange(request, client_reader, client_writer):
                    break
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            self._writers.discard(client_writer)
            client_writer.close()

    async def _exchange(
        self, request: bytes, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> bool:
        """Forward a request (its head has arrived), on a new connection upstream, and its answer;
        whether the client's connection serves another request."""
        asked = self._loop.time()
        if self._to_drop > 0:
            self._to_drop -= 1
            self.dropped += 1
            client.transport.abort()  # a reset, not an orderly close
            return False
        self.requests += 1
        upstream_reader, upstream = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        self._writers.add(upstream)
        try:
            upstream.write(request)
            fields = _fields(request)
            if _chunked(fields):  # a body of unknown length: both ways to the end, as a tunnel
                answer = self._tunnel(upstream_reader, client, asked)
                await asyncio.gather(_copy(client_reader, upstream, None), answer)
                return False
            length = int(fields.get(b"content-length", 0))
            body = asyncio.ensure_future(_copy(client_reader, upstream, length))
            serves_on = await self._answer(upstream_reader, client, asked, request.startswith(b"HEAD "))
            if not body.done():  # answered before the body was sent: the client's stream is mid-request
                body.cancel()
                return False
            await body
            return serves_on and fields.get(b"connection", b"").lower() != b"close"
        finally:
            self._writers.discard(upstream)
            upstream.close()

    async def _answer(
        self, reader: asyncio.StreamReader, client: asyncio.StreamWriter, asked: float, head_request: bool
    ) -> bool:
        """Forward the answer, its first byte not before `delay_ms` after `asked`; whether the client's
        connection serves on (an answer of known length, which ends without the upstream's close)."""
        first = True
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if first:
                await self._hold(asked)
                first = False
            status = int(head.split(None, 2)[1])
            if status >= 200:
                break
            client.write(head)  # an interim answer (100 Continue): the final one follows
        fields = _fields(head)
        length = fields.get(b"content-length")
        if head_request or status in (204, 304):
            length = b"0"
        if not head.startswith(b"HTTP/1.1 ") or length is None or _chunked(fields):
            client.write(head)  # read to the upstream's close, as the old proxy did every answer
            await _copy(reader, client, None)
            return False
        client.write(_without_close(head))
        await _copy(reader, client, int(length))
        return True

    async def _hold(self, asked: float) -> None:
        wait = asked + self.delay_ms / 1000.0 - self._loop.time()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _tunnel(self, reader: asyncio.StreamReader, client: asyncio.StreamWriter, asked: float) -> None:
        first = await reader.read(CHUNK)
        await self._hold(asked)
        client.write(first)
        await _copy(reader, client, None)
        client.close()  # the client's side of the tunnel ends with it


async def _next_request(reader: asyncio.StreamReader) -> bytes:
    """The head of the connection's next request; empty when the client has closed it."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as closed:
        if closed.partial:
            raise
        return b""


def _fields(head: bytes) -> dict[bytes, bytes]:
    """A message head's header fields, lower-cased."""
    fields: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name:
            fields[name.strip().lower()] = value.strip().lower()
    return fields


def _chunked(fields: dict[bytes, bytes]) -> bool:
    return b"chunked" in fields.get(b"transfer-encoding", b"")


def _without_close(head: bytes) -> bytes:
    """An answer's head without `Connection: close` (moto's server closes every connection; a
    store keeps it for the next request)."""
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if line.lower().replace(b" ", b"") != b"connection:close")


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int | None) -> None:
    """`length` bytes from `reader` to `writer` (None: to the end of the stream)."""
    left = length
    while left is None or left > 0:
        data = await reader.read(CHUNK if left is None else min(CHUNK, left))
        if not data:
            if left is None:
                return
            raise asyncio.IncompleteReadError(b"", left)
        writer.write(data)
        await writer.drain()
        if left is not None:
            left -= len(data)


class ProxyProcess:
    """A `DelayProxy` in a process of its own (`python -m benchmarks.delay_proxy PORT --control`),
    with the same `url`, `delay_ms` (settable) and `requests`, each a line over its pipes."""

    def __init__(self, upstream_port: int, delay_ms: float = 0.0) -> None:
        command = [sys.executable, "-m", "benchmarks.delay_proxy", str(upstream_port), "--control"]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.port = int(self._answer())
        self._delay_ms = 0.0
        self.delay_ms = delay_ms

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def delay_ms(self) -> float:
        return self._delay_ms

    @delay_ms.setter
    def delay_ms(self, value: float) -> None:
        self._ask(f"delay {value}")
        self._delay_ms = value

    @property
    def requests(self) -> int:
        return int(self._ask("requests"))

    def _ask(self, line: str) -> str:
        assert self._process.stdin is not None
        self._process.stdin.write(line + "\n")
        return self._answer()

    def _answer(self) -> str:
        assert self._process.stdout is not None
        answer = self._process.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"the delay proxy exited ({self._process.poll()})")
        return answer

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.delay_proxy UPSTREAM_PORT [--delay-ms N] [--control]`: prints its
    port, serves until it is killed (a proxy in a process of its own, whose CPU a benchmark does
    not count); with `--control`, until its input ends, answering each line of it: `delay N` (the
    new delay: "ok") or `requests` (how many were forwarded)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--control", action="store_true", help="told its delay on its input")
    args = parser.parse_args(argv)
    with DelayProxy(args.upstream_port, args.delay_ms) as proxy:
        print(proxy.port, flush=True)
        if not args.control:
            signal.pause()
        for line in sys.stdin:
            command, *value = line.split()
            if command == "delay":
                proxy.delay_ms = float(value[0])
                print("ok", flush=True)
            elif command == "requests":
                print(proxy.requests, flush=True)


if __name__ == "__main__":
    main()
