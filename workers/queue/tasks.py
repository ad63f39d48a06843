"""voxmill's Celery tasks: thin glue from a decoded payload to one `pipeline` call.

Payloads are JSON (or msgpack when they carry raw bytes):
- `voxmill.tokenize|embed|extract`: `{"path": str}` or `{"audio": bytes, "name": str?}`; the
  result is the contract's `TaskResult`.
- `voxmill.shard`: a `ShardSpec` dict (with `attempt`, the driver's count of its sends: a first
  one does not look for the file first); the task writes the shard file (in a folder, or one
  object in a store when `out_dir` is a URL: uploaded behind the task, while the process computes
  its next shard, `uploads_behind`), then announces its `ShardResult` on the run's channel
  (`keys.SHARDS_DONE_CHANNEL`). It stores no Celery result. A tar shard (`ShardSpec.tar`) reads
  its tar as a stream and writes a row per sample it held; a segment is decoded by seeking. A
  result the file cannot hold is stored as its utterance's `output_error`; a shard whose file
  cannot be written, or that meets an unexpected exception, is announced failed (`output_error`,
  `internal`), and the driver sends it again, up to `shard_max_attempts` times.
Paths are confined to the allowed roots and URLs to the allowed URL prefixes (`pipeline.storage.paths`).
Bad input is a result with an error code. Only a missing model (still loading, or a failed load
that a later generation may fix) is retried, with bounded backoff, and then is a `model_error`
result. Each task's id is in its process's heartbeat record from its start until its result is
stored (`workers.worker.track_running`): a producer sends again only a job no live worker runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import redis
from celery import Celery, Task

from pipeline import errors
from pipeline.audio.decode import Segment
from pipeline.audio.sources import Source, prefetch_clips
from pipeline.batching import BatchRule, ClipSource, JobGathering, run_clips
from pipeline.errors import ErrorRecord, ModelUnavailable, VoxmillError
from pipeline.inference import run_clip
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import shard_counts, shard_file_table, storable_results, write_table_at
from pipeline.records import (
    ROLE_TOKENIZER,
    ROLES_BY_OP,
    ModelRef,
    ShardResult,
    ShardSpec,
    TaskResult,
    Utterance,
    models_to_dict,
)
from pipeline.storage.paths import ConfinedPath, Roots, resolve_allowed
from pipeline.storage.prefetch import ReadAhead
from pipeline.storage.urls import MAX_TEXT_CHARS, check_length
from workers import keys
from workers.queue.app import SHARD_TASK, TASK_NAMES

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pipeline.audio.vad import SpeechCheck
    from pipeline.models.sessions import ModelSession
    from pipeline.settings import AudioLimits, Settings
    from pipeline.storage.behind import BackgroundWrites
    from workers.metrics import NoMetrics

log = logging.getLogger("voxmill.tasks")


class WorkerProcess(Protocol):
    """What a task needs of the process that runs it (`workers.worker.WorkerProcess` is one): its
    settings and limits, the roots it reads below, its speech check, metrics, Redis connection
    (None without a broker), the sessions of a task's models, where concurrent single jobs
    share batches (None: they do not), where shard files are uploaded behind their tasks (None:
    by the tasks) and the ids its heartbeat record says it runs (`task_started`, `task_finished`:
    counted, so an id stays while its task or its upload runs)."""

    settings: Settings
    roots: Roots
    limits: AudioLimits
    speech: SpeechCheck
    metrics: NoMetrics
    redis: Any
    gathering: JobGathering | None
    writes: BackgroundWrites | None

    def task_started(self, task_id: str) -> None: ...

    def task_finished(self, task_id: str) -> None: ...

    def serving(self, roles: Sequence[str]) -> AbstractContextManager[dict[str, ModelSession]]: ...


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


def decode_job(
    job: Any,
    roots: Roots | Sequence[Path],
    url_roots: Sequence[str] = (),
    max_text_chars: int = MAX_TEXT_CHARS,
) -> tuple[str, ConfinedPath | str | bytes]:
    """(label, source) of a single-audio payload; `bad_request` or `forbidden_path` when it is
    wrong. A `path` may be a URL, confined to `url_roots`; a local one comes back confined
    (read it as it is: `load_audio` opens it without a window). Every string is at most
    `max_text_chars` long, checked before any pattern or path call."""
    if isinstance(job, MalformedCall):
        raise VoxmillError(errors.BAD_REQUEST, job.message)
    if not isinstance(job, dict):
        raise VoxmillError(errors.BAD_REQUEST, f"job must be an object, not {type(job).__name__}")
    for key in ("path", "name"):
        if isinstance(job.get(key), str):
            check_length(job[key], f"'{key}'", max_text_chars)
    if "path" in job:
        path = job["path"]
        if not isinstance(path, str):
            raise VoxmillError(errors.BAD_REQUEST, f"'path' must be a string, not {type(path).__name__}")
        return path, resolve_allowed(path, roots, url_roots, max_text_chars)
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


def job_label(job: Any, max_chars: int = MAX_TEXT_CHARS) -> str:
    """A printable name for a job, even a malformed one; a string over `max_chars` is cut there
    (its result and log line do not carry megabytes back)."""
    if isinstance(job, dict):
        for key in ("path", "name"):
            text = job.get(key)
            if isinstance(text, str):
                return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text)} characters)"
    return "<invalid job>"


def retry_countdown(retries: int) -> float:
    """Bounded exponential backoff: 1, 2, 4 ... 30 s."""
    return float(min(30, 2**retries))


def run_job(process: WorkerProcess, task: Task, op: str, job: Any) -> dict[str, Any]:
    """One audio, one op: the contract's result object."""
    settings = process.settings
    try:
        label, source = decode_job(job, process.roots, settings.allowed_url_roots, settings.max_text_chars)
    except VoxmillError as exc:
        return TaskResult(input=job_label(job, settings.max_text_chars), op=op, error=exc.record()).to_dict()
    started = time.perf_counter()
    try:
        with process.metrics.in_flight(), process.serving(ROLES_BY_OP[op]) as sessions:
            result = _clip_results(process, op, [(label, source, None)], sessions, single_job=True)[0]
    except ModelUnavailable as exc:
        retries = process.settings.model_retries
        if task.request.retries >= retries:  # the producer is told why, as a result
            result = TaskResult(input=label, op=op, error=exc.record())
            log_result(task, result)
            return result.to_dict()
        raise task.retry(
            exc=exc, countdown=retry_countdown(task.request.retries), max_retries=retries
        ) from exc
    record(process, op, [result], time.perf_counter() - started)
    log_result(task, result)
    return result.to_dict()


def run_shard(process: WorkerProcess, task: Task, payload: Any) -> dict[str, Any]:
    """A corpus shard: every utterance, then the shard file, then one announcement that names it.
    A file bound for a store is uploaded behind the task (`process.writes`), which ends at once:
    its id stays in the heartbeat record and its announcement waits until the file is written."""
    outcome = _shard_result(process, task, payload)
    if isinstance(outcome, ShardResult):
        result = outcome
    elif process.writes is None or outcome.local:
        result = outcome.write()
    else:
        process.task_started(task.request.id)  # running until its file is written
        process.writes.submit(_announced_behind(process, task.request.id, payload, outcome))
        return outcome.result.to_dict()
    announce(process, payload, result)
    return result.to_dict()


def _announced_behind(
    process: WorkerProcess, task_id: str, payload: Any, shard: ComputedShard
) -> Callable[[], None]:
    def write_and_announce() -> None:
        try:
            announce(process, payload, shard.write())
        finally:
            process.task_finished(task_id)

    return write_and_announce


def announce(process: WorkerProcess, payload: Any, result: ShardResult) -> None:
    """Publish a shard's result on its run's channel (the driver finds the file anyway)."""
    run = payload.get("run") if isinstance(payload, dict) else None
    if run and process.redis is not None:
        try:
            process.redis.publish(keys.SHARDS_DONE_CHANNEL.format(run=run), json.dumps(result.to_dict()))
        except redis.RedisError as exc:  # the driver finds the file at its next look
            log.warning("could not announce shard %s: %s", result.name, exc)


@dataclass(frozen=True)
class ComputedShard:
    """A shard whose results are known and whose file is still to be written."""

    result: ShardResult  # as announced once `table` is `name` in `out`
    out: RunFolder
    table: pa.Table
    payload: Any
    record: Callable[[], None]  # its metrics, once written

    @property
    def local(self) -> bool:
        return self.out.location.is_local

    def write(self) -> ShardResult:
        """Write the file: the shard's result, or why it failed (`output_error`, `internal`)."""
        name = self.out.shard_file(self.result.op, self.result.shard)
        try:
            write_table_at(self.out.location, name, self.table)
        except VoxmillError as exc:  # the file cannot be written: the driver sends the shard again
            return failed_shard(self.payload, exc)
        except Exception as exc:
            return failed_shard(self.payload, unexpected(exc, f"cannot write shard {self.result.name}"))
        self.record()
        return self.result


def _shard_result(process: WorkerProcess, task: Task, payload: Any) -> ShardResult | ComputedShard:
    started = time.perf_counter()
    try:
        spec = ShardSpec.from_dict(payload)
        out = _output(spec.out_dir, process)
        if spec.op not in ROLES_BY_OP:
            raise VoxmillError(errors.BAD_REQUEST, f"unknown op {spec.op!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return failed_shard(payload, VoxmillError(errors.BAD_REQUEST, f"malformed shard payload: {exc}"))
    except VoxmillError as exc:
        return failed_shard(payload, exc)
    done = _written_before(out, spec, payload, task)
    if done is not None:  # a redelivered or resubmitted shard that is already written
        return done
    try:
        with process.metrics.in_flight(), process.serving(ROLES_BY_OP[spec.op]) as sessions:
            if spec.tar:
                utts, results = _tar_results(process, spec, sessions)
            else:
                utts = spec.utts
                results = _utterance_results(process, spec.op, utts, sessions)
            models = {role: s.ref for role, s in sessions.items()}
    except ModelUnavailable as exc:
        if task.request.retries >= process.settings.model_retries:
            return failed_shard(payload, exc)
        raise task.retry(
            exc=exc,
            countdown=retry_countdown(task.request.retries),
            max_retries=process.settings.model_retries,
        ) from exc
    except Exception as exc:  # a bug, a time limit: said at once, and the driver sends the shard again
        return failed_shard(payload, unexpected(exc, f"shard {spec.name}"))
    try:  # a row the file cannot hold is stored as that utterance's output_error
        results = storable_results(spec.op, results, utts)  # and counted so in the announcement
        table = shard_file_table(spec, results, utts)  # of those very results: checked once
    except VoxmillError as exc:
        return failed_shard(payload, exc)
    except Exception as exc:
        return failed_shard(payload, unexpected(exc, f"cannot make shard {spec.name}'s file"))
    ok = sum(1 for r in results if r.ok)
    seconds = time.perf_counter() - started
    result = ShardResult(
        shard=spec.shard,
        op=spec.op,
        path=str(out.ref(out.shard_file(spec.op, spec.shard))),
        ok=ok,
        failed=len(results) - ok,
        audio_seconds=round(sum(r.audio_seconds or 0.0 for r in results), 4),
        seconds=round(seconds, 4),
        models=models,
    )
    return ComputedShard(
        result, out, table, payload, lambda: record(process, spec.op, results, seconds, outcome="ok")
    )


def _written_before(out: RunFolder, spec: ShardSpec, payload: Any, task: Task) -> ShardResult | None:
    if not may_be_written(payload, task):
        return None
    try:
        return finished_shard(out, spec)
    except VoxmillError as exc:  # the store cannot say: do the shard (a rewrite is harmless)
        log.warning("cannot look for shard %s: %s", spec.name, exc.message)
        return None


def may_be_written(payload: Any, task: Task) -> bool:
    """Whether the shard's file may exist already: a shard the driver sends again (`attempt` over
    1), a message the broker delivers again, or a payload that does not say. A first attempt
    spares the request that would look (a round trip on a store)."""
    attempt = payload.get("attempt") if isinstance(payload, dict) else None
    redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
    return redelivered or not (isinstance(attempt, int) and attempt == 1)


def _output(out_dir: str, process: WorkerProcess) -> RunFolder:
    """The shard's run folder: a folder inside the roots, or a URL inside the URL prefixes."""
    return RunFolder.of(resolve_allowed(out_dir, process.roots, process.settings.allowed_url_roots))


def _utterance_results(
    process: WorkerProcess, op: str, utts: Sequence[Utterance], sessions: Any
) -> list[TaskResult]:
    """Each utterance's result, in order; objects at URLs are read ahead of the model
    (`reads_in_flight` at once, `read_ahead_bytes` held), local files as they always were."""
    folders: dict[str, str] = {}  # a shard's clips mostly share a few folders: each resolved once
    sources = [_allowed(process, u, folders) for u in utts]
    urls = [s if isinstance(s, str) else None for s in sources]  # an allowed str is a URL
    settings = process.settings
    if settings.reads_in_flight <= 1 or not any(urls):
        return _clip_results(process, op, _clips(utts, sources), sessions)
    ahead = ReadAhead(settings.reads_in_flight, settings.read_ahead_bytes)
    with closing(prefetch_clips(urls, process.limits, ahead)) as fetched:
        read = (s if f is None else f for s, f in zip(sources, fetched, strict=True))
        return _clip_results(process, op, _clips(utts, read), sessions)


def _clips(utts: Sequence[Utterance], sources: Iterable[Source | VoxmillError]) -> Iterator[ClipSource]:
    for utt, source in zip(utts, sources, strict=True):
        segment = Segment(utt.start_s or 0.0, utt.end_s, utt.channel) if utt.is_segment else None
        yield utt.utt, source, segment


def _clip_results(
    process: WorkerProcess,
    op: str,
    clips: Iterable[ClipSource],
    sessions: dict[str, ModelSession],
    limits: AudioLimits | None = None,
    single_job: bool = False,
) -> list[TaskResult]:
    """Each clip's result, in order (`clips`: label, what to read or why it cannot be, segment):
    its tokens from batches where the tokenizer has a batch twin and the rule takes them
    (`pipeline.batching`), else one clip at a time. A `single_job` batches only with the jobs
    running beside it (`process.gathering`), else runs alone."""
    limits = limits or process.limits
    tokenizer = sessions.get(ROLE_TOKENIZER)
    gathering = process.gathering if single_job else None
    if tokenizer is not None and tokenizer.twin is not None and (gathering or not single_job):
        rule = BatchRule.from_settings(process.settings, tokenizer.twin.choice.serving)
        if rule is not None:
            return run_clips(clips, op, sessions, limits, process.speech, rule, gathering)
    return [
        TaskResult(input=label, op=op, error=source.record())
        if isinstance(source, VoxmillError)
        else run_clip(label, source, op, sessions, limits, process.speech, segment)
        for label, source, segment in clips
    ]


def _allowed(process: WorkerProcess, utt: Utterance, folders: dict[str, str]) -> Source | VoxmillError:
    """What the utterance reads: its path confined to the roots or its URL to the URL prefixes."""
    try:
        return resolve_allowed(utt.path, process.roots, process.settings.allowed_url_roots, folders=folders)
    except VoxmillError as exc:
        return exc


def _tar_results(
    process: WorkerProcess, spec: ShardSpec, sessions: Any
) -> tuple[list[Utterance], list[TaskResult]]:
    """Every sample of the shard's tar, read as a stream: (what the tar held, their results). A
    tar that cannot be opened is one row, keyed by the tar, with the reason."""
    from pipeline.corpus.tars import iter_samples
    from pipeline.storage.objects import open_input

    limits = process.limits
    # A tar member is a file of the corpus: the file limit bounds it, not the raw-bytes job limit.
    member_limits = replace(limits, max_payload_bytes=limits.max_file_bytes)
    utts: list[Utterance] = []
    try:
        source = resolve_allowed(spec.tar, process.roots, process.settings.allowed_url_roots)
        stream = open_input(source)
    except VoxmillError as exc:
        return [Utterance(spec.tar, spec.tar)], [TaskResult(input=spec.tar, op=spec.op, error=exc.record())]
    except OSError as exc:
        code = errors.NOT_FOUND if isinstance(exc, FileNotFoundError) else errors.UNREADABLE
        error = ErrorRecord(code, f"cannot open {spec.tar}: {exc.strerror or exc}")
        return [Utterance(spec.tar, spec.tar)], [TaskResult(input=spec.tar, op=spec.op, error=error)]
    def clips() -> Iterator[ClipSource]:
        for sample in iter_samples(stream, spec.tar, limits.max_file_bytes):
            where = f"{spec.tar}#{sample.audio_name}"
            utts.append(Utterance(sample.key, where, sample.spk, sample.transcript))
            if sample.error is not None or sample.audio is None:
                yield sample.key, sample.error or VoxmillError(errors.NOT_FOUND, "no audio"), None
            else:
                yield sample.key, sample.audio, None

    with stream:
        results = _clip_results(process, spec.op, clips(), sessions, member_limits)
    return utts, results


def record(
    process: WorkerProcess, op: str, results: list[TaskResult], seconds: float, outcome: str | None = None
) -> None:
    """Metrics of one task: latency and outcome (default: the first result's), each failure's code."""
    if results:
        label = model_label(results[0].models)
        process.metrics.task_done(op, label, outcome or outcome_of(results[0]), seconds)
    for result in results:
        if result.error is not None:
            process.metrics.failure(op, outcome_of(result))


def model_label(models: dict[str, ModelRef]) -> str:
    """The `model_sha256` label of a result: the sha256 (first 12) of each model used."""
    return ",".join(f"{role}:{ref.sha256[:12]}" for role, ref in sorted(models.items()))


def outcome_of(result: TaskResult) -> str:
    """`ok` or the error code."""
    return "ok" if result.error is None else result.error.code


def finished_shard(out: RunFolder, spec: ShardSpec) -> ShardResult | None:
    """The counts of a shard whose file already exists (files are complete or absent), else None."""
    name = out.shard_file(spec.op, spec.shard)
    if not out.location.exists(name):
        return None
    path = out.ref(name)
    try:
        ok, failed = shard_counts(path)
    except Exception:  # unreadable: do the shard again and replace it
        return None
    return ShardResult(
        shard=spec.shard, op=spec.op, path=str(path), ok=ok, failed=failed, audio_seconds=0.0, seconds=0.0
    )


def unexpected(exc: Exception, what: str) -> VoxmillError:
    """An exception no code was meant for, as an `internal` error naming its class."""
    log.exception("%s failed unexpectedly", what)
    return VoxmillError(errors.INTERNAL, f"{what}: {type(exc).__name__}: {str(exc)[:200]}")


def failed_shard(payload: Any, exc: VoxmillError) -> ShardResult:
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
        error=exc.record(),
    )


def log_result(task: Task, result: TaskResult) -> None:
    """One line per task: id, op, input, outcome, duration and model sha256."""
    outcome = "ok" if result.error is None else result.error.code
    shas = ",".join(f"{role}={m.sha256[:12]}" for role, m in result.models.items())
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
            "models": models_to_dict(result.models),
        },
    )


def register_tasks(app: Celery, process: WorkerProcess) -> None:
    """Define voxmill's task handlers on `app`, serving from `process`."""

    def job_task(op: str) -> None:
        @app.task(name=TASK_NAMES[op], bind=True)
        def handler(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return run_job(process, self, op, job_argument(args, kwargs))

    for op in TASK_NAMES:
        job_task(op)

    @app.task(name=SHARD_TASK, bind=True, ignore_result=True)
    def shard(self: Task, payload: Any) -> dict[str, Any]:
        return run_shard(process, self, payload)
