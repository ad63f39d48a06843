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

It also drops what is no message at all: an item pushed onto a queue list that is not kombu's
JSON envelope (`envelope_refusal`) would raise inside kombu's read loop, stopping the
worker or passing for a lost connection; it is logged once and dropped (BRPOP already took it
off the list), and the worker reads on.
"""

from __future__ import annotations

import logging
from queue import Empty
from typing import Any

import kombu.transport
import redis
from kombu.transport import redis as kombu_redis

TRANSPORT_PATH = f"{__name__}:Transport"
# What voxmill's messages and results are (kombu's names for Celery's `json` and `msgpack`):
# never pickle.
CONTENT_TYPES = ("application/json", "application/x-msgpack")
# The refusal reason of a queue item that is no kombu envelope (`workers.queue.admission.REASONS`).
NOT_AN_ENVELOPE = "not_an_envelope"
log = logging.getLogger("voxmill.consumer")


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

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return bool(super()._brpop_read(**options))
        except (Empty, *self.connection_errors):
            raise
        except Exception as exc:  # not JSON, or a body kombu cannot decode
            dropped(f"{type(exc).__name__}: {str(exc)[:200]}")
            return True


def dropped(why: str) -> None:
    log.warning(
        "refused message: reason=%s: an item on a queue list is no kombu message (%s); dropped",
        NOT_AN_ENVELOPE,
        why,
    )


def envelope_refusal(payload: object) -> str | None:
    """`NOT_AN_ENVELOPE` unless `payload` (a queue item as parsed JSON) has the shape kombu's Redis
    transport reads before any consumer sees it; kombu would raise on anything else."""
    if not isinstance(payload, dict) or not isinstance(payload.get("properties"), dict):
        return NOT_AN_ENVELOPE
    properties = payload["properties"]
    info = properties.get("delivery_info")
    fields = (
        isinstance(properties.get("delivery_tag"), str)
        and isinstance(info, dict)
        and all(isinstance(info.get(key), str) for key in ("exchange", "routing_key"))
        and properties.get("body_encoding") in (None, "base64")
        and isinstance(payload.get("body", ""), (str, bytes))
        and isinstance(payload.get("headers"), (dict, type(None)))
        and isinstance(payload.get("content-type"), (str, type(None)))
        and isinstance(payload.get("content-encoding"), (str, type(None)))
    )
    return None if fields else NOT_AN_ENVELOPE


class CheckedDelivery:
    """A transport that delivers only what has the shape of kombu's envelope."""

    def _deliver(self, message: Any, queue: str) -> None:
        if envelope_refusal(message) is not None:
            dropped("not the shape of an envelope")
            return
        super()._deliver(message, queue)  # type: ignore[misc]


class Transport(CheckedDelivery, kombu_redis.Transport):
    Channel = Channel


def register() -> None:
    """Use this transport for `redis://` and `rediss://` broker URLs in this process."""
    for scheme in ("redis", "rediss"):
        kombu.transport.TRANSPORT_ALIASES[scheme] = TRANSPORT_PATH
        getattr(kombu.transport, "_transport_cache", {}).pop(scheme, None)  # resolved before: forget it
