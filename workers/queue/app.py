"""The Celery app: queues, task names, the transport and every Celery option, for producers and workers.

`create_app(settings)` builds nothing but the app: producers (`workers.queue.client`, the corpus
driver) send tasks by name. A worker's entry point (`workers.worker.build_worker_app`) adds the
task handlers and the model holder to it.

The broker and the result backend are `redis://` (or `rediss://`) URLs, or `sentinel://` lists of
sentinels with the master's name in `sentinel_master_name` (`workers.queue.connections`).
"""

from __future__ import annotations

import datetime
from typing import Any

import kombu.transport
import redis
from celery import Celery
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.entity import Exchange, Queue
from kombu.transport import redis as kombu_redis

from pipeline.records import OPS
from pipeline.settings import Settings
from workers.keys import QUEUES
from workers.queue import connections, transport
from workers.queue.transport import CONTENT_TYPES

# One queue per op (`workers.keys.QUEUES`); `voxmill.shard` goes to the queue of its shard's op.
TASK_NAMES = {op: f"voxmill.{op}" for op in OPS}
SHARD_TASK = "voxmill.shard"
PLACEHOLDER_BROKER = "redis://voxmill-broker-not-configured.invalid:6379/0"
FINAL_STATES = ("SUCCESS", "FAILURE", "REVOKED")

# Store a result unless the key already holds a final one, and announce it on the key's channel
# (what Celery's `_set` does, atomically): a second execution of a job that was delivered twice
# (a producer's redelivery, a restored message) never replaces the first result.
STORE_FIRST_RESULT = """
local old = redis.call('GET', KEYS[1])
if old then
  local ok, meta = pcall(cjson.decode, old)
  if ok and type(meta) == 'table' then
    local status = meta['status']
    if status == 'SUCCESS' or status == 'FAILURE' or status == 'REVOKED' then
      return 0
    end
  end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
"""


class FirstResultWins:
    """Mixin of Celery's Redis result backends: the first final result stored for a task id stays.

    Celery itself only skips the write when it finds a SUCCESS first (a read, then a write: two
    executions finishing together may both write); this checks and writes in one script.
    """

    _store_script: Any = None

    def _set(self, key: Any, value: Any, expires: Any = None) -> None:
        if expires is None:
            expires = self.expires  # type: ignore[attr-defined]
        if isinstance(expires, datetime.timedelta):
            expires = expires.total_seconds()
        if self._store_script is None:
            self._store_script = self.client.register_script(STORE_FIRST_RESULT)  # type: ignore[attr-defined]
        self._store_script(keys=[key], args=[value, int(expires or 0)])


class PolledResults:
    """Mixin for producers that poll results in batches (`workers.queue.client`).

    Celery's own backend subscribes to a pub/sub channel for every task sent, and a broker outage
    leaves that subscription broken for good ("the Celery application must be restarted"). This
    one reads the same result keys and never subscribes.
    """

    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None


class VoxmillRedisBackend(FirstResultWins, RedisBackend):  # type: ignore[misc]
    """The Redis result backend of voxmill's apps."""


class VoxmillSentinelBackend(FirstResultWins, SentinelBackend):  # type: ignore[misc]
    """The Redis Sentinel result backend of voxmill's apps."""


class PolledRedisBackend(PolledResults, VoxmillRedisBackend):
    """The Redis result backend of a polling producer."""


class PolledSentinelBackend(PolledResults, VoxmillSentinelBackend):
    """The Redis Sentinel result backend of a polling producer."""


class SentinelChannel(transport.Channel, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel with `transport.Channel`'s fix: it finds its sentinels again after
    the transport dropped its broker URL (kombu reads them from the transport's `client`)."""

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        owner = self.connection
        if owner.client is not None:
            self._conninfo = owner.client
            return super()._sentinel_managed_pool(asynchronous)
        if self._conninfo is None:
            raise redis.ConnectionError("the broker connection is closed")
        owner.client = self._conninfo
        try:
            return super()._sentinel_managed_pool(asynchronous)
        finally:
            owner.client = None


class SentinelTransport(transport.CheckedDelivery, kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def register_transports() -> None:
    """voxmill's transports for `redis://`, `rediss://` and `sentinel://` broker URLs in this process."""
    transport.register()
    kombu.transport.TRANSPORT_ALIASES["sentinel"] = f"{__name__}:SentinelTransport"
    getattr(kombu.transport, "_transport_cache", {}).pop("sentinel", None)


def backend_url(url: str, polled: bool) -> str:
    """`url` with voxmill's result backend class for its scheme (Celery's `Class+url` form)."""
    sentinel = connections.is_sentinel(url)
    name = ("Polled" if polled else "Voxmill") + ("SentinelBackend" if sentinel else "RedisBackend")
    return f"{__name__}:{name}+{url}"


def create_app(settings: Settings, polled_results: bool = False, consumer: Any = None) -> Celery:
    """A Celery app configured from `settings`; no task handler is registered.

    Never pickle: JSON, and msgpack for raw audio bytes, are the only accepted content types.
    Nothing lost: late acks, rejection on worker loss, prefetch 1, and one visibility timeout
    (broker and result backend) longer than the longest task. `polled_results` is for producers
    that poll results themselves (see `PolledRedisBackend`); `consumer` is a worker's Celery
    consumer class (`workers.worker` gives `workers.queue.consumer.VoxmillConsumer`, which admits
    only voxmill's task messages), never imported by producers.
    """
    if settings.visibility_timeout_s <= settings.task_time_limit_s:
        raise ValueError(
            f"visibility_timeout_s ({settings.visibility_timeout_s}) must exceed task_time_limit_s "
            f"({settings.task_time_limit_s}), or long tasks are delivered twice"
        )
    register_transports()
    broker = settings.broker_url or PLACEHOLDER_BROKER
    backend = settings.result_backend_url or broker
    visibility = {"visibility_timeout": settings.visibility_timeout_s}
    app = Celery("voxmill", broker=broker, backend=backend_url(backend, polled_results), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=list(CONTENT_TYPES),
        result_accept_content=list(CONTENT_TYPES),
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            **visibility,
            "socket_keepalive": True,
            **connections.transport_options(settings, broker),
        },
        result_backend_transport_options={**visibility, **connections.transport_options(settings, backend)},
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
    if consumer is not None:
        app.conf.worker_consumer = consumer
    return app
