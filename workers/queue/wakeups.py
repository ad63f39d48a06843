"""Wake-ups when results are stored: Redis pub/sub on the result keys' own channels.

Celery's Redis backend publishes each stored result on a channel named as its key, and a shard
task publishes its report the same way (`workers.queue.tasks.Runner.report_shard`). Whoever waits for
results (the producer client, the corpus driver) listens and reads as soon as something is
announced, instead of sleeping between reads; it still reads everything now and then, so a lost
announcement costs a little time, never a result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from pipeline import tuning


class ResultWakeups:
    """Says which results were just stored (Redis pub/sub on the result keys).

    Only a hint of what to read now: a result itself is always read from where it is kept. Any
    Redis trouble drops the subscription (`listening` turns False) until `follow` is called again.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.pubsub: Any = None

    @property
    def listening(self) -> bool:
        return self.pubsub is not None

    def follow(self, keys: Sequence[Any]) -> None:
        """Listen on `keys` (before reading them, so no announcement falls in between)."""

        def subscribe(pubsub: Any) -> None:
            for start in range(0, len(keys), tuning.SUBSCRIBE_BATCH):
                pubsub.subscribe(*keys[start : start + tuning.SUBSCRIBE_BATCH])

        self._listen(subscribe)

    def _listen(self, subscribe: Callable[[Any], None]) -> None:
        """A new subscription in place of the old one; none when Redis is in trouble."""
        try:
            self.close()
            self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            subscribe(self.pubsub)
        except (redis.RedisError, OSError):
            self.close()

    def wait(self, timeout_s: float) -> list[tuple[Any, Any]]:
        """The (channel, data) announcements from now until the first one, or after `timeout_s` (none)."""
        if self.pubsub is None:
            time.sleep(timeout_s)
            return []
        deadline = time.monotonic() + timeout_s
        announced: list[tuple[Any, Any]] = []
        try:
            while not announced and (left := deadline - time.monotonic()) > 0:
                message = self.pubsub.get_message(timeout=left)
                while message is not None:  # several results at once: one read serves them all
                    announced.append((message["channel"], message["data"]))
                    message = self.pubsub.get_message(timeout=0)
        except (redis.RedisError, OSError, ValueError):
            self.close()
        return announced

    def close(self) -> None:
        if self.pubsub is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                self.pubsub.close()
        self.pubsub = None
