"""Prometheus metrics of a worker host, multiprocess-safe under the prefork pool.

With `VOXMILL_METRICS_PORT` set, the worker's main process points `PROMETHEUS_MULTIPROC_DIR`
at a fresh folder *before* any pool process is forked (prometheus-client picks its storage at
import), serves the aggregate of every process on that port, and marks pool processes dead as
they exit. Without it, `NoMetrics` takes the calls and nothing is imported.

Series (all prefixed `voxmill_`):
- `task_seconds{op, model_sha256, outcome}` histogram; `task_failures_total{op, code}`;
  `tasks_in_flight` gauge
- `model_load_seconds{role, sha256}`, `model_warmup_ms{role, sha256}` gauges (first inference after
  warm-up), `model_reloads_total{role, outcome}`
- `model_rejections_total{role}`, `model_publications_total{role}` (the watcher's, on its own port)
- `worker_rss_bytes` and, on a GPU, `gpu_memory_used_bytes` gauges per process
- `messages_refused_total{reason}`: messages the worker's main process refused before any task
  ran (`workers.queue.admission`; its own series, `ConsumerMetrics`)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class NoMetrics:
    """Metrics switched off: every call does nothing."""

    def task_done(self, op: str, model_sha256: str, outcome: str, seconds: float) -> None:
        """One finished task."""

    def failure(self, op: str, code: str) -> None:
        """One input that failed with `code`."""

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a task as in flight for the block."""
        yield

    def model_loaded(self, role: str, sha256: str, load_s: float, warm_latency_ms: float) -> None:
        """A session was loaded and warmed up."""

    def reload(self, role: str, outcome: str) -> None:
        """A reload attempt ended (`ok` or `failed`)."""

    def rejection(self, role: str) -> None:
        """The watcher rejected a candidate."""

    def publication(self, role: str) -> None:
        """The watcher published a generation."""

    def sample_process(self) -> None:
        """Record this process's memory."""

    def refused(self, reason: str) -> None:
        """The worker refused a message for `reason` (`workers.queue.admission.REASONS`)."""


class Metrics(NoMetrics):
    """The real series; create one per process after `prepare_multiprocess` (if multiprocess)."""

    def __init__(self) -> None:
        import prometheus_client as pc

        self._task_seconds = pc.Histogram(
            "voxmill_task_seconds",
            "Time inside a task, by op, model and outcome",
            ["op", "model_sha256", "outcome"],
            buckets=LATENCY_BUCKETS_S,
        )
        self._failures = pc.Counter(
            "voxmill_task_failures", "Failed inputs by op and error code", ["op", "code"]
        )
        self._in_flight = pc.Gauge(
            "voxmill_tasks_in_flight", "Tasks running now", multiprocess_mode="livesum"
        )
        self._load = pc.Gauge(
            "voxmill_model_load_seconds",
            "Seconds to read and build a model session",
            ["role", "sha256"],
            multiprocess_mode="liveall",
        )
        self._warm = pc.Gauge(
            "voxmill_model_warmup_ms",
            "Latency of the last warm-up run (first inference after warm-up)",
            ["role", "sha256"],
            multiprocess_mode="liveall",
        )
        self._reloads = pc.Counter(
            "voxmill_model_reloads", "Hot reloads by role and outcome", ["role", "outcome"]
        )
        self._rss = pc.Gauge(
            "voxmill_worker_rss_bytes", "Resident memory per process", multiprocess_mode="liveall"
        )
        self._gpu = pc.Gauge(
            "voxmill_gpu_memory_used_bytes", "GPU memory in use", multiprocess_mode="livemax"
        )

    def task_done(self, op: str, model_sha256: str, outcome: str, seconds: float) -> None:
        self._task_seconds.labels(op, model_sha256, outcome).observe(seconds)

    def failure(self, op: str, code: str) -> None:
        self._failures.labels(op, code).inc()

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        self._in_flight.inc()
        try:
            yield
        finally:
            self._in_flight.dec()

    def model_loaded(self, role: str, sha256: str, load_s: float, warm_latency_ms: float) -> None:
        self._load.labels(role, sha256).set(load_s)
        self._warm.labels(role, sha256).set(warm_latency_ms)

    def reload(self, role: str, outcome: str) -> None:
        self._reloads.labels(role, outcome).inc()

    def sample_process(self) -> None:
        import psutil

        self._rss.set(psutil.Process().memory_info().rss)
        used = gpu_memory_used_bytes()
        if used is not None:
            self._gpu.set(used)


class WatcherMetrics(NoMetrics):
    """The watcher's series: what it published and rejected (it serves no task, holds no model)."""

    def __init__(self) -> None:
        import prometheus_client as pc

        self._rejections = pc.Counter("voxmill_model_rejections", "Candidates the watcher rejected", ["role"])
        self._publications = pc.Counter(
            "voxmill_model_publications", "Generations the watcher published", ["role"]
        )

    def rejection(self, role: str) -> None:
        self._rejections.labels(role).inc()

    def publication(self, role: str) -> None:
        self._publications.labels(role).inc()


class ConsumerMetrics(NoMetrics):
    """The series of a worker's main process, where messages are received (and refused)."""

    def __init__(self) -> None:
        import prometheus_client as pc

        self._refused = pc.Counter(
            "voxmill_messages_refused", "Messages refused before any task ran, by reason", ["reason"]
        )

    def refused(self, reason: str) -> None:
        self._refused.labels(reason).inc()


def gpu_memory_used_bytes() -> int | None:
    """Memory in use on the first GPU (nvidia-smi), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    from pipeline.models.host import run_command

    output = run_command(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    try:
        return int(float((output or "").splitlines()[0])) * 1024 * 1024
    except (ValueError, IndexError):
        return None


def prepare_multiprocess() -> Path:
    """In the worker's main process, before forking: a fresh folder for every process's samples."""
    folder = Path(tempfile.mkdtemp(prefix="voxmill-metrics-"))
    os.environ[MULTIPROC_ENV] = str(folder)
    # prometheus-client picks its value store when first imported. Something may have imported it
    # before this point (Celery loads its CLI plugins, e.g. Flower's, at start-up): pick again, or
    # every pool process would keep its samples in memory where the endpoint cannot see them.
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
    return folder


def serve(port: int, addr: str) -> Any:
    """Serve the aggregate of all processes' metrics (or this process's) on `addr`:`port`."""
    import prometheus_client as pc
    from prometheus_client import multiprocess

    if os.environ.get(MULTIPROC_ENV):
        registry = pc.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return pc.start_http_server(port, addr=addr, registry=registry)
    return pc.start_http_server(port, addr=addr)


def mark_process_dead(pid: int) -> None:
    """Drop a pool process's live gauges once it has exited."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
