"""The workers of a corpus run as its driver sees them (`pipeline.run.shard_queue.ShardQueue`): a
cluster (`workers.corpus.cluster`) reached through Celery and Redis.

A shard goes out as one `SHARD_TASK` on its op's queue; its task announces it on the run's
channel (`keys.SHARDS_DONE_CHANNEL`). redis-py and Celery are imported once the cluster is
started: an embedded run's local workers are spawned first (`tests/unit/test_imports.py`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from pipeline.records import ShardResult, ShardSpec
from pipeline.run.shard_queue import ReadyWorkers
from workers import keys
from workers.corpus.cluster import Cluster, EmbeddedCluster, RemoteCluster
from workers.heartbeat import WorkerRecord, read_worker_records

if TYPE_CHECKING:
    import redis
    from celery import Celery

    from workers.queue.wakeups import ResultWakeups


class CeleryShardQueue:
    """A run's shards as Celery tasks on `cluster`; the driver's port (`ShardQueue`)."""

    def __init__(self, cluster: Cluster, quiet: bool = False) -> None:
        self.cluster = cluster
        self.quiet = quiet
        self.remote = isinstance(cluster, RemoteCluster)
        self.outage: tuple[type[Exception], ...] = ()
        self.client: redis.Redis | None = None  # once started: the broker (heartbeats, channels)
        self._app: Celery | None = None
        self._announcements: ResultWakeups | None = None

    def start(self) -> ReadyWorkers:
        cluster = self.cluster.start()
        local = cluster.workers.concurrency if isinstance(cluster, EmbeddedCluster) else None
        if local is not None and not self.quiet:
            print(f"extract: starting {local} local worker(s) on an embedded Redis", flush=True)
        import redis
        from kombu.exceptions import OperationalError

        from workers.queue import connections
        from workers.queue.app import create_app
        from workers.queue.wakeups import ResultWakeups

        self.outage = (redis.RedisError, OperationalError)
        settings = cluster.settings
        self._app = create_app(settings, polled_results=True)
        self.client = connections.broker_client(settings, socket_timeout=5, socket_connect_timeout=5)
        self._announcements = ResultWakeups(self.client)
        if local is not None:
            return ReadyWorkers(local, True)  # its workers hold every model the ops need
        try:
            ready = cluster.ready_workers(self.client) or None
            return ReadyWorkers(ready, all_serve_extract(self._records()))
        except redis.RedisError:
            return ReadyWorkers(None, False)

    @property
    def following(self) -> bool:
        return self._announcements is not None and self._announcements.listening

    def follow(self, run: str) -> None:
        self._started_announcements().follow([keys.SHARDS_DONE_CHANNEL.format(run=run)])

    def wait(self, timeout_s: float) -> list[ShardResult]:
        heard = self._started_announcements().wait(timeout_s)
        return [ShardResult.from_dict(json.loads(data)) for _, data in heard]

    def submit(self, spec: ShardSpec, attempt: int) -> str:
        from workers.queue.app import SHARD_TASK

        assert self._app is not None, "submit before start"
        sent = self._app.send_task(
            SHARD_TASK,
            args=[{**spec.to_dict(), "attempt": attempt}],
            queue=spec.op,
            serializer="json",
            ignore_result=True,
        )
        return str(sent.id)

    def check(self, queues: Collection[str]) -> None:
        self.cluster.check(self._client(), queues)

    def require_consumer(self, queue: str, run_queues: Sequence[str]) -> None:
        self.cluster.require_consumer(self._client(), queue, run_queues)

    def ready_workers(self) -> int:
        return self.cluster.ready_workers(self._client())

    def running_task_ids(self) -> frozenset[str]:
        from workers.queue.delivery import WorkerView

        return WorkerView.from_records(self._records()).running

    def stop(self, completed: bool = False) -> None:
        if self._announcements is not None:
            self._announcements.close()
        if self.client is not None:
            self.client.close()
        self.cluster.stop(completed=completed)

    def _client(self) -> redis.Redis:
        assert self.client is not None, "the broker before start"
        return self.client

    def _started_announcements(self) -> ResultWakeups:
        assert self._announcements is not None, "announcements before start"
        return self._announcements

    def _records(self) -> list[WorkerRecord]:
        return read_worker_records(self._client())


def all_serve_extract(records: Sequence[WorkerRecord]) -> bool:
    """Every live worker that takes tokenize or embed jobs also takes `extract` ones (and there is
    one): a run may then give each shard to one worker for both ops."""
    served = [set(record.queues) for record in records]
    takers = [queues for queues in served if queues & {"tokenize", "embed"}]
    return bool(takers) and all("extract" in queues for queues in takers)
