"""Objects read ahead of the model: at most `in_flight` requests at once, at most `budget_bytes`
held, handed back in the order the model consumes them.

A store answers a GET 10-50 ms after it is sent; read one after another, every clip pays that in
series while the CPU waits. `prefetch` runs `fetch(url, reserve)` for the URLs ahead of its
consumer on `in_flight` threads (a thread waiting on a store waits on fsspec's event loop, with no
CPU) and yields the results strictly in the URLs' order, however they finish. Consecutive equal
URLs (segments of one recording) are fetched once. None entries (local files) yield None.

Memory: `fetch` calls `reserve(size)` before it reads an object's bytes into memory
(`pipeline.storage.objects.fetch_checked` does). Reservations are granted in URL order, when the
bytes held (every fetched object the consumer has not moved past, the one it is on included) plus
`size` fit the budget, or when nothing is held: an object larger than the budget is read, alone.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pipeline.storage.objects import Reserve

T = TypeVar("T")
MIB = 1024 * 1024


@dataclass(frozen=True)
class ReadAhead:
    """How far a shard reads ahead: `in_flight` requests at once, `budget_bytes` held at most."""

    in_flight: int = 8
    budget_bytes: int = 64 * MIB


class ReadAheadClosed(Exception):
    """The consumer stopped: a fetch waiting for room gives up."""


def runs(urls: Sequence[str | None]) -> list[tuple[str | None, int]]:
    """(url, how many consecutive entries name it) for `urls`, in order."""
    grouped: list[tuple[str | None, int]] = []
    for url in urls:
        if grouped and url is not None and grouped[-1][0] == url:
            grouped[-1] = (url, grouped[-1][1] + 1)
        else:
            grouped.append((url, 1))
    return grouped


class _Budget:
    """The bytes held by fetched runs, reserved in run order (see the module docstring)."""

    def __init__(self, limit: int, order: Sequence[int]) -> None:
        self._limit = limit
        self._waiting = deque(order)  # runs that have neither reserved nor finished, in order
        self._held: dict[int, int] = {}
        self._closed = False
        self._changed = threading.Condition()

    def reserve(self, run: int, size: int) -> None:
        with self._changed:
            if run in self._held:  # a retried read of the same object: already counted
                self._held[run] = size
                return
            self._changed.wait_for(lambda: self._closed or self._fits(run, size))
            if self._closed:
                raise ReadAheadClosed
            self._waiting.popleft()
            self._held[run] = size
            self._changed.notify_all()

    def _fits(self, run: int, size: int) -> bool:
        held = sum(self._held.values())
        return self._waiting[0] == run and (held == 0 or held + size <= self._limit)

    def finished(self, run: int) -> None:
        """`run`'s fetch ended: if it reserved nothing (an error, a streamed object), later runs
        no longer wait for it."""
        with self._changed:
            if run in self._waiting:
                self._waiting.remove(run)
                self._changed.notify_all()

    def release(self, run: int) -> None:
        with self._changed:
            self._held.pop(run, None)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def prefetch(
    urls: Sequence[str | None], fetch: Callable[[str, Reserve], T], read_ahead: ReadAhead
) -> Generator[T | None, None, None]:
    """Per entry of `urls`, in order: `fetch`'s result for it (one result for a run of equal
    URLs), None for None. An exception `fetch` raises is raised here, at its entry. Closing the
    iterator cancels the fetches not started and refuses room to those waiting for it."""
    grouped = runs(urls)
    wanted = [index for index, (url, _) in enumerate(grouped) if url is not None]
    budget = _Budget(read_ahead.budget_bytes, wanted)

    def fetch_run(index: int, url: str) -> T:
        try:
            return fetch(url, lambda size: budget.reserve(index, size))
        finally:
            budget.finished(index)

    if not wanted:
        for _, count in grouped:
            yield from [None] * count
        return
    threads = max(1, read_ahead.in_flight)  # a pool starts its threads as work comes: a few for a few
    pool = _take_readers(threads)
    futures: dict[int, Future[T]] = {
        index: pool.submit(fetch_run, index, url) for index, (url, _) in enumerate(grouped) if url is not None
    }
    try:
        for index, (url, count) in enumerate(grouped):
            result = None if url is None else futures.pop(index).result()
            for _ in range(count):
                yield result
            del result  # the consumer has moved past this run: its bytes are no longer held
            budget.release(index)
    finally:
        budget.close()
        for future in futures.values():
            future.cancel()
        _give_back_readers(threads, pool, idle=all(future.done() for future in futures.values()))


# Reader threads outlive a read-ahead: every shard would otherwise start `in_flight` threads, each
# waited for by a busy worker. A read-ahead has its pool to itself.
_IDLE_READERS: dict[tuple[int, int], list[ThreadPoolExecutor]] = {}  # (pid, threads) -> pools
_IDLE_READERS_LOCK = threading.Lock()
MAX_IDLE_POOLS = 4


def _take_readers(threads: int) -> ThreadPoolExecutor:
    with _IDLE_READERS_LOCK:
        idle = _IDLE_READERS.get((os.getpid(), threads))
        if idle:
            return idle.pop()
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="voxmill-read")


def _give_back_readers(threads: int, pool: ThreadPoolExecutor, idle: bool) -> None:
    """Keep `pool` for the next read-ahead when none of its threads is still reading (`idle`)."""
    if idle:
        with _IDLE_READERS_LOCK:
            kept = _IDLE_READERS.setdefault((os.getpid(), threads), [])
            if len(kept) < MAX_IDLE_POOLS:
                kept.append(pool)
                return
    pool.shutdown(wait=False, cancel_futures=True)
