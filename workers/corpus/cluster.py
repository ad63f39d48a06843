"""Where a corpus run's shards are done: workers anywhere on a broker, or a cluster of its own.

The driver asks a cluster four things: its settings (the broker), how many worker processes
are ready (how many shards to keep in flight), whether a queue has a consumer before its first
shard goes there (`require_consumer`), and whether it can still do the work (`check`, which
raises `RunError` when it cannot); and it tells it to `stop` once every shard file exists.

- `RemoteCluster`: `VOXMILL_BROKER_URL` is set; workers anywhere take the shards. A queue of the
  run that no live worker consumes stops it (`NoRunConsumer`, code `no_consumer`): at once before
  its first shard, as `voxmill submit` does, and after `consumer_grace_s` when every consumer of a
  queue its shards wait in is gone mid-run (the decisions: `workers.queue.delivery.consumers_gone`).
- `EmbeddedCluster`: no broker; a private Redis and local worker processes, spawned as soon as
  the corpus is read (a worker takes a second or more to import its code and load its models,
  time the run fills with probing the corpus and submitting the first shards, which wait in the
  queue), stopped at the end.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import tuning
from pipeline.errors import NO_CONSUMER, RunError, VoxmillError
from pipeline.models.registry import Registry
from pipeline.outputs.folder import RunFolder
from pipeline.records import ROLES_BY_OP
from pipeline.settings import Settings
from workers.embedded import EmbeddedRedis, LocalWorkers, ProcessExited
from workers.heartbeat import count_ready_workers, read_worker_records
from workers.queue.delivery import WorkerView, consumers_gone, no_consumer_message, start_command

if TYPE_CHECKING:  # redis-py and Celery are imported once the local workers are spawned
    import redis


class NoRunConsumer(RunError):
    """A run's shards go to queues no live worker consumes (code `no_consumer`): which, and the
    command that starts a worker for each."""

    def __init__(self, queues: Sequence[str], message: str) -> None:
        super().__init__(message, NO_CONSUMER)
        self.queues = tuple(queues)


class RemoteCluster:
    """Workers anywhere on the configured broker; the run neither starts nor stops them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._required: set[str] = set()  # queues found served before their first shard
        self._absent: dict[str, tuple[float, float]] = {}  # queue -> (since, last look) without one
        self._looked_at = -float("inf")

    def start(self) -> RemoteCluster:
        """`RunError` at once when the broker does not answer (an outage later is ridden out)."""
        import redis

        from workers.queue import connections

        client = connections.broker_client(self.settings, socket_timeout=5, socket_connect_timeout=5)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise RunError(
                f"cannot reach the broker at {self.settings.redacted_broker_url()}: {exc}"
            ) from None
        finally:
            client.close()
        return self

    def ready_workers(self, client: redis.Redis) -> int:
        return count_ready_workers(client)

    def require_consumer(self, client: redis.Redis, queue: str, run_queues: Sequence[str] = ()) -> None:
        """Before the first shard goes to `queue`: `NoRunConsumer` unless a live worker consumes it,
        naming every queue of `run_queues` without one. A queue found without one is looked at for
        a heartbeat interval first, as `voxmill submit` does (records return that soon after a
        Redis restart)."""
        if queue in self._required:
            return
        confirm_s = self.settings.heartbeat_interval_s + tuning.CONSUMER_CONFIRM_MARGIN_S
        absent: dict[str, tuple[float, float]] = {}
        while True:
            view = WorkerView.from_records(read_worker_records(client))
            absent, gone = consumers_gone([queue, *run_queues], view, absent, time.monotonic(), confirm_s)
            if queue not in absent:
                self._required.add(queue)
                return
            if queue in gone:
                again = "this run's shards go there; run the same command again once one is up (it resumes)"
                raise NoRunConsumer(gone, f"{no_consumer_message(gone)}; {again}")
            time.sleep(tuning.RESULT_POLL_S)

    def check(self, client: redis.Redis, queues: Collection[str] = ()) -> None:
        """`NoRunConsumer` when no live worker has consumed one of `queues` (where the shards in
        flight wait) for `consumer_grace_s`. Workers may come and go within it: late shards are
        submitted again."""
        grace_s = self.settings.consumer_grace_s
        now = time.monotonic()
        if now - self._looked_at < min(tuning.CONSUMERS_LOOK_S, grace_s / 2):
            return
        self._looked_at = now
        view = WorkerView.from_records(read_worker_records(client))
        self._absent, gone = consumers_gone(queues, view, self._absent, now, grace_s)
        if gone:
            said = "; ".join(
                f"no live worker has consumed the {q} queue for {grace_s:g} s (consumer_grace_s), and "
                f"this run's shards wait there: start one with {start_command(q)}"
                for q in gone
            )
            raise NoRunConsumer(gone, f"{said}; then run the same command again (it resumes)")

    def stop(self, completed: bool = False) -> None:
        """Nothing of the run's own to stop."""


class EmbeddedCluster:
    """An embedded Redis and `workers` local worker processes for one run."""

    def __init__(
        self,
        settings: Settings,
        folders: Sequence[Path],
        out_dir: RunFolder,
        ops: Sequence[str],
        workers: int,
        url_prefixes: Sequence[str] = (),
    ) -> None:
        """`folders` and `url_prefixes`: where the corpus's audio is (`pipeline.corpus.roots.corpus_roots`):
        the run's own workers may read there, as the person running it chose those files. An
        object-store `out_dir` is allowed as a URL prefix; `workers.log` then goes to the run's
        local state folder (`RunFolder.local_state`).

        The folders may be thousands (one per speaker or chapter): they reach the workers in a
        file of this run's private temporary folder (`allowed_roots_file`, with any the settings
        name), not in `VOXMILL_ALLOWED_ROOTS`, which would overflow the environment."""
        check_models(settings, ops)
        self.redis = EmbeddedRedis()
        self._private = tempfile.TemporaryDirectory(prefix="voxmill-run-")  # mode 0700
        url_roots = (*settings.allowed_url_roots, *url_prefixes)
        roots = tuple(settings.allowed_roots)
        if out_dir.is_local:
            roots = (*roots, Path(out_dir.name))
        else:
            url_roots = (*url_roots, out_dir.name)
        try:
            listed = [*settings.roots_from_file(), *folders]
        except (OSError, ValueError) as exc:
            raise RunError(f"cannot read allowed_roots_file: {exc}") from None
        roots = (*roots, *(f for f in listed if "\n" in str(f)))  # a line of the file cannot hold it
        roots_file = write_roots_file(Path(self._private.name), [f for f in listed if "\n" not in str(f)])
        update = {
            "broker_url": self.redis.url,
            "allowed_roots": roots,
            "allowed_url_roots": url_roots,
            "allowed_roots_file": roots_file,
        }
        self.settings = settings.model_copy(update=update)
        self.workers = LocalWorkers(
            self.settings, workers, queues=list(ops), log_path=out_dir.workers_log(settings.run_state_dir)
        )
        self._ready = False
        self._started_at = 0.0

    def start(self) -> EmbeddedCluster:
        """Spawn Redis and the workers; return once Redis answers (the workers keep starting)."""
        self.redis.spawn()
        self.workers.start()
        self._started_at = time.monotonic()
        try:
            self.redis.wait_up()
        except (TimeoutError, ProcessExited) as exc:
            self.stop()
            raise RunError(f"cannot start the embedded Redis: {exc}") from None
        return self

    def ready_workers(self, client: redis.Redis) -> int:
        return self.workers.concurrency if self._ready else self.workers.ready_count(client)

    def require_consumer(self, client: redis.Redis, queue: str, run_queues: Sequence[str] = ()) -> None:
        """Its own workers consume every queue of the run (`check` watches them)."""

    def check(self, client: redis.Redis, queues: Collection[str] = ()) -> None:
        """`RunError` if the local workers exited, or have not loaded their models in time."""
        timeout_s = self.settings.local_ready_timeout_s
        try:
            self.workers.check_running()
            if not self._ready:
                self._ready = self.workers.ready(client)
            if not self._ready and time.monotonic() - self._started_at > timeout_s:
                raise TimeoutError(
                    f"the local workers did not load their models within {timeout_s:g} s; "
                    f"see {self.workers.log_path}"
                )
        except (TimeoutError, ProcessExited) as exc:
            raise RunError(exc.message if isinstance(exc, VoxmillError) else str(exc)) from None

    def stop(self, completed: bool = False) -> None:
        """Stop the workers and Redis (again: nothing). Once every shard file exists nothing is in
        flight, so the workers are killed at once; otherwise they get up to 5 s of warm shutdown
        (shards are idempotent: one cut short runs again on resume)."""
        self.workers.stop(timeout_s=0.0 if completed else 5.0)
        self.redis.stop()
        self._private.cleanup()


Cluster = RemoteCluster | EmbeddedCluster


def write_roots_file(folder: Path, roots: Sequence[Path]) -> Path:
    """`folder/allowed-roots.txt`: one root per line, readable and writable by this user only."""
    path = folder / "allowed-roots.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as file:  # any folder name
        file.write("".join(f"{root}\n" for root in roots))
    return path


def check_models(settings: Settings, ops: Sequence[str]) -> None:
    """Fail early, with the fix, when the model folder lacks a model the ops need."""
    registry = Registry.load()
    for role in dict.fromkeys(r for op in ops for r in ROLES_BY_OP[op]):
        try:
            registry.find_model(role, settings.model_dir)
        except VoxmillError as exc:
            raise RunError(exc.message) from None
