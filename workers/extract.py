"""`voxmill extract`: the corpus driver with a broker, or an embedded cluster and the driver.

Without a broker the run starts its own Redis and local workers, and it starts them first:
a worker process takes a second or more to import its code and load its models, time this
process fills with its own imports, probing the corpus (a header read per file: minutes on a
large corpus) and submitting the first shards, which wait in the queue until the workers take
them. That is why the driver and the Celery app are imported only after the workers are spawned.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import VoxmillError
from pipeline.records import ROLES_BY_OP, Utterance
from pipeline.settings import Settings
from workers.embedded import EmbeddedRedis, LocalWorkers, ProcessExited
from workers.plan import Plan, RunError, lock_output, make_plan, read_utterances, reusable_plan

READY_TIMEOUT_S = 120.0  # local workers that have not loaded their models by then end the run


def corpus_roots(utts: Sequence[Utterance], out_dir: Path, limit: int = 64) -> list[Path]:
    """The folders an embedded run's workers must be allowed to read (and the output folder)."""
    folders = sorted({Path(u.path).parent for u in utts})
    if len(folders) > limit:
        common = Path(os.path.commonpath([str(f) for f in folders]))
        if len(common.parts) > 2:  # never collapse to "/" or a top-level folder such as /home
            folders = [common]
    minimal: list[Path] = []
    for folder in folders:
        if not any(folder == m or m in folder.parents for m in minimal):
            minimal.append(folder)
    return [*minimal, out_dir.resolve()]


def remote_workers(settings: Settings) -> int | None:
    """Worker processes with their models loaded on the broker (None when there are none or it fails)."""
    import redis

    from workers import status

    try:
        client = redis.Redis.from_url(settings.broker_url or "", socket_timeout=5, socket_connect_timeout=5)
        try:
            return status.count_ready_workers(client) or None
        finally:
            client.close()
    except redis.RedisError:
        return None


def check_models(settings: Settings, ops: Sequence[str]) -> None:
    """Fail early, with the fix, when the model folder lacks a model the ops need."""
    from pipeline.registry import Registry

    registry = Registry.load()
    for role in dict.fromkeys(r for op in ops for r in ROLES_BY_OP[op]):
        try:
            registry.find_model(role, settings.model_dir)
        except VoxmillError as exc:
            raise RunError(exc.message) from None


def extract_corpus(
    settings: Settings,
    source: Path,
    out_dir: Path,
    ops: Sequence[str],
    workers: int,
    shard_size: int,
    quiet: bool = False,
) -> dict[str, Any]:
    """`voxmill extract`: with a broker, submit and wait; without one, run an embedded cluster too.

    `shard_size` 0: automatic (see `workers.plan.make_plan`), for `workers` local processes, or
    with a broker for the worker processes ready now.
    """
    started = time.monotonic()
    try:
        lock = lock_output(out_dir)
    except OSError as exc:
        raise RunError(f"cannot use the output folder {out_dir}: {exc.strerror or exc}") from None
    try:
        utts = read_utterances(source)
        resumed = reusable_plan(utts, out_dir, ops, shard_size, settings)
        if settings.broker_url:
            from workers.driver import run_corpus

            plan = resumed or make_plan(
                utts, source, out_dir, ops, shard_size, settings, remote_workers(settings)
            )
            return run_corpus(_app(settings), settings, plan, out_dir, quiet, {"input": str(source)}, started)
        check_models(settings, ops)
        local = EmbeddedRun(settings, utts, out_dir, ops, workers)
        try:
            local.start(quiet)
            plan = resumed or make_plan(utts, source, out_dir, ops, shard_size, settings, workers)
            return local.run(plan, source, quiet, started)
        finally:
            local.stop()
    except VoxmillError as exc:  # e.g. output_error while writing the plan
        raise RunError(exc.message) from None
    finally:
        lock.close()


class EmbeddedRun:
    """An embedded Redis and local workers for one run: spawned first, stopped as soon as every
    shard file exists (nothing is in flight then: no warm shutdown to wait for)."""

    def __init__(
        self, settings: Settings, utts: Sequence[Utterance], out_dir: Path, ops: Sequence[str], workers: int
    ) -> None:
        self.redis = EmbeddedRedis()
        roots = (*settings.allowed_roots, *corpus_roots(utts, out_dir))
        self.settings = settings.model_copy(update={"broker_url": self.redis.url, "allowed_roots": roots})
        self.workers = LocalWorkers(
            self.settings, workers, queues=list(ops), log_path=out_dir / "workers.log"
        )
        self.out_dir = out_dir

    def start(self, quiet: bool) -> None:
        """Spawn Redis and the workers; return once Redis answers (the workers keep starting)."""
        self.redis.spawn()
        self.workers.start()
        try:
            self.redis.wait_up()
        except (TimeoutError, ProcessExited) as exc:
            raise RunError(f"cannot start the embedded Redis: {exc}") from None
        if not quiet:
            print(
                f"extract: starting {self.workers.concurrency} local worker(s) on an embedded Redis",
                flush=True,
            )

    def run(self, plan: Plan, source: Path, quiet: bool, started: float) -> dict[str, Any]:
        """Drive the plan to the end, submitting at once (the first shards wait in the queue while
        the workers load their models); `RunError` if the workers exit or never get ready."""
        import redis

        from workers.driver import run_corpus

        client = redis.Redis.from_url(self.redis.url, socket_timeout=5, socket_connect_timeout=5)

        def health() -> None:
            try:
                self.workers.check(client, READY_TIMEOUT_S)
            except (TimeoutError, ProcessExited) as exc:
                raise RunError(str(exc)) from None

        try:
            report = run_corpus(
                _app(self.settings),
                self.settings,
                plan,
                self.out_dir,
                quiet,
                {"input": str(source)},
                started,
                health=health,
                finished=lambda: self.stop(completed=True),
            )
        finally:
            client.close()
        return report

    def stop(self, completed: bool = False) -> None:
        """Stop the workers and Redis (again: nothing). Once every shard file exists nothing is in
        flight, so the workers are killed at once; otherwise they get up to 5 s of warm shutdown
        (shards are idempotent: one cut short runs again on resume)."""
        self.workers.stop(timeout_s=0.0 if completed else 5.0)
        self.redis.stop()


def _app(settings: Settings) -> Any:
    from workers.app import create_app

    return create_app(settings, polled_results=True)
