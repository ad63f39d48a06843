"""The Redis broker transport: kombu's, with one fault on broker outages worked around.

When a worker's broker connection drops (Redis restarted, say), Celery closes the connection and
kombu's channel then puts the worker's unacknowledged messages back on their queues. By then
kombu may already have cleared the transport's `client` (the parsed broker URL), and rebuilding
the channel's connection pool from it fails with `AttributeError: 'NoneType' object has no
attribute 'hostname'`: not a connection error, so Celery treats it as unrecoverable and the
worker process exits (seen in `tests/fault`: Redis restarted with AOF while tasks ran).

Here the channel remembers the connection parameters it was built with and uses them when the
transport has forgotten them, so the restore (or an ack) either works or fails as a connection
error, which Celery handles by reconnecting. `workers.queue.app` registers this transport for the
`redis://` and `rediss://` schemes.
"""

from __future__ import annotations

from typing import Any

import kombu.transport
import redis
from kombu.transport import redis as kombu_redis

TRANSPORT_PATH = f"{__name__}:Transport"


class Channel(kombu_redis.Channel):
    """kombu's Redis channel that keeps its broker URL after the transport dropped it."""

    _conninfo: Any = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport.client is not None:
            self._conninfo = transport.client
            params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
            return params
        if self._conninfo is None:
            raise redis.ConnectionError("the broker connection is closed")
        transport.client = self._conninfo
        try:
            params = super()._connparams(asynchronous=asynchronous)
        finally:
            transport.client = None
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel


def register() -> None:
    """Use this transport for `redis://` and `rediss://` broker URLs in this process."""
    for scheme in ("redis", "rediss"):
        kombu.transport.TRANSPORT_ALIASES[scheme] = TRANSPORT_PATH
        getattr(kombu.transport, "_transport_cache", {}).pop(scheme, None)  # resolved before: forget it
