"""`voxmill extract`: one corpus run, from the listing to the merged outputs.

    the listing's first lines -> lock the output folder -> a cluster (remote workers, or an
    embedded one started now) -> plan as the listing streams by (a thread) -> drive the shards ->
    stop the cluster -> merge

With a broker, workers anywhere do the work; without one, the run starts its own Redis and local
workers first, so they load their models while this process probes the corpus and submits the
first shards. The driver, the Celery app, numpy, Arrow and redis-py are imported after the workers
are spawned (`tests/unit/test_imports.py`).

`out_dir` (a `pipeline.outputs.folder.RunFolder`) may be in an object store (`s3://bucket/run/`):
the plan, the shard objects and the merged outputs are written there, and what must stay local
(the lock's flock, an embedded run's `workers.log`) is in `run_state_dir/<hash of the URL>/`
(`RunFolder.local_state`; see `workers.corpus.lock.StoreLock`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.audio.quality import QualityFilter
from pipeline.corpus.reading import Source
from pipeline.corpus.roots import corpus_roots
from pipeline.errors import VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport
from pipeline.settings import Settings
from workers.corpus.cluster import Cluster, EmbeddedCluster, RemoteCluster
from workers.corpus.lock import lock_output
from workers.corpus.plan import Planner, PlanReader, RunError, task_ops
from workers.heartbeat import WorkerRecord, read_worker_records


def extract_corpus(
    settings: Settings,
    source: Source,
    out_dir: RunFolder,
    ops: Sequence[str],
    workers: int,
    shard_size: int,
    quiet: bool = False,
    quality: QualityFilter | None = None,
) -> RunReport:
    """`voxmill extract`; returns `report.json`'s content. `RunError` when the run cannot go on.

    `shard_size` 0: automatic (see `Planner`), for `workers` local processes, or with a broker for
    the worker processes ready now. `quality` leaves utterances out of the merged features.
    """
    started = time.monotonic()
    try:
        check_first_lines(source, settings.max_text_chars)  # before any folder or worker is made
        lock = lock_output(out_dir, settings.run_state_dir)
    except OSError as exc:
        raise RunError(unusable_output(out_dir, exc)) from None
    except VoxmillError as exc:
        raise RunError(exc.message) from None
    try:
        cluster: Cluster
        if settings.broker_url:
            cluster = RemoteCluster(settings).start()
        else:
            # Paths only: the local workers may read there (folders, and the listing's URL prefixes).
            folders, prefixes = corpus_roots(source)
            cluster = EmbeddedCluster(settings, folders, out_dir, ops, workers, prefixes).start()
            if not quiet:
                print(f"extract: starting {workers} local worker(s) on an embedded Redis", flush=True)
        try:
            ready, one_task = _workers(cluster, workers)
            tasks = task_ops(ops, one_task)
            planner = Planner(source, out_dir, ops, shard_size, settings, ready, tasks).start()
            extra = {"input": str(source)}
            return run_corpus(cluster, planner, out_dir, quiet, extra, started, quality)
        finally:
            cluster.stop()
    except RunError:  # as it is: its code may be more telling (`no_consumer`)
        raise
    except VoxmillError as exc:  # an op or shard size refused before anything ran
        raise RunError(exc.message) from None
    finally:
        lock.close()


def check_first_lines(source: Source, max_text_chars: int) -> None:
    """The listing's `CorpusError` when its first lines hold a problem, with every problem of the
    whole listing (`check_listing`, as the planner would say it), before anything starts; one
    further on is the planner's to find, still before the first shard."""
    from pipeline.corpus.listing import CorpusError, first_problems

    problems = first_problems(source, max_text_chars)
    if problems:
        from pipeline.corpus.check import check_listing  # numpy: only for a listing refused anyway

        check_listing(source, max_text_chars)
        raise CorpusError(problems)


def unusable_output(out_dir: RunFolder, exc: OSError) -> str:
    """Why `--out` cannot hold a run, in words: a local path that is (or lies below) a file says so."""
    where = out_dir.display()
    if out_dir.is_local:
        path = Path(out_dir.name)
        file = next((p for p in (path, *path.parents) if p.is_file()), None)
        if file == path:
            return f"cannot use the output folder {where}: it is a file, not a folder (--out names a folder)"
        if file is not None:
            return f"cannot use the output folder {where}: {file} is a file, not a folder"
    return f"cannot use the output folder {where}: {exc.strerror or exc}"


def _workers(cluster: Cluster, local: int) -> tuple[int | None, bool]:
    """How many worker processes the shards are cut for (the local ones, or those ready now), and
    whether every one of them serves `extract` (then both ops run as one task per shard)."""
    if isinstance(cluster, EmbeddedCluster):
        return local, True  # its workers hold both models when both ops are asked
    import redis

    from workers.queue import connections

    try:
        client = connections.broker_client(cluster.settings, socket_timeout=5, socket_connect_timeout=5)
        try:
            return cluster.ready_workers(client) or None, all_serve_extract(read_worker_records(client))
        finally:
            client.close()
    except redis.RedisError:
        return None, False


def all_serve_extract(records: Sequence[WorkerRecord]) -> bool:
    """Every live worker that takes tokenize or embed jobs also takes `extract` ones (and there is
    one): a run may then give each shard to one worker for both ops."""
    served = [set(record.queues) for record in records]
    takers = [queues for queues in served if queues & {"tokenize", "embed"}]
    return bool(takers) and all("extract" in queues for queues in takers)


def run_corpus(
    cluster: Cluster,
    planner: Planner,
    out_dir: RunFolder,
    quiet: bool = False,
    extra_report: dict[str, Any] | None = None,
    started: float | None = None,
    quality: QualityFilter | None = None,
) -> RunReport:
    """Drive the plan on `cluster` to the end, stop the cluster, merge the outputs; the report.

    `wall_seconds` counts from `started` (a `time.monotonic()` value; default: now). A resumed run
    that found every shard done and the outputs merged with the same filters returns the report
    it finds; with other filters it merges again and keeps the extraction's wall time and shards
    sent again or given up, the re-merge's own time being `remerge_wall_seconds`.
    """
    from pipeline.outputs.merge import merge_outputs
    from pipeline.storage.prefetch import ReadAhead
    from workers.corpus.driver import CorpusDriver
    from workers.corpus.hooks import HookList
    from workers.corpus.progress import ProgressView
    from workers.observe.run_metrics import RunObserver
    from workers.queue import connections
    from workers.queue.app import create_app

    started = time.monotonic() if started is None else started
    settings = cluster.settings
    app = create_app(settings, polled_results=True)
    client = connections.broker_client(settings, socket_timeout=5, socket_connect_timeout=5)
    try:
        # The observer names the output in its progress record, as given.
        observer = RunObserver(out_dir.display(), client, settings.run_metrics_port, settings.metrics_bind)
        hooks = HookList([ProgressView(len(planner.ops), quiet=quiet), observer])
        driver = CorpusDriver(app, cluster, planner, out_dir, hooks)
        driver.run()
    finally:
        client.close()
    cluster.stop(completed=True)  # every shard file exists: nothing is in flight
    planner.join()
    if planner.error is not None:
        raise planner.error
    quality = quality or QualityFilter()
    earlier = merged_report(out_dir, planner.fingerprint) if driver.ledger.done_now == 0 else None
    if earlier is not None and same_filters(earlier, quality):
        return earlier
    report = RunReport(wall_seconds=round(time.monotonic() - started, 3), extra=dict(extra_report or {}))
    report.resubmitted_shards = driver.ledger.resubmitted
    if driver.ledger.given_up:  # shards sent shard_max_attempts times without their file: failed
        report.given_up_shards = driver.ledger.given_up
    if earlier is not None:  # a re-merge with other filters extracted nothing: the extraction's
        report.remerge_wall_seconds = report.wall_seconds  # numbers stay (speed, wall time)
        report.wall_seconds = earlier.wall_seconds
        report.resubmitted_shards = earlier.resubmitted_shards
        report.given_up_shards = earlier.given_up_shards
    report.plan_fingerprint = planner.fingerprint
    buffer_rows = cluster.settings.merge_buffer_rows
    read_ahead = ReadAhead(settings.reads_in_flight, settings.read_ahead_bytes)  # a store's shard files
    try:
        reader = PlanReader(out_dir, planner)  # done: its header and chunks known, nothing to look up
        specs, asked = reader.specs(), reader.header().ops
        return merge_outputs(out_dir, specs, report, buffer_rows, quality, asked, read_ahead)
    except VoxmillError as exc:
        raise RunError(exc.message) from None


def current_model_sha256(settings: Settings, ops: Sequence[str]) -> dict[str, str]:
    """{role: sha256} of the models in `settings.model_dir` that `ops` need (what `--redo-mixed`
    calls current); `RunError` when one is missing."""
    from pipeline.models.files import read_model_bytes, sha256_bytes
    from pipeline.models.registry import Registry
    from pipeline.records import ROLES_BY_OP

    registry = Registry.load()
    current: dict[str, str] = {}
    try:
        for role in dict.fromkeys(r for op in ops for r in ROLES_BY_OP[op]):
            path = registry.find_model(role, Path(settings.model_dir))
            current[role] = sha256_bytes(read_model_bytes(path))
    except VoxmillError as exc:
        raise RunError(exc.message) from None
    return current


def other_models_note(report: RunReport, current: dict[str, str], model_dir: Path | str) -> str | None:
    """What a run says when rows of its outputs were made by other models than `current` ({role:
    sha256} of the model folder): a rerun with other models keeps the rows it finds, even all of
    them ("all done by an earlier run"). None when every row is the current models'."""
    from pipeline.outputs.writers import made_by_other_models

    found = report.sha256s()
    if not made_by_other_models(found, current):
        return None
    said = "; ".join(
        f"{role} {', '.join(sorted(sha[:12] for sha in found[role] - {current[role]}))} in the rows, "
        f"{current[role][:12]} in the folder"
        for role in found
        if role in current and found[role] - {current[role]}
    )
    return (
        f"rows of these outputs were made by other models than those in {model_dir} ({said}); they "
        "are kept as they are: run again with --redo-mixed to delete the shards other models made "
        "and redo them"
    )


def drop_mixed_shards(out_dir: RunFolder, current: dict[str, str]) -> list[str]:
    """Delete the shard files some of whose rows another model than `current` made, so that the
    next run redoes them with the current one; their names. A run that has not started yet has none."""
    from pipeline.outputs.writers import made_by_other_models, read_shard, shard_sha256s

    dropped = []
    for name in sorted(out_dir.shard_files()):
        try:
            found = shard_sha256s(read_shard(out_dir.ref(name)))
        except VoxmillError as exc:
            raise RunError(exc.message) from None
        if made_by_other_models(found, current):
            out_dir.location.delete(name)
            dropped.append(name)
    return dropped


def merged_report(out_dir: RunFolder, fingerprint: str) -> RunReport | None:
    """The report of outputs already merged from this very plan, whatever their filters (report.json
    is written last)."""
    import json

    out = out_dir.location
    try:
        if not out.exists(RunFolder.REPORT):
            return None
        report = RunReport.from_dict(json.loads(out.read_bytes(RunFolder.REPORT)))
    except (OSError, ValueError, TypeError, AttributeError, KeyError, VoxmillError):
        return None
    return report if report.plan_fingerprint == fingerprint else None


def same_filters(report: RunReport, quality: QualityFilter) -> bool:
    """Whether a merged report's outputs were filtered as `quality` filters."""
    filters = quality.to_dict() if quality.active else None
    found = report.filters
    found = {k: v for k, v in found.items() if k != "filtered_utterances"} if found else None
    return found == filters
