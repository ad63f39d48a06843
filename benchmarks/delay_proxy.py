"""A TCP proxy on loopback that gives a local server a remote store's latency, and can drop
connections: the latency knob of the benchmarks and tests.

`DelayProxy(upstream_port, delay_ms)` listens on 127.0.0.1 (a port of its own) and forwards each
connection to 127.0.0.1:`upstream_port`. The first byte of every response is held until
`delay_ms` after the request that asked for it (a store's time to first byte; a server slower than
that adds nothing more). `drop(n)`: the next `n` connections are closed, unanswered, as soon as
their first request arrives (a connection reset, for retries). `delay_ms` may be changed while it
runs. One asyncio loop in a thread of its own; HTTP/1.1 clients send one request at a time per
connection, which is all it assumes.
"""

from __future__ import annotations

import asyncio
import contextlib
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

    def drop(self, connections: int) -> None:
        """Close the next `connections` connections, unanswered, once their request arrives."""
        self._loop.call_soon_threadsafe(self._add_drops, connections)

    def _add_drops(self, connections: int) -> None:
        self._to_drop += connections

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
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(LOOPBACK, self.upstream_port)
        except OSError:
            client_writer.close()
            return
        self._writers.update((client_writer, upstream_writer))
        asked: list[float] = []  # when the request now waiting for its answer was sent
        try:
            await asyncio.gather(
                self._requests(client_reader, upstream_writer, client_writer, asked),
                self._responses(upstream_reader, client_writer, asked),
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_writer, upstream_writer):
                self._writers.discard(writer)
                writer.close()

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        upstream: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        asked: list[float],
    ) -> None:
        while data := await reader.read(CHUNK):
            if not asked:  # the first bytes of a request
                if self._to_drop > 0:
                    self._to_drop -= 1
                    self.dropped += 1
                    upstream.close()
                    client.transport.abort()  # a reset, not an orderly close
                    return
                self.requests += 1
                asked.append(self._loop.time())
            upstream.write(data)
            await upstream.drain()
        upstream.close()

    async def _responses(
        self, reader: asyncio.StreamReader, client: asyncio.StreamWriter, asked: list[float]
    ) -> None:
        while data := await reader.read(CHUNK):
            if asked:  # the first bytes of an answer: not before delay_ms after its request
                wait = asked.pop() + self.delay_ms / 1000.0 - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
            client.write(data)
            await client.drain()
        client.close()
