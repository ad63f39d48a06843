"""Writes done behind the caller: a shard's upload to a store overlaps the next shard's compute.

A PUT to a store takes 10-50 ms and more; made by the task that computed the shard, it is time
the model waits. `BackgroundWrites` runs each write on one thread of its own, in the order given,
at most `limit` of them waiting or running (a `submit` beyond that waits for the oldest to end,
so memory holds at most `limit` tables). A write says its own failures (a shard's announces it
failed); `close` waits for the writes still pending.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("voxmill.storage")


class BackgroundWrites:
    """At most `limit` writes waiting or running on one thread, in the order given."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self._slots = threading.BoundedSemaphore(limit)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voxmill-write")
        self._pending = 0
        self._idle = threading.Condition()

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` behind the caller (it says its own failures: one it raises is logged);
        waits while `limit` writes are pending."""
        self._slots.acquire()
        with self._idle:
            self._pending += 1
        try:
            self._pool.submit(self._run, write)
        except BaseException:
            self._finished()
            raise

    @property
    def pending(self) -> int:
        with self._idle:
            return self._pending

    def close(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the pending writes; True when none is left."""
        with self._idle:
            done = self._idle.wait_for(lambda: self._pending == 0, timeout_s)
        self._pool.shutdown(wait=done)
        return done

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception:  # a write that fails must not stop the writes after it
            log.exception("a background write failed")
        finally:
            self._finished()

    def _finished(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()
        self._slots.release()
