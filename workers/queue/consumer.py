"""The worker's Celery consumer: no single message can stop a worker.

Celery's task handler runs in the worker's main process, and an exception there is an
"Unrecoverable error": the worker exits, the message goes back on its queue and takes the next
worker down too. `VoxmillConsumer` (Celery's `worker_consumer`, set by `create_app`) puts
`workers.queue.admission` in front of Celery's handler and wraps it: a message is refused when
admission says so, when Celery itself refuses it (an undecodable body, an invalid eta), or when
handling it raises anything but a broker connection error (those reach Celery, which reconnects).

A refused message is rejected without requeue (never delivered again), logged as one warning
line (reason, task, id, queue, size; never the body), kept as a `DeadLetter` in the capped list
`keys.DEAD_LETTERS`, and counted (`voxmill_messages_refused_total{reason}` with a metrics port).
Keeping and counting never raise into the consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from celery.worker.consumer import Consumer
from kombu.exceptions import ContentDisallowed, DecodeError
from vine import promise as vine_promise

from pipeline.settings import Settings
from workers import keys
from workers.metrics import ConsumerMetrics, NoMetrics
from workers.queue import admission, connections
from workers.queue.admission import Admission, DeadLetter
from workers.queue.app import SHARD_TASK, TASK_NAMES

log = logging.getLogger("voxmill.consumer")

# How many refused messages `keys.DEAD_LETTERS` keeps (the newest).
DEAD_LETTERS_KEPT = 1000
DEAD_LETTER_TIMEOUT_S = 2.0
# A refusal's detail taken from an exception is cut to this many characters.
DETAIL_CHARS = 200

Refusal = tuple[str, str]  # (reason, detail)


class VoxmillConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, with admission in front of its task handler; `settings` as keyword."""

    def __init__(self, *args: Any, settings: Settings, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.admission = Admission(
            frozenset([*TASK_NAMES.values(), SHARD_TASK]),
            admission.body_limit_bytes(settings.max_payload_bytes),
        )
        self.refusal_metrics: NoMetrics = ConsumerMetrics() if settings.metrics_port else NoMetrics()
        self._dead_letters: redis.Redis | None = None

    def create_task_handler(self, promise: Any = vine_promise) -> Callable[[Any], None]:
        handle = super().create_task_handler(promise)

        def on_task_received(message: Any) -> None:
            try:
                refused = self.admit(message)
                if refused is None:
                    handle(message)
                    return
            except self.connection_errors:
                raise
            except Exception as exc:  # whatever one message does, the worker goes on
                refused = (admission.HANDLER_ERROR, brief(exc))
            self.refuse(message, *refused)

        return on_task_received

    def admit(self, message: Any) -> Refusal | None:
        """Why `message` is refused, or None: on what it claims, then on its decoded body."""
        headers, content_type = message.headers, message.content_type
        size = body_size(message.body)
        reason = self.admission.refusal(headers, content_type, size)
        if reason is None:
            try:
                body = message.decode()  # kombu keeps it: Celery's handler does not decode again
            except ContentDisallowed:
                reason = admission.UNTRUSTED_CONTENT
            except DecodeError as exc:
                return admission.UNDECODABLE, f"Can't decode message body: {brief(exc)}"
            else:
                reason = self.admission.refusal(headers, content_type, size, body)
        if reason is None:
            return None
        return reason, self.admission.explain(reason, content_type, size)

    # Celery's own refusals come here too, so that every refusal is handled alike.

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self.refuse(message, admission.UNDECODABLE, f"Can't decode message body: {brief(exc)}")

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self.refuse(message, admission.INVALID_TASK, brief(exc))

    def refuse(self, message: Any, reason: str, detail: str) -> None:
        """Reject `message` for good, then log, keep and count the refusal."""
        if not message.acknowledged:
            try:
                message.reject(requeue=False)
            except self.connection_errors:
                raise
            except Exception as exc:
                log.error("could not reject a refused message (%s): %s", reason, brief(exc))
        letter = DeadLetter.of(reason, detail, message.headers, routing_key(message), message.body)
        log.warning(
            "refused message: reason=%s task=%s id=%s queue=%s bytes=%s: %s",
            letter.reason,
            letter.task,
            letter.id,
            letter.queue,
            letter.body_bytes,
            letter.detail,
            extra={
                "reason": letter.reason,
                "task": letter.task,
                "task_id": letter.id,
                "queue": letter.queue,
                "body_bytes": letter.body_bytes,
            },
        )
        self.keep(letter)
        try:
            self.refusal_metrics.refused(reason)
        except Exception as exc:
            log.warning("could not count a refused message: %s", brief(exc))

    def keep(self, letter: DeadLetter) -> None:
        """Push `letter` onto the capped dead-letter list; a Redis error is logged, never raised."""
        try:
            if self._dead_letters is None:
                self._dead_letters = connections.broker_client(
                    self.settings,
                    socket_timeout=DEAD_LETTER_TIMEOUT_S,
                    socket_connect_timeout=DEAD_LETTER_TIMEOUT_S,
                )
            pipe = self._dead_letters.pipeline(transaction=False)
            pipe.lpush(keys.DEAD_LETTERS, letter.to_json())
            pipe.ltrim(keys.DEAD_LETTERS, 0, DEAD_LETTERS_KEPT - 1)
            pipe.execute()
        except Exception as exc:
            log.warning(
                "could not keep refused message %s in %s: %s", letter.id, keys.DEAD_LETTERS, brief(exc)
            )


def body_size(body: object) -> int | None:
    """The length of a raw message body in bytes (characters for text); None if it is neither."""
    return len(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else None


def routing_key(message: Any) -> object:
    """The queue a message came from (its routing key), whatever its delivery info holds."""
    info = message.delivery_info
    return info.get("routing_key") if isinstance(info, dict) else None


def brief(exc: BaseException) -> str:
    """An exception as `Type: message`, cut to `DETAIL_CHARS`."""
    return admission.shown(exc, DETAIL_CHARS)
