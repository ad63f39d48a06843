"""`voxmill extract`: one corpus run, from the listing to the merged outputs.

    lock the output folder -> read the corpus -> a cluster (remote workers, or an embedded one
    started now) -> load or make the plan -> drive the shards -> stop the cluster -> merge

With a broker, workers anywhere do the work; without one, the run starts its own Redis and local
workers first, so they load their models while this process probes the corpus and submits the
first shards. The driver and the Celery app are imported after the workers are spawned.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import VoxmillError
from pipeline.settings import Settings
from workers.corpus.cluster import Cluster, EmbeddedCluster, RemoteCluster
from workers.corpus.plan import Plan, RunError, load_or_make_plan, lock_output, read_utterances


def extract_corpus(
    settings: Settings,
    source: Path,
    out_dir: Path,
    ops: Sequence[str],
    workers: int,
    shard_size: int,
    quiet: bool = False,
) -> dict[str, Any]:
    """`voxmill extract`; returns `report.json`'s content. `RunError` when the run cannot go on.

    `shard_size` 0: automatic (see `load_or_make_plan`), for `workers` local processes, or with a
    broker for the worker processes ready now.
    """
    started = time.monotonic()
    try:
        lock = lock_output(out_dir)
    except OSError as exc:
        raise RunError(f"cannot use the output folder {out_dir}: {exc.strerror or exc}") from None
    try:
        utts = read_utterances(source)
        cluster: Cluster
        if settings.broker_url:
            cluster = RemoteCluster(settings).start()
        else:
            cluster = EmbeddedCluster(settings, utts, out_dir, ops, workers).start()
            if not quiet:
                print(f"extract: starting {workers} local worker(s) on an embedded Redis", flush=True)
        try:
            plan = load_or_make_plan(
                utts, source, out_dir, ops, shard_size, settings, _workers(cluster, workers)
            )
            return run_corpus(cluster, plan, out_dir, quiet, {"input": str(source)}, started)
        finally:
            cluster.stop()
    finally:
        lock.close()


def _workers(cluster: Cluster, local: int) -> int | None:
    """How many worker processes the shards are cut for: the local ones, or those ready now."""
    if isinstance(cluster, EmbeddedCluster):
        return local
    import redis

    from workers.queue import connections

    try:
        client = connections.broker_client(cluster.settings, socket_timeout=5, socket_connect_timeout=5)
        try:
            return cluster.ready_workers(client) or None
        finally:
            client.close()
    except redis.RedisError:
        return None


def run_corpus(
    cluster: Cluster,
    plan: Plan,
    out_dir: Path,
    quiet: bool = False,
    extra_report: dict[str, Any] | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """Drive `plan` on `cluster` to the end, stop the cluster, merge the outputs; the report.

    `wall_seconds` counts from `started` (a `time.monotonic()` value; default: now).
    """
    from pipeline.merge import merge_outputs
    from workers.corpus.driver import CorpusDriver
    from workers.corpus.progress import Counts, ProgressView
    from workers.queue.app import create_app

    started = time.monotonic() if started is None else started
    audio_total = sum(u.duration_s or 0.0 for u in plan.utterances())
    counts = Counts(
        units_total=sum(len(s.utts) for s in plan.specs), audio_total_s=audio_total, n_ops=len(plan.ops)
    )
    app = create_app(cluster.settings, polled_results=True)
    with ProgressView(counts, quiet=quiet) as view:
        driver = CorpusDriver(app, cluster, plan, out_dir, view)
        driver.run()
    cluster.stop(completed=True)  # every shard file exists: nothing is in flight
    extra = {"wall_seconds": round(time.monotonic() - started, 3), **(extra_report or {})}
    extra["resubmitted_shards"] = driver.ledger.resubmitted
    try:
        return merge_outputs(out_dir, plan.specs, extra, plan.order or None)
    except VoxmillError as exc:
        raise RunError(exc.message) from None
