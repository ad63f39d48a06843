"""`voxmill extract`: one corpus run on workers reached through Celery and Redis.

    the listing's first lines -> the workers (remote ones, or an embedded Redis and local ones,
    spawned once the output folder is locked) and who watches the run -> `pipeline.run.corpus`
    (lock, plan, drive, merge)

`out_dir` (a `pipeline.outputs.folder.RunFolder`) may be in an object store (`s3://bucket/run/`):
the plan, the shard objects and the merged outputs are written there, and what must stay local
(the lock's flock, an embedded run's `workers.log`) is in `run_state_dir/<hash of the URL>/`
(`RunFolder.local_state`; see `pipeline.run.lock.StoreLock`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.audio.quality import QualityFilter
from pipeline.corpus.reading import Source
from pipeline.corpus.roots import corpus_roots
from pipeline.errors import RunError, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport
from pipeline.run.corpus import CorpusRun, run_corpus
from pipeline.run.hooks import HookList
from pipeline.settings import Settings
from workers.corpus.cluster import Cluster, EmbeddedCluster, RemoteCluster
from workers.corpus.progress import ProgressView
from workers.corpus.shard_queue import CeleryShardQueue
from workers.observe.run_metrics import RunObserver


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
    filters = quality or QualityFilter()
    run = CorpusRun(source, out_dir, ops, shard_size, filters, {"input": str(source)}, started)
    cluster: Cluster
    try:
        check_first_lines(source, settings.max_text_chars)  # before any folder or worker is made
        if settings.broker_url:
            cluster = RemoteCluster(settings)
        else:
            # Paths only: the local workers may read there (folders, and the listing's URL prefixes).
            folders, prefixes = corpus_roots(source)
            cluster = EmbeddedCluster(settings, folders, out_dir, ops, workers, prefixes)
    except RunError:
        raise
    except VoxmillError as exc:
        raise RunError(exc.message) from None
    queue = CeleryShardQueue(cluster, quiet)
    # The observer names the output in its progress record, as given.
    observer = RunObserver(
        out_dir.display(), lambda: queue.client, settings.run_metrics_port, settings.metrics_bind
    )
    hooks = HookList([ProgressView(len(ops), quiet=quiet), observer])
    return run_corpus(run, queue, hooks, settings)


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
