"""The Celery app: queues, task names, the transport and every Celery option, for producers and workers.

`create_app(settings)` builds nothing but the app: producers (`workers.queue.client`, the corpus
driver) send tasks by name. A worker's entry point (`workers.worker.build_worker_app`) adds the
task handlers and the model holder to it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.backends.redis import RedisBackend
from kombu.entity import Exchange, Queue

from pipeline.records import OPS
from pipeline.settings import Settings
from workers.keys import QUEUES
from workers.queue import transport

# One queue per op (`workers.keys.QUEUES`); `voxmill.shard` goes to the queue of its shard's op.
TASK_NAMES = {op: f"voxmill.{op}" for op in OPS}
SHARD_TASK = "voxmill.shard"
PLACEHOLDER_BROKER = "redis://voxmill-broker-not-configured.invalid:6379/0"


class PolledRedisBackend(RedisBackend):  # type: ignore[misc]
    """The Redis result backend for producers that poll results in batches (`workers.queue.client`).

    Celery's own backend subscribes to a pub/sub channel for every task sent, and a broker outage
    leaves that subscription broken for good ("the Celery application must be restarted"). This
    one reads the same result keys and never subscribes.
    """

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None


def create_app(settings: Settings, polled_results: bool = False) -> Celery:
    """A Celery app configured from `settings`; no task handler is registered.

    Never pickle: JSON, and msgpack for raw audio bytes, are the only accepted content types.
    Nothing lost: late acks, rejection on worker loss, prefetch 1, and one visibility timeout
    (broker and result backend) longer than the longest task. `polled_results` is for
    producers that poll results themselves (see `PolledRedisBackend`).
    """
    if settings.visibility_timeout_s <= settings.task_time_limit_s:
        raise ValueError(
            f"visibility_timeout_s ({settings.visibility_timeout_s}) must exceed task_time_limit_s "
            f"({settings.task_time_limit_s}), or long tasks are delivered twice"
        )
    transport.register()
    broker = settings.broker_url or PLACEHOLDER_BROKER
    backend = settings.result_backend_url or broker
    if polled_results:
        backend = f"{__name__}:PolledRedisBackend+{backend}"
    visibility = {"visibility_timeout": settings.visibility_timeout_s}
    app = Celery("voxmill", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json", "msgpack"],
        result_accept_content=["json", "msgpack"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={**visibility, "socket_keepalive": True},
        result_backend_transport_options=dict(visibility),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        redis_retry_on_timeout=True,
        redis_socket_timeout=10.0,
        redis_socket_connect_timeout=5.0,
        redis_socket_keepalive=True,
        result_expires=settings.result_expires_s,
        # A result that cannot be stored during a broker outage is retried, not turned into a failure.
        result_backend_always_retry=True,
        result_backend_max_retries=30,
        result_backend_base_sleep_between_retries_ms=200,
        result_backend_max_sleep_between_retries_ms=10_000,
        result_extended=False,
        task_time_limit=settings.task_time_limit_s,
        task_soft_time_limit=max(1, settings.task_time_limit_s - 30),
        task_routes={name: {"queue": op} for op, name in TASK_NAMES.items()},
        task_queues=[Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES],
        task_default_queue="tokenize",
        task_track_started=False,
        worker_proc_alive_timeout=settings.worker_proc_alive_timeout_s,
        worker_max_memory_per_child=settings.worker_max_memory_per_child_kb or None,
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app
