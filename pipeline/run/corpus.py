"""One corpus run, from the output folder's lock to the merged outputs:

    lock the output folder -> start the workers (a port) -> plan as the listing streams by (a
    thread) -> drive the shards to their files -> stop the workers -> merge

The workers are started as soon as the folder is locked, so they load their models while this
process plans and submits the first shards. A store's lock settles (`pipeline.run.lock`) while
the planner reads the listing: nothing is written, and no shard sent, before it has. The
driver, numpy and Arrow are imported after the workers are started (`tests/unit/test_imports.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.audio.quality import QualityFilter
from pipeline.corpus.reading import Source
from pipeline.errors import RunError, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport
from pipeline.run.hooks import RunHooks
from pipeline.run.lock import lock_output
from pipeline.run.plan import Planner, PlanReader, task_ops
from pipeline.run.shard_queue import ShardQueue
from pipeline.settings import Settings


@dataclass(frozen=True)
class CorpusRun:
    """What one `voxmill extract` run is asked: the listing, the output folder, the ops, the shard
    size (0: automatic, see `Planner`), the filters of the merged features, and what the report
    adds (`extra`); `started` is a `time.monotonic()` value (default: when it runs)."""

    source: Source
    out_dir: RunFolder
    ops: Sequence[str]
    shard_size: int = 0
    quality: QualityFilter = field(default_factory=QualityFilter)
    extra: dict[str, Any] = field(default_factory=dict)
    started: float | None = None


def run_corpus(run: CorpusRun, queue: ShardQueue, hooks: RunHooks, settings: Settings) -> RunReport:
    """Run `run` on the workers `queue` reaches; `report.json`'s content. `RunError` when the run
    cannot go on.

    A resumed run that found every shard done and the outputs merged with the same filters
    returns the report it finds; with other filters it merges again and keeps the extraction's
    wall time and shards sent again or given up, the re-merge's own time being
    `remerge_wall_seconds`.
    """
    started = time.monotonic() if run.started is None else run.started
    lock = None
    try:
        lock = lock_output(run.out_dir, settings.run_state_dir)
        ready = queue.start()
        tasks = task_ops(run.ops, ready.serve_extract)
        planner = Planner(
            run.source, run.out_dir, run.ops, run.shard_size, settings, ready.processes, tasks,
            before_writing=lock.settle, entries=lock.entries,
        )
        planner.start()  # it reads the listing while the lock settles, and writes once it is sure
        lock.settle()  # before any shard is sent
        return _drive_and_merge(run, queue, planner, hooks, settings, started)
    except RunError:  # as it is: its code may be more telling (`no_consumer`)
        raise
    except VoxmillError as exc:  # an op or shard size refused before anything ran; a merge's error
        raise RunError(exc.message) from None
    finally:
        queue.stop()  # what was made for the workers, even when the folder was not locked
        if lock is not None:
            lock.close()


def _drive_and_merge(
    run: CorpusRun, queue: ShardQueue, planner: Planner, hooks: RunHooks, settings: Settings, started: float
) -> RunReport:
    from pipeline.outputs.merge import merge_outputs
    from pipeline.run.driver import CorpusDriver
    from pipeline.storage.prefetch import ReadAhead

    driver = CorpusDriver(queue, planner, run.out_dir, hooks, settings)
    driver.run()
    queue.stop(completed=True)  # every shard file exists: nothing is in flight
    planner.join()
    if planner.error is not None:
        raise planner.error
    ledger = driver.ledger
    earlier = merged_report(run.out_dir, planner.fingerprint) if ledger.done_now == 0 else None
    if earlier is not None and same_filters(earlier, run.quality):
        return earlier
    report = RunReport(wall_seconds=round(time.monotonic() - started, 3), extra=dict(run.extra))
    report.resubmitted_shards = ledger.resubmitted
    if ledger.given_up:  # shards sent shard_max_attempts times without their file: failed
        report.given_up_shards = ledger.given_up
    if earlier is not None:  # a re-merge with other filters extracted nothing: the extraction's
        report.remerge_wall_seconds = report.wall_seconds  # numbers stay (speed, wall time)
        report.wall_seconds = earlier.wall_seconds
        report.resubmitted_shards = earlier.resubmitted_shards
        report.given_up_shards = earlier.given_up_shards
    report.plan_fingerprint = planner.fingerprint
    read_ahead = ReadAhead(settings.reads_in_flight, settings.read_ahead_bytes)  # a store's shard files
    reader = PlanReader(run.out_dir, planner)  # done: its header and chunks known, nothing to look up
    specs, asked = reader.specs(), reader.header().ops
    buffer_rows = settings.merge_buffer_rows
    given_up = ledger.given_up_files()
    kept = ledger.kept  # shard files the driver read when it looked for them
    return merge_outputs(
        run.out_dir, specs, report, buffer_rows, run.quality, asked, read_ahead, given_up, kept
    )


def merged_report(out_dir: RunFolder, fingerprint: str) -> RunReport | None:
    """The report of outputs already merged from this very plan, whatever their filters (report.json
    is written last)."""
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
