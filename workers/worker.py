"""A voxmill worker: the Celery app with its task handlers, and what each worker process holds.

`build_worker_app(settings)` is the one place a worker is put together: `create_app` (queues,
task names), the task handlers (`workers.queue.tasks`) and a `WorkerProcess`, whose models are
loaded in every pool process after the fork (or in the main process of a solo/threads worker).
`voxmill worker`, `celery -A workers.app worker` and `python -m workers.worker` (what local
clusters start: no Typer, Rich or Celery command line to import) all run it.

    python -m workers.worker -Q tokenize,embed -c 2 [--pool prefork] [-l INFO] [-n NAME]

GPU workers never fork after CUDA is initialised (a CUDA context does not survive `fork()`):
they run `--pool solo` (one process, one session per GPU) or `--pool threads -c N` (N threads
sharing one session per role: ONNX Runtime's `run()` is thread-safe), never `prefork`
(`check_pool_for_provider` refuses it before Celery starts). Hot reload on a GPU builds the new
session beside the old one, so the GPU holds two copies for a moment.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

from celery import Celery, signals

from pipeline.allocator import fix_mmap_threshold
from pipeline.audio.vad import SpeechCheck, shared_detector
from pipeline.batching import BatchRule, JobGathering
from pipeline.errors import ModelUnavailable
from pipeline.inference import SERVING_IMPORTS
from pipeline.models.options import SessionOptions
from pipeline.models.providers import CPU
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.records import ROLES_BY_OP
from pipeline.settings import Settings
from pipeline.storage.behind import BackgroundWrites
from pipeline.storage.paths import Roots
from workers import metrics
from workers.keys import QUEUES
from workers.metrics import Metrics, NoMetrics
from workers.observe.logs import setup_logging
from workers.queue.app import create_app
from workers.queue.consumer import VoxmillConsumer
from workers.queue.tasks import register_tasks
from workers.reload.coordinator import ReloadCoordinator
from workers.reload.holder import ModelHolder

FORK_SAFE_POOLS = ("solo", "threads")
log = logging.getLogger("voxmill.worker")


def roles_for_queues(queues: Sequence[str]) -> tuple[str, ...]:
    """The model roles a worker consuming `queues` must hold (embed-only: just the embedder)."""
    return tuple(dict.fromkeys(role for queue in queues for role in ROLES_BY_OP.get(queue, ())))


def served_queues(queues: Sequence[str]) -> tuple[str, ...]:
    """The queues a worker started with `-Q queues` consumes: those, plus every op queue whose
    models it holds anyway. A `-Q tokenize,embed` worker also serves `extract` (it needs exactly
    those two models), so no `-Q` list leaves an `extract` job waiting for a worker that was
    never going to exist; splitting tokenize and embed over separate workers still needs one
    that serves `extract` (the producer says so at once: `workers.queue.client.NoConsumer`)."""
    roles = set(roles_for_queues(queues))
    extra = [q for q in QUEUES if q not in queues and roles and set(ROLES_BY_OP.get(q, ("?",))) <= roles]
    return (*queues, *extra)


class WorkerProcess:
    """What one worker process serves from: its models (`ModelHolder`), their reload
    (`ReloadCoordinator`), its metrics, its Redis connection, the limits jobs are held to and the
    speech check they pass (`SpeechCheck`).

    Configured with the worker's queues and pool before any fork (`configure`), started in each
    pool process (`start`), stopped when it exits (`stop`).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.roots = Roots.of(settings.roots())  # resolved once: a check walks a set, not every root
        self.limits = settings.audio_limits
        self.speech = SpeechCheck.from_settings(settings)
        self.queues: tuple[str, ...] = QUEUES
        self.pool = "prefork"
        self.metrics: NoMetrics = NoMetrics()
        self.redis: Any = None
        self.holder: ModelHolder | None = None
        self.coordinator: ReloadCoordinator | None = None
        self.gathering: JobGathering | None = None  # single jobs' tokens in shared batches (threads)
        self.writes: BackgroundWrites | None = None  # shard files uploaded behind their tasks
        # ids of the tasks this process runs (several: threads pool), counted: a shard task's id
        # stays while its file is uploaded behind it
        self._running: dict[str, int] = {}
        self._running_lock = threading.Lock()

    def configure(self, queues: Sequence[str], pool: str) -> None:
        """In the worker's main process, before the pool forks: its queues, its pool, the imports."""
        self.queues = tuple(queues)
        self.pool = pool
        if pool == "prefork":  # import only (fork-safe): each pool process is spared ~0.5 s
            for module in SERVING_IMPORTS:
                importlib.import_module(module)
        # What the imports made lives as long as the process: the collector skips it from now on,
        # and the pool's processes never copy its pages to count references during collections.
        gc.freeze()
        if self.settings.metrics_port:
            metrics.prepare_multiprocess()

    def start(self) -> None:
        """Metrics first, then load every model the queues need (the speech detector too), then
        heartbeat and reload."""
        roles = roles_for_queues(self.queues)
        if not roles:
            return
        fix_mmap_threshold(self.settings.malloc_mmap_threshold_kb)
        if self.speech.enabled:
            shared_detector(self.speech)  # loaded before the first job, as the models are
        if self.settings.metrics_port:
            self.metrics = Metrics()
        if self.settings.broker_url:
            from workers.queue import connections

            self.redis = connections.broker_client(
                self.settings, socket_timeout=5, socket_connect_timeout=5, health_check_interval=30
            )
        registry = Registry.load()
        options = SessionOptions.from_settings(self.settings)
        worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.holder = ModelHolder(
            roles,
            options,
            registry,
            self.metrics,
            self.settings.reload_aside_wait_max_s,
            name=worker_id,
            batch_twins=BatchRule.loads_twin(self.settings, serving_provider(self.settings)),
        )
        if self.pool == "threads" and self.settings.batch_gather_ms > 0:  # jobs run side by side
            holder = self.holder
            self.gathering = JobGathering(self.settings.batch_gather_ms / 1000, lambda: holder.running_tasks)
        if self.settings.uploads_behind > 0:
            self.writes = BackgroundWrites(self.settings.uploads_behind)
        self.coordinator = ReloadCoordinator(
            self.settings,
            self.holder,
            registry,
            self.queues,
            self.pool,
            self.redis,
            self.metrics,
            running=self.running_ids,
        )
        self.coordinator.start()

    def task_started(self, task_id: str) -> None:
        """A task runs: its id goes into this process's heartbeat record (written soon after, as
        the record's writer wakes on `task_ended`, not at its next interval)."""
        with self._running_lock:
            self._running[task_id] = self._running.get(task_id, 0) + 1
        if self.holder is not None:
            self.holder.task_ended.set()

    def task_finished(self, task_id: str) -> None:
        with self._running_lock:
            left = self._running.pop(task_id, 0) - 1
            if left > 0:
                self._running[task_id] = left

    def running_ids(self) -> list[str]:
        """The ids of the tasks this process runs now."""
        with self._running_lock:
            return list(self._running)

    def serving(self, roles: Sequence[str]) -> contextlib.AbstractContextManager[dict[str, ModelSession]]:
        """The sessions of one task (`ModelHolder.serving`)."""
        if self.holder is None:
            raise ModelUnavailable(f"worker {os.getpid()} holds no model: its queues need none")
        return self.holder.serving(roles)

    def stop(self) -> None:
        if self.writes is not None and not self.writes.close(self.settings.uploads_drain_s):
            unfinished = self.writes.pending
            log.warning("stopping with %d shard uploads unfinished: the driver sends them again", unfinished)
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.holder is not None:
            self.holder.close()
        if self.redis is not None:
            self.redis.close()


def build_worker_app(settings: Settings) -> Celery:
    """The Celery app of a worker: `create_app`, the task handlers, and the hooks that load the
    models after fork (prefork, solo) or at worker start (threads)."""
    app = create_app(settings, consumer=functools.partial(VoxmillConsumer, settings=settings))
    process = WorkerProcess(settings)
    register_tasks(app, process)
    install_hooks(app, settings, process)
    return app


def install_hooks(app: Celery, settings: Settings, process: WorkerProcess) -> None:
    """Celery's signals, each connected to one step of the worker process's life."""

    def on_init(sender: Any = None, instance: Any = None, options: Any = None, **_: Any) -> None:
        if instance is None or instance.app is not app:
            return
        opts = options or {}
        process.configure(served_queues(queues_from_options(opts, QUEUES)), pool_name(opts.get("pool_cls")))

    def on_process_init(**_: Any) -> None:
        process.start()

    def on_threads_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app and process.pool.startswith("thread"):
            process.start()

    def on_ready(sender: Any = None, **_: Any) -> None:
        if settings.metrics_port and getattr(sender, "app", None) is app:
            metrics.serve(settings.metrics_port, settings.metrics_bind)
            logging.getLogger("voxmill.metrics").info(
                "metrics on http://%s:%d/metrics", settings.metrics_bind, settings.metrics_port
            )

    def on_shutdown(**_: Any) -> None:
        process.stop()
        metrics.mark_process_dead(os.getpid())

    def on_setup_logging(**_: Any) -> None:
        setup_logging(settings.log_level, settings.log_format)
        # Our own line per task replaces Celery's, which prints the whole result.
        logging.getLogger("celery.app.trace").setLevel(logging.WARNING)

    signals.setup_logging.connect(on_setup_logging, weak=False)
    signals.celeryd_init.connect(on_init, weak=False)
    signals.celeryd_after_setup.connect(consume_served_queues(app, process), weak=False)
    track_running(app, process)
    signals.worker_process_init.connect(on_process_init, weak=False)
    signals.worker_init.connect(on_threads_worker_init, weak=False)
    signals.worker_process_shutdown.connect(on_shutdown, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)


def consume_served_queues(app: Celery, process: WorkerProcess) -> Any:
    """The hook that adds the queues `process` serves beyond its `-Q` list (`served_queues`), once
    Celery has applied `-Q`: `voxmill worker` and `celery -A workers.app worker` alike."""

    def on_after_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
        if instance is None or instance.app is not app:
            return
        queues = instance.app.amqp.queues
        for name in process.queues:
            queues.select_add(queues[name])  # the declared queue (its exchange), not a new one

    return on_after_setup


def track_running(app: Celery, process: WorkerProcess) -> None:
    """Keep the ids of the tasks `process` runs, from before a task starts until after its result
    is stored (Celery stores it before `task_postrun`, retrying through a broker outage): a
    producer whose job is late sends it again only when no live worker runs it."""

    def on_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
        if task_id and getattr(task, "app", None) is app:
            process.task_started(task_id)

    def on_postrun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
        if task_id and getattr(task, "app", None) is app:
            process.task_finished(task_id)

    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)


def queues_from_options(options: dict[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    """The queues a worker was started with (`-Q a,b`), or all of voxmill's."""
    queues = options.get("queues")
    if not queues:
        return default
    if isinstance(queues, str):
        queues = queues.split(",")
    return tuple(q.strip() for q in queues if q.strip())


def pool_name(pool_cls: Any) -> str:
    """`prefork`, `solo` or `threads`, from Celery's pool option (a name or a class)."""
    if pool_cls is None:
        return "prefork"
    text = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", str(pool_cls))
    name = text.rsplit(".", 1)[-1].lower()
    return {"thread": "threads"}.get(name, name)


def serving_provider(settings: Settings) -> str:
    """The provider a session built with `settings` would run on (by what is installed)."""
    import onnxruntime as ort

    return SessionOptions.from_settings(settings).serving_provider(ort.get_available_providers())


def check_pool_for_provider(settings: Settings, pool: str, serving: str | None = None) -> str | None:
    """A clear refusal when a GPU worker would use the prefork pool; None when the pool is fine."""
    if pool in FORK_SAFE_POOLS:
        return None
    provider = serving or serving_provider(settings)
    if provider == CPU:
        return None
    return (
        f"the {pool} pool forks worker processes, which is unsafe once CUDA is initialised "
        f"(provider {provider}); run GPU workers with --pool solo (one process per GPU) or --pool threads"
    )


def start_worker(
    app: Celery, queues: list[str], concurrency: int, pool: str, loglevel: str, hostname: str = ""
) -> int:
    """Run a worker of `app` until it stops; its exit code.

    What `celery -A workers.app worker -Q ... --without-mingle --without-gossip` does, without
    Celery's command line (importing it takes about 0.2 s of every worker's start). voxmill never
    revokes tasks, so a worker does not spend a second at start asking its neighbours for their
    revoked ids (mingle), nor follow every other worker's heartbeats (gossip).
    """
    from celery.utils.nodenames import default_nodename, host_format

    worker = app.Worker(
        hostname=host_format(default_nodename(hostname or None)),
        queues=queues,
        concurrency=concurrency,
        pool_cls=pool,
        loglevel=loglevel,
        without_mingle=True,
        without_gossip=True,
    )
    worker.start()
    return int(worker.exitcode or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("-Q", "--queues", default=",".join(QUEUES), help="queues, comma-separated")
    parser.add_argument("-c", "--concurrency", type=int, default=1, help="pool processes")
    parser.add_argument("--pool", default="prefork", help="prefork | solo | threads")
    parser.add_argument("-l", "--loglevel", default="INFO")
    parser.add_argument("-n", "--hostname", default="", help="Celery node name (default celery@HOST)")
    args = parser.parse_args(argv)
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    app = build_worker_app(Settings.load())
    return start_worker(app, queues, args.concurrency, args.pool, args.loglevel, args.hostname)


if __name__ == "__main__":
    sys.exit(main())
