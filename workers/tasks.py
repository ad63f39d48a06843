"""voxmill's Celery tasks: thin glue from a decoded payload to one `pipeline` call.

Payloads are JSON (or msgpack when they carry raw bytes):
- `voxmill.tokenize|embed|extract`: `{"path": str}` or `{"audio": bytes, "name": str?}`
- `voxmill.shard`: a `ShardSpec` dict; the task writes the shard file and returns a `ShardResult`.
Bad input is a result with an error code. Only a missing model (still loading, or a failed
load that a later generation may fix) is retried, with bounded backoff.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, Task, signals

from pipeline import errors
from pipeline.errors import VoxmillError
from pipeline.extraction import SERVING_IMPORTS, process
from pipeline.paths import resolve_allowed_path
from pipeline.records import ROLES_BY_OP, ShardResult, ShardSpec, TaskResult
from pipeline.settings import Settings
from pipeline.writers import shard_counts, shard_path, write_shard
from workers import keys, metrics
from workers.holder import ModelHolder, ModelUnavailable
from workers.keys import QUEUES
from workers.logs import setup_logging
from workers.metrics import Metrics, NoMetrics

log = logging.getLogger("voxmill.tasks")
MAX_RETRIES = 8


class MalformedCall:
    """A single-audio task called with other than one job argument; `decode_job` refuses it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        keywords = f" and keyword(s) {', '.join(sorted(kwargs))}" if kwargs else ""
        self.message = f"a voxmill task takes one job argument; got {len(args)} positional{keywords}"


def job_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The job of a task call (`(job,)` or `job=`); any other call shape becomes a `MalformedCall`."""
    if len(args) == 1 and not kwargs:
        return args[0]
    if not args and set(kwargs) == {"job"}:
        return kwargs["job"]
    return MalformedCall(args, kwargs)


def decode_job(job: Any, roots: tuple[Path, ...]) -> tuple[str, str | Path | bytes]:
    """(label, source) of a single-audio payload; `bad_request` or `forbidden_path` when it is wrong."""
    if isinstance(job, MalformedCall):
        raise VoxmillError(errors.BAD_REQUEST, job.message)
    if not isinstance(job, dict):
        raise VoxmillError(errors.BAD_REQUEST, f"job must be an object, not {type(job).__name__}")
    if "path" in job:
        path = job["path"]
        if not isinstance(path, str):
            raise VoxmillError(errors.BAD_REQUEST, f"'path' must be a string, not {type(path).__name__}")
        return path, resolve_allowed_path(path, roots)
    if "audio" in job:
        audio, name = job["audio"], job.get("name", "<bytes>")
        if not isinstance(audio, (bytes, bytearray)):
            raise VoxmillError(
                errors.BAD_REQUEST, f"'audio' must be raw bytes (msgpack), not {type(audio).__name__}"
            )
        if not isinstance(name, str):
            raise VoxmillError(errors.BAD_REQUEST, f"'name' must be a string, not {type(name).__name__}")
        return name, bytes(audio)
    raise VoxmillError(errors.BAD_REQUEST, "job needs 'path' (a string) or 'audio' (bytes)")


def job_label(job: Any) -> str:
    """A printable name for a job, even a malformed one."""
    if isinstance(job, dict):
        for key in ("path", "name"):
            if isinstance(job.get(key), str):
                return str(job[key])
    return "<invalid job>"


def retry_countdown(retries: int) -> float:
    """Bounded exponential backoff: 1, 2, 4 ... 30 s."""
    return float(min(30, 2**retries))


class Runner:
    """What the tasks share in one worker process: settings, roots, limits and the holder."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limits = settings.audio_limits
        self.roots = settings.roots()
        self.holder = ModelHolder(settings)
        self.metrics: NoMetrics = NoMetrics()
        self._redis: redis.Redis | None = None

    def start_process(self) -> None:
        """In each pool process (or the single one): metrics first, then load the models."""
        if self.settings.metrics_port:
            self.metrics = Metrics()
        self.holder.metrics = self.metrics
        if self.holder.roles:
            self.holder.start()

    def report_shard(self, task_id: str, result: dict[str, Any]) -> None:
        """Put a shard's result where the corpus driver reads it (the shard file is the truth) and
        announce it on the key's channel, as Celery's backend does for results (`workers.wakeups`)."""
        if not self.settings.broker_url:
            return
        if self._redis is None:  # created in the pool process, after fork
            self._redis = redis.Redis.from_url(self.settings.broker_url, socket_timeout=5)
        try:
            key = keys.SHARD_RESULT.format(task_id=task_id)
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(key, json.dumps(result), ex=self.settings.result_expires_s)
            pipe.publish(key, "1")
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not report shard result %s: %s", task_id, exc)

    def single(self, task: Task, op: str, job: Any) -> dict[str, Any]:
        """One audio, one op: the contract's result object."""
        try:
            label, source = decode_job(job, self.roots)
        except VoxmillError as exc:
            return TaskResult(input=job_label(job), op=op, error=exc.to_dict()).to_dict()
        started = time.perf_counter()
        try:
            with self.metrics.in_flight(), self.holder.serving(ROLES_BY_OP[op]) as sessions:
                result = process(label, source, op, sessions, self.limits)
        except ModelUnavailable as exc:
            raise task.retry(
                exc=exc, countdown=retry_countdown(task.request.retries), max_retries=MAX_RETRIES
            ) from exc
        self.record(op, [result], time.perf_counter() - started)
        log_result(task, result)
        return result.to_dict()

    def record(self, op: str, results: list[TaskResult], seconds: float, outcome: str | None = None) -> None:
        """Metrics of one task: latency and outcome (default: the first result's), each failure's code."""
        if results:
            label = model_label(results[0].models)
            self.metrics.task_done(op, label, outcome or outcome_of(results[0]), seconds)
        for result in results:
            if result.error is not None:
                self.metrics.failure(op, outcome_of(result))

    def shard(self, task: Task, payload: Any) -> dict[str, Any]:
        """A corpus shard: process each utterance, write the shard file, report its counts."""
        result = self._shard(task, payload)
        self.report_shard(str(task.request.id), result)
        return result

    def _shard(self, task: Task, payload: Any) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            spec = ShardSpec.from_dict(payload)
            out_dir = resolve_allowed_path(spec.out_dir, self.roots)
            if spec.op not in ROLES_BY_OP:
                raise VoxmillError(errors.BAD_REQUEST, f"unknown op {spec.op!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return failed_shard(payload, VoxmillError(errors.BAD_REQUEST, f"malformed shard payload: {exc}"))
        except VoxmillError as exc:
            return failed_shard(payload, exc)
        done = finished_shard(out_dir, spec)
        if done is not None:  # a redelivered or resubmitted shard that is already written
            return done
        try:
            with self.metrics.in_flight(), self.holder.serving(ROLES_BY_OP[spec.op]) as sessions:
                results = [self._utterance(u.utt, u.path, spec.op, sessions) for u in spec.utts]
                models = {role: s.ref.to_dict() for role, s in sessions.items()}
        except ModelUnavailable as exc:
            if task.request.retries >= MAX_RETRIES:
                return failed_shard(payload, VoxmillError(errors.MODEL_ERROR, str(exc)))
            raise task.retry(
                exc=exc, countdown=retry_countdown(task.request.retries), max_retries=MAX_RETRIES
            ) from exc
        try:
            path = write_shard(out_dir, spec, results)
        except VoxmillError as exc:
            return failed_shard(payload, exc)
        ok = sum(1 for r in results if r.ok)
        self.record(spec.op, results, time.perf_counter() - started, outcome="ok")
        return ShardResult(
            shard=spec.shard,
            op=spec.op,
            path=str(path),
            ok=ok,
            failed=len(results) - ok,
            audio_seconds=round(sum(r.audio_seconds or 0.0 for r in results), 4),
            seconds=round(time.perf_counter() - started, 4),
            models=models,
        ).to_dict()

    def _utterance(self, utt: str, path: str, op: str, sessions: Any) -> TaskResult:
        try:
            source = resolve_allowed_path(path, self.roots)
        except VoxmillError as exc:
            return TaskResult(input=utt, op=op, error=exc.to_dict())
        return process(utt, source, op, sessions, self.limits)


def model_label(models: dict[str, dict[str, str]]) -> str:
    """The `model_sha256` label of a result: the sha256 (first 12) of each model used."""
    return ",".join(f"{role}:{ref['sha256'][:12]}" for role, ref in sorted(models.items()))


def outcome_of(result: TaskResult) -> str:
    """`ok` or the error code."""
    return "ok" if result.error is None else result.error.get("code", "internal")


def finished_shard(out_dir: Path, spec: ShardSpec) -> dict[str, Any] | None:
    """The counts of a shard whose file already exists (files are complete or absent), else None."""
    path = shard_path(out_dir, spec.op, spec.shard)
    if not path.exists():
        return None
    try:
        ok, failed = shard_counts(path)
    except Exception:  # unreadable: do the shard again and replace it
        return None
    return ShardResult(
        shard=spec.shard, op=spec.op, path=str(path), ok=ok, failed=failed, audio_seconds=0.0, seconds=0.0
    ).to_dict()


def failed_shard(payload: Any, exc: VoxmillError) -> dict[str, Any]:
    """A shard result that says the whole shard could not be done (bad payload, unwritable output)."""
    shard = payload.get("shard", -1) if isinstance(payload, dict) else -1
    op = payload.get("op", "") if isinstance(payload, dict) else ""
    log.error("shard %s/%s failed: %s", op, shard, exc.message)
    return ShardResult(
        shard=int(shard) if isinstance(shard, int) else -1,
        op=str(op),
        path="",
        ok=0,
        failed=0,
        audio_seconds=0.0,
        seconds=0.0,
        error=exc.to_dict(),
    ).to_dict()


def log_result(task: Task, result: TaskResult) -> None:
    """One line per task: id, op, input, outcome, duration and model sha256."""
    outcome = "ok" if result.ok else (result.error or {}).get("code", "error")
    shas = ",".join(f"{role}={m['sha256'][:12]}" for role, m in result.models.items())
    total_ms = sum(result.timings_ms.values())
    log.info(
        "task %s op=%s input=%s outcome=%s ms=%.1f models=%s",
        task.request.id,
        result.op,
        result.input,
        outcome,
        total_ms,
        shas,
        extra={
            "task_id": task.request.id,
            "op": result.op,
            "input": result.input,
            "outcome": outcome,
            "duration_ms": round(total_ms, 3),
            "models": result.models,
        },
    )


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


def register(app: Celery, settings: Settings) -> Runner:
    """Define voxmill's tasks on `app` and hook model loading into the worker's life."""
    runner = Runner(settings)

    @app.task(name="voxmill.tokenize", bind=True)
    def tokenize(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return runner.single(self, "tokenize", job_argument(args, kwargs))

    @app.task(name="voxmill.embed", bind=True)
    def embed(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return runner.single(self, "embed", job_argument(args, kwargs))

    @app.task(name="voxmill.extract", bind=True)
    def extract(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return runner.single(self, "extract", job_argument(args, kwargs))

    @app.task(name="voxmill.shard", bind=True, ignore_result=True)
    def shard(self: Task, payload: Any) -> dict[str, Any]:
        return runner.shard(self, payload)

    install_worker_hooks(app, settings, runner)
    return runner


def import_serving_modules() -> None:
    """Import what serving needs in the main process, before the pool forks (import only: fork-safe)."""
    for module in SERVING_IMPORTS:
        importlib.import_module(module)


def install_worker_hooks(app: Celery, settings: Settings, runner: Runner) -> None:
    """Load models after fork (prefork, solo) or at worker start (threads); log our way."""

    def on_init(sender: Any = None, instance: Any = None, options: Any = None, **_: Any) -> None:
        if instance is None or instance.app is not app:
            return
        opts = options or {}
        runner.holder.configure(queues_from_options(opts, QUEUES), pool_name(opts.get("pool_cls")))
        if runner.holder.pool == "prefork":
            import_serving_modules()
        # What the imports made lives as long as the process: the collector skips it from now on
        # (and the pool's processes never copy its pages to count references during collections).
        gc.freeze()
        gc.enable()
        if settings.metrics_port:
            metrics.prepare_multiprocess()  # before the pool forks

    def on_process_init(**_: Any) -> None:
        runner.start_process()

    def on_threads_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app and runner.holder.pool.startswith("thread"):
            runner.start_process()

    def on_ready(sender: Any = None, **_: Any) -> None:
        if settings.metrics_port and getattr(sender, "app", None) is app:
            metrics.serve(settings.metrics_port)
            logging.getLogger("voxmill.metrics").info(
                "metrics on http://0.0.0.0:%d/metrics", settings.metrics_port
            )

    def on_shutdown(**_: Any) -> None:
        runner.holder.stop()
        metrics.mark_process_dead(os.getpid())

    def on_setup_logging(**_: Any) -> None:
        setup_logging(settings.log_level, settings.log_format)
        # Our own line per task replaces Celery's, which prints the whole result.
        logging.getLogger("celery.app.trace").setLevel(logging.WARNING)

    signals.setup_logging.connect(on_setup_logging, weak=False)
    signals.celeryd_init.connect(on_init, weak=False)
    signals.worker_process_init.connect(on_process_init, weak=False)
    signals.worker_init.connect(on_threads_worker_init, weak=False)
    signals.worker_process_shutdown.connect(on_shutdown, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
