"""`voxmill`: the command line. It only parses and dispatches; the work lives below it."""

from __future__ import annotations

import gc
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console

from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.outputs.folder import RunFolder
    from pipeline.outputs.report import RunReport

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)
models_app = typer.Typer(help="Inspect, verify and create model files.", no_args_is_help=True)
app.add_typer(models_app, name="models")
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def load_settings(models: Path | None = None) -> Settings:
    """The settings, with `--models` (when given) as the model folder."""
    try:
        settings = Settings.load()
    except Exception as exc:  # pydantic's validation errors are readable as they are
        err.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None
    return settings if models is None else settings.model_copy(update={"model_dir": models})


def require_broker(settings: Settings) -> str:
    if not settings.broker_url:
        from workers.queue.client import BrokerNotConfigured

        err.print(f"[red]error:[/red] {BrokerNotConfigured()}")
        raise typer.Exit(2)
    return settings.broker_url


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, then exit (2: the command could not run)."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


def require_models(settings: Settings, queues: Sequence[str], folder_only: bool = False) -> None:
    """Exit 2 with the fix when the model folder is missing (or, unless `folder_only`, lacks a model
    the queues need), before anything starts."""
    from pipeline.errors import VoxmillError
    from pipeline.models.registry import Registry
    from pipeline.records import ROLES_BY_OP

    folder = settings.model_dir
    hint = (
        "; pass --models DIR (after `make demo`: --models demo/models), set VOXMILL_MODEL_DIR, or create "
        f"stand-ins with `voxmill models make-standin --out {folder}`"
    )
    if not Path(folder).is_dir():
        fail(f"model folder {folder} does not exist{hint}")
    if folder_only:
        return
    registry = Registry.load()
    for role in dict.fromkeys(r for queue in queues for r in ROLES_BY_OP.get(queue, ())):
        try:
            registry.find_model(role, settings.model_dir)
        except VoxmillError as exc:
            fail(exc.message)


def note(text: str) -> None:
    """One line on stderr that the person running the command should read; it changes nothing."""
    from rich.markup import escape

    err.print(f"[yellow]note:[/yellow] {escape(text)}")


def check_where_it_runs(
    settings: Settings, ops: Sequence[str], workers_given: bool, models_given: bool
) -> None:
    """`extract` with local workers: their model folder, checked before anything starts. On a
    broker: one line when options of a run with its own workers were given (a shell where `voxmill
    up`'s export line was run makes every `extract` a broker run)."""
    if not settings.broker_url:
        require_models(settings, ops)
        return
    given = [name for name, on in (("--workers", workers_given), ("--models", models_given)) if on]
    if given:
        note(
            f"VOXMILL_BROKER_URL is set ({settings.redacted_broker_url()}): this run starts no workers and "
            f"sends its shards to the workers on that broker, so {' and '.join(given)} "
            f"appl{'y' if len(given) > 1 else 'ies'} to local workers only; unset VOXMILL_BROKER_URL for "
            "a run with workers of its own"
        )


def other_models_notice(settings: Settings, ops: Sequence[str], report: RunReport) -> None:
    """A note when a run's local workers (the model folder's models) found rows other models made."""
    from workers.corpus.plan import RunError
    from workers.extract import current_model_sha256, other_models_note

    if settings.broker_url:  # workers elsewhere, with models of their own
        return
    try:
        said = other_models_note(report, current_model_sha256(settings, ops), settings.model_dir)
    except RunError:  # a model gone since the run began: nothing to compare with
        return
    if said:
        note(said)


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


MODELS_HELP = "Model folder (default: the model_dir setting, VOXMILL_MODEL_DIR)."
QUEUES_HELP = "Queues to consume, comma-separated: tokenize, embed, extract."
WORKERS_HELP = "Worker processes; default: one per core."


def version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"voxmill {version('voxmill')}")
        raise typer.Exit()


@app.callback()
def root(
    show_version: bool = typer.Option(
        False, "--version", callback=version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """voxmill: speech tokens and speaker embeddings for CosyVoice-style TTS, over Celery and Redis."""


# --------------------------------------------------------------------------------- serving
@app.command()
def worker(
    queues: str = typer.Option("tokenize,embed,extract", "-Q", "--queues", help=QUEUES_HELP),
    concurrency: int = typer.Option(0, "-c", "--concurrency", help=WORKERS_HELP, show_default=False),
    pool: str = typer.Option(
        "prefork", "--pool", help="prefork, solo or threads (solo or threads on a GPU)."
    ),
    models: Path | None = typer.Option(None, "--models", help=MODELS_HELP),
    loglevel: str = typer.Option("", "-l", "--loglevel", help="Log level; default: the log_level setting."),
    hostname: str = typer.Option("", "-n", "--hostname", help="Celery node name; default: celery@HOST."),
    log_format: str = typer.Option("", "--log-format", help="text or json; default: the log_format setting."),
) -> None:
    """Run a Celery worker whose processes hold warm model sessions.

    The same as `celery -A workers.app worker --without-mingle --without-gossip`: voxmill never
    revokes tasks, so a worker does not spend a second at start asking its neighbours for their
    revoked ids (mingle), nor follow every other worker's heartbeats (gossip). A model file
    missing from the folder is loaded as soon as it lands; a missing folder is an error.
    """
    from workers.worker import build_worker_app, check_pool_for_provider, start_worker

    settings = load_settings(models)
    if log_format:
        settings = settings.model_copy(update={"log_format": log_format})
    require_broker(settings)
    problem = check_pool_for_provider(settings, pool)
    if problem:
        fail(problem)
    require_models(settings, split_list(queues), folder_only=True)
    code = start_worker(
        build_worker_app(settings),
        split_list(queues),
        concurrency or os.cpu_count() or 1,
        pool,
        loglevel or settings.log_level,
        hostname,
    )
    raise typer.Exit(code)


@app.command()
def up(
    workers: int = typer.Option(0, "--workers", "-w", help=WORKERS_HELP, show_default=False),
    queues: str = typer.Option("tokenize,embed,extract", "-Q", "--queues", help=QUEUES_HELP),
    models: Path | None = typer.Option(None, "--models", help=MODELS_HELP),
    no_watch: bool = typer.Option(False, "--no-watch", help="Do not start the model watcher."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the workers' and watcher's logs here."),
    log: Path = typer.Option(
        Path(".voxmill/up.log"), "--log", help="Where the workers' and watcher's logs go (without --verbose)."
    ),
) -> None:
    """Run an embedded Redis, N worker processes and the model watcher in the foreground.

    It prints the `export VOXMILL_BROKER_URL=...` line to run in another shell; Ctrl-C stops
    everything.
    """
    from pipeline.redaction import redact
    from workers.embedded import LocalCluster, ProcessExited

    settings = load_settings(models)
    require_models(settings, split_list(queues))
    count = workers or os.cpu_count() or 1
    log_path = None if verbose else log
    cluster = LocalCluster(settings, count, split_list(queues), watch=not no_watch, log_path=log_path)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cluster.start()
        out.print(f"voxmill is up: {count} worker process(es), models from {settings.model_dir}")
        if log_path is not None:
            out.print(f"worker and watcher logs: {log_path} (--verbose shows them here)")
        out.print("In another shell:")
        if cluster.redis is not None:
            # The one place the embedded Redis's password is shown: its user needs it to connect.
            print(f"  export VOXMILL_BROKER_URL={shlex.quote(cluster.broker_url)}", flush=True)
        else:  # the user's own broker: they have its URL already, and it is not ours to print
            out.print(f"  (VOXMILL_BROKER_URL as set: {settings.redacted_broker_url()})")
        out.print("  voxmill submit tokenize demo/corpus/audio/spk1/spk1_000.wav")
        out.print("Ctrl-C stops everything.")
        sys.stdout.flush()
        cluster.wait()
    except KeyboardInterrupt:
        out.print("stopping…")
    except ProcessExited as exc:  # a part exited
        fail(redact(exc.message), code=1)
    except TimeoutError as exc:  # the workers never got ready
        fail(redact(str(exc)), code=1)
    finally:
        cluster.stop()


@app.command()
def watch(
    models: Path | None = typer.Option(None, "--models", "--model-dir", help=MODELS_HELP),
    log_format: str = typer.Option("", "--log-format", help="text or json; default: the log_format setting."),
) -> None:
    """Watch the model folder: validate each new model file and publish it; the workers swap to it."""
    from workers.observe.logs import setup_logging
    from workers.reload.watcher import serve

    settings = load_settings(models)
    require_broker(settings)
    setup_logging(settings.log_level, log_format or settings.log_format)
    serve(settings)


# --------------------------------------------------------------------------------- producing
@app.command()
def submit(
    op: str = typer.Argument(..., metavar="OP", help="tokenize, embed or extract."),
    audio: list[Path] = typer.Argument(
        ..., metavar="AUDIO...", help="Audio files (sent as paths the workers read)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per input, one per line."),
    send_bytes: bool = typer.Option(False, "--bytes", help="Send the files' bytes instead of their paths."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for all results."),
) -> None:
    """Submit audio to the workers and print one result per input, in input order.

    Exit 0 when every input succeeded, 1 when any failed (each failure is a result with an error
    code), 2 when it could not run at all (no broker configured or reachable, a bad op).
    """
    if op not in ("tokenize", "embed", "extract"):
        fail(f"op must be tokenize, embed or extract, not {op!r}")
    import redis
    from kombu.exceptions import OperationalError

    from workers.queue.client import Client, NoConsumer, read_payload

    settings = load_settings()
    require_broker(settings)
    client = Client(settings)
    jobs, refused = [], {}
    try:
        for index, path in enumerate(audio):
            if not send_bytes:
                jobs.append(client.submit(op, path))
                continue
            payload, problem = read_payload(path, op, settings.max_payload_bytes)
            if problem is not None:
                refused[index] = problem
            else:
                jobs.append(client.submit(op, payload, name=str(path)))
        answered = iter(client.wait_all(jobs, timeout_s=timeout))
        results = [refused[i] if i in refused else next(answered) for i in range(len(audio))]
    except NoConsumer as exc:
        fail(exc.message)
    except (OperationalError, redis.RedisError) as exc:
        fail(f"cannot reach the broker at {settings.redacted_broker_url()}: {exc}")
    for result in results:
        if as_json:
            print(json.dumps(result.to_dict()), flush=True)
        else:
            print_result(result)
    raise typer.Exit(1 if any(not r.ok for r in results) else 0)


def print_result(result: object) -> None:
    from rich.markup import escape

    from pipeline.records import TaskResult

    assert isinstance(result, TaskResult)
    if result.error:
        out.print(
            f"[red]✗[/red] {escape(result.input)}: {result.error.code}: {escape(result.error.message)}"
        )
        return
    parts = [f"{result.audio_seconds:.2f} s"]
    if result.speech_token is not None:
        parts.append(f"{len(result.speech_token)} tokens")
    if result.embedding is not None:
        parts.append(f"embedding[{len(result.embedding)}]")
    out.print(f"[green]✓[/green] {escape(result.input)}: {', '.join(parts)}")


# --------------------------------------------------------------------------------- corpora
def fraction_option(value: float | None) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise typer.BadParameter(f"{value:g} is not a fraction from 0 to 1")
    return value


def seconds_option(value: float | None) -> float | None:
    if value is not None and value < 0.0:
        raise typer.BadParameter(f"{value:g} is not a number of seconds (0 or more)")
    return value


@app.command()
def extract(
    source: str = typer.Argument(
        ...,
        metavar="INPUT",
        help="A Kaldi data dir (wav.scp; segments and reco2dur optional), a JSONL manifest, lhotse cuts "
        "(cuts.jsonl[.gz]) or a recordings + supervisions pair, WebDataset .tar shards (one .tar, a "
        "folder of them, a .txt list, or a pattern such as shards/{000000..000127}.tar; local or "
        "s3://, gs://, https://), or a folder of audio.",
    ),
    out_dir: str = typer.Option(
        ...,
        "--out",
        metavar="DIR",
        help="Output folder or object-store prefix (s3://bucket/run/, gs://...); running the command "
        "again on it resumes.",
    ),
    ops: str = typer.Option(
        "tokenize,embed", "--ops", metavar="OPS", help="Comma-separated: tokenize, embed."
    ),
    models: Path | None = typer.Option(
        None, "--models", metavar="DIR", help=MODELS_HELP + " Local workers only."
    ),
    workers: int = typer.Option(
        0,
        "--workers",
        metavar="N",
        help="Local worker processes; default: one per core. None with VOXMILL_BROKER_URL set (a note "
        "says so).",
        show_default=False,
    ),
    shard_size: int = typer.Option(
        0,
        "--shard-size",
        metavar="N",
        help="Utterances per shard task; default: the shard_size setting, more for short clips when "
        "the listing gives durations (shard_seconds of audio), fewer for a small corpus so that "
        "every worker gets several shards.",
        show_default=False,
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    audit_sample: int = typer.Option(
        0,
        "--audit",
        metavar="N",
        help="Then audit this many utterances (as `voxmill audit`); exit 1 when the audit fails.",
        show_default=False,
    ),
    metrics_port: int = typer.Option(
        0,
        "--metrics-port",
        metavar="N",
        help="Serve this run's Prometheus metrics (shards, utterances, audio, failures, ETA) on this port.",
        show_default=False,
    ),
    # Ranges are checked by callbacks, not typer's min/max: those print `<float range> [0.0<=x<=1.0]`
    # beside each option, which squeezed the help text into 23 columns of an 80-column terminal.
    min_speech_ratio: float | None = typer.Option(
        None,
        "--min-speech-ratio",
        metavar="R",
        callback=fraction_option,
        help="Leave out utterances whose detected speech is a smaller fraction of them (0-1; needs the "
        "speech check on). Filtered utterances are listed in errors.jsonl with code `filtered`.",
    ),
    max_clipped: float | None = typer.Option(
        None,
        "--max-clipped",
        metavar="F",
        callback=fraction_option,
        help="Leave out utterances with a larger fraction of clipped samples (0-1).",
    ),
    min_duration: float | None = typer.Option(
        None,
        "--min-duration",
        metavar="S",
        callback=seconds_option,
        help="Leave out utterances shorter than this many seconds.",
    ),
    max_duration: float | None = typer.Option(
        None,
        "--max-duration",
        metavar="S",
        callback=seconds_option,
        help="Leave out utterances longer than this many seconds.",
    ),
    redo_mixed: bool = typer.Option(
        False,
        "--redo-mixed",
        help="First delete the shards that a model other than the one in the model folder made (a run "
        "that spanned a model change), so this run redoes them.",
    ),
) -> None:
    """Extract speech tokens and speaker embeddings for a whole corpus, in shards, resumably.

    Without VOXMILL_BROKER_URL it starts an embedded Redis and local workers; with it (as in a
    shell where `voxmill up`'s export line was run), it only submits shards and waits for workers
    anywhere that can read the same paths or URLs, and write --out. Exit 0 when the run completed
    (per-utterance failures are in errors.jsonl), 2 when it could not run (a queue of the run no
    live worker consumes too: at once, or after consumer_grace_s when its workers are gone
    mid-run). The filters apply when the shards are merged: changing them re-merges and extracts
    nothing.
    """
    from pipeline.audio.quality import QualityFilter
    from pipeline.corpus.reading import as_source
    from pipeline.errors import VoxmillError
    from pipeline.outputs.folder import RunFolder
    from workers.corpus.plan import RunError
    from workers.extract import current_model_sha256, drop_mixed_shards, extract_corpus

    op_list = split_list(ops)
    if not op_list or [op for op in op_list if op not in ("tokenize", "embed")]:
        fail(f"--ops takes tokenize and/or embed, not {ops!r}")
    settings = load_settings(models)
    try:
        folder = RunFolder.of(out_dir)
    except VoxmillError as exc:  # a URL that cannot hold outputs (http://, credentials in it)
        fail(exc.message)
    if audit_sample and not folder.is_local:
        fail("--audit reads a local output folder; download the outputs and run `voxmill audit` on them")
    if metrics_port:
        settings = settings.model_copy(update={"run_metrics_port": metrics_port})
    check_where_it_runs(settings, op_list, workers > 0, models is not None)
    quality = QualityFilter(min_speech_ratio, max_clipped, min_duration, max_duration)
    if min_speech_ratio is not None and not settings.speech_check:
        err.print("[yellow]note:[/yellow] the speech check is off: --min-speech-ratio filters nothing")
    try:
        if redo_mixed:
            dropped = drop_mixed_shards(folder, current_model_sha256(settings, op_list))
            err.print(f"--redo-mixed: {len(dropped)} shard file(s) made by another model deleted")
        local_workers = workers or os.cpu_count() or 1
        report = extract_corpus(
            settings, as_source(source), folder, op_list, local_workers, shard_size, quiet, quality
        )
    except RunError as exc:  # RunMetricsPortError too
        fail(exc.message)
    except KeyboardInterrupt:
        err.print(f"interrupted; run the same command again to resume from {folder.display()}")
        raise typer.Exit(130) from None
    print_outputs(folder, report)
    other_models_notice(settings, op_list, report)
    if audit_sample:
        from workers.corpus.audit import audit_output

        audited = audit_output(folder, settings, audit_sample, seed=0)
        for line in audited.lines():
            out.print(line)
        raise typer.Exit(0 if audited.ok else 1)


@app.command()
def audit(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="A finished `extract` output folder."),
    sample: int = typer.Option(32, "--sample", help="Utterances to re-extract."),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the sample: the same seed audits the same utterances."
    ),
    models: Path | None = typer.Option(None, "--models", help=MODELS_HELP),
    as_json: bool = typer.Option(False, "--json", help="The whole report as JSON."),
) -> None:
    """Re-extract a random sample of a finished run on the CPU reference path and compare.

    Reports token agreement and embedding cosine per model sha256 against the stored rows, and
    writes OUT/audit.json. Exit 1 below the thresholds (audit_min_token_agreement, default:
    identical tokens; audit_min_cosine, default 0.9999), 2 when it could not run.
    """
    from pipeline.errors import VoxmillError
    from pipeline.outputs.folder import RunFolder
    from workers.corpus.audit import audit_output

    settings = load_settings(models)
    require_models(settings, ["extract"], folder_only=True)
    try:
        report = audit_output(RunFolder.of(out_dir), settings, sample, seed)
    except (VoxmillError, OSError, ValueError) as exc:
        fail(exc.message if isinstance(exc, VoxmillError) else f"cannot audit {out_dir}: {exc}")
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for line in report.lines():
            out.print(line)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def report(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="A finished `extract` output folder."),
    html: Path | None = typer.Option(
        None,
        "--html",
        metavar="FILE",
        help="Write one self-contained HTML page (charts) here instead of printing the summary.",
    ),
) -> None:
    """Summarise a finished run: counts, audio, speed, models, speakers, failures by code and the
    first failures with their reason (all of them are in OUT/errors.jsonl). With --html, one
    self-contained page: durations, speech ratios, speakers, failures, throughput, models."""
    from pipeline.outputs.folder import RunFolder
    from workers.observe.report_html import load_report_data, render_text, write_report

    if not (out_dir / RunFolder.REPORT).is_file():
        fail(f"{out_dir} has no {RunFolder.REPORT}: not a finished `voxmill extract` output folder")
    if html is not None:
        out.print(f"wrote {write_report(out_dir, html)}")
        return
    from rich.markup import escape

    text = render_text(load_report_data(out_dir), str(out_dir / RunFolder.ERRORS))
    out.print(escape(text), highlight=False)


@app.command("export-cosyvoice")
def export_cosyvoice_command(
    data_dir: Path = typer.Argument(
        ..., metavar="DATA_DIR", help="The Kaldi data dir (wav.scp, text, utt2spk)."
    ),
    features_dir: Path = typer.Argument(
        ..., metavar="FEATURES_DIR", help="The `extract` output folder of it."
    ),
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Where to write CosyVoice's parquet lists."),
    utts_per_parquet: int = typer.Option(1000, "--utts-per-parquet", help="Utterances per parquet file."),
) -> None:
    """Write CosyVoice's training parquet files (as tools/make_parquet_list.py does) from extract outputs.

    Exit 1 when the features do not match the data dir's utterances (the message says how their
    ids differ), 2 when an input is missing or unreadable.
    """
    from pipeline.errors import VoxmillError
    from pipeline.outputs.export import NothingToExport, export_cosyvoice

    try:
        written = export_cosyvoice(data_dir, features_dir, out_dir, utts_per_parquet)
    except NothingToExport as exc:
        fail(exc.message, code=1)
    except VoxmillError as exc:
        fail(exc.message)
    out.print(f"wrote {len(written)} parquet file(s); list: {out_dir / 'data.list'}")


@app.command()
def demo(
    folder: Path = typer.Option(
        Path("demo"), "--dir", help="Where to put the demo corpus, models and outputs."
    ),
    workers: int = typer.Option(
        0, "--workers", help="Local worker processes; default: one per core.", show_default=False
    ),
) -> None:
    """Generate a small demo corpus and tiny stand-in models, then run `extract` on it (embedded Redis)."""
    from pipeline.demo import make_demo_corpus
    from pipeline.models.standin import make_standins
    from pipeline.outputs.folder import RunFolder
    from workers.corpus.plan import RunError
    from workers.extract import extract_corpus

    settings = load_settings()
    data_dir = make_demo_corpus(folder / "corpus")
    make_standins(folder / "models", profile="tiny")
    out_dir = RunFolder.of(folder / "out")
    out.print(f"demo corpus: {data_dir} (Kaldi data dir: wav.scp, utt2spk, text)")
    out.print(f"stand-in models (tiny, meaningless weights): {folder / 'models'}")
    # The demo's clips are synthetic tones, not speech: the speech check would refuse every one.
    update = {"model_dir": folder / "models", "broker_url": None, "speech_check": False}
    settings = settings.model_copy(update=update)
    out.print("speech check off: the demo's clips are synthetic tones (with it on they are no_speech)")
    try:
        report = extract_corpus(
            settings, data_dir, out_dir, ["tokenize", "embed"], workers or os.cpu_count() or 1, 4
        )
    except RunError as exc:
        fail(exc.message)
    print_outputs(out_dir, report)
    out.print("errors.jsonl names the broken clip; `make demo` again resumes (every shard is already done).")


def print_outputs(out_dir: RunFolder, report: RunReport) -> None:
    """The summary of a run and its output files, one per line (in a store, without asking it)."""
    from pipeline.outputs.folder import RunFolder
    from workers.corpus.progress import summary_line, summary_table

    out.print(summary_table(report, out_dir.display()))
    out.print(summary_line(report))
    ops = set(report.ops)
    names = [RunFolder.SPEECH_TOKENS] if ops & {"tokenize", "extract"} else []
    names += [RunFolder.UTT_EMBEDDINGS, RunFolder.SPK_EMBEDDINGS] if ops & {"embed", "extract"} else []
    for name in (*names, RunFolder.UTT_STATS, RunFolder.ERRORS, RunFolder.REPORT):
        if not out_dir.is_local or out_dir.location.exists(name):
            out.print(f"  {out_dir.display(name)}")


# --------------------------------------------------------------------------------- status
@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="Stable JSON for scripts (with a version field)."),
) -> None:
    """Queues, worker processes and their models, published generations, rejections, throughput."""
    import redis

    from workers.observe.status import collect_status
    from workers.observe.status_view import render_status
    from workers.queue import connections

    settings = load_settings()
    require_broker(settings)
    client = connections.broker_client(settings, socket_connect_timeout=5, socket_timeout=5)
    try:
        report = collect_status(client)
    except redis.RedisError as exc:
        fail(f"cannot reach the broker at {settings.redacted_broker_url()}: {exc}")
    report["broker"] = settings.redacted_broker_url()
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        render_status(report, out)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="One JSON object, for scripts.")) -> None:
    """Check this machine's set-up: packages, providers, model files, broker, roots, cache, memory.

    One line per check, each ok, warning or error with what to do; exit 1 when any is an error.
    """
    from workers.observe.doctor import doctor_command

    raise typer.Exit(doctor_command(load_settings(), as_json, out))


# --------------------------------------------------------------------------------- models
def model_folder(positional: Path | None, option: Path | None) -> Settings:
    """The settings with the folder given either way (`models list DIR` or `--models DIR`)."""
    if positional is not None and option is not None and positional != option:
        fail(f"two model folders given: {positional} and --models {option}")
    return load_settings(option or positional)


FOLDER_ARGUMENT_HELP = "Model folder (the same as --models)."
JSON_HELP = "One JSON object per model file, for scripts."


@models_app.command("make-standin")
def models_make_standin(
    out_dir: Path = typer.Option(Path("models"), "--out", help="Folder to write the ONNX files into."),
    profile: str = typer.Option(
        "tiny", "--profile", help="tiny (for tests, < 1 MB) or full (real dimensions, ~1 GB)."
    ),
    seed: int = typer.Option(0, "--seed", help="Weights seed; the same seed writes byte-identical files."),
) -> None:
    """Write stand-ins: speech_tokenizer_v2.onnx, its batch twin and campplus.onnx (meaningless weights)."""
    from pipeline.models.standin import PROFILES, make_standins

    if profile not in PROFILES:
        fail(f"profile must be one of {', '.join(PROFILES)}")
    started = time.perf_counter()
    written = make_standins(out_dir, profile=profile, seed=seed)
    for role, path in written.items():
        out.print(f"{role:9s} {path}  ({path.stat().st_size / 1e6:.1f} MB)")
    out.print(f"done in {time.perf_counter() - started:.1f} s")


@models_app.command("list")
def models_list(
    folder: Path | None = typer.Argument(None, metavar="DIR", help=FOLDER_ARGUMENT_HELP),
    models: Path | None = typer.Option(None, "--models", help=MODELS_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """What a model folder holds, and which known variant each file is (by sha256, else by name)."""
    from workers.models import describe_folder, render_models

    settings = model_folder(folder, models)
    rows = describe_folder(settings.model_dir, load=False)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        render_models(rows, out)


@models_app.command("verify")
def models_verify(
    folder: Path | None = typer.Argument(None, metavar="DIR", help=FOLDER_ARGUMENT_HELP),
    models: Path | None = typer.Option(None, "--models", help=MODELS_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Load every model of a folder, check its signature and warm it up; exit 1 if any fails."""
    from workers.models import describe_folder, render_models

    settings = model_folder(folder, models)
    rows = describe_folder(settings.model_dir, load=True, settings=settings)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        render_models(rows, out)
    raise typer.Exit(0 if rows and all(r.get("ok") for r in rows) else 1)


@models_app.command("build-engine")
def models_build_engine(
    folder: Path | None = typer.Argument(None, metavar="DIR", help=FOLDER_ARGUMENT_HELP),
    models: Path | None = typer.Option(None, "--models", help=MODELS_HELP),
    fp16: bool | None = typer.Option(
        None, "--fp16/--fp32", help="Engine precision; default: the trt_fp16 setting, which workers use."
    ),
) -> None:
    """Build TensorRT engines ahead of time, into the cache the workers on this kind of GPU read."""
    from pipeline.errors import VoxmillError
    from pipeline.models.engines import build_engines, tensorrt_unavailable
    from pipeline.models.options import SessionOptions
    from workers.models import render_builds

    settings = model_folder(folder, models)
    missing = tensorrt_unavailable()
    if missing:
        fail(f"TensorRT is not available: {missing}")
    try:
        builds = build_engines(settings.model_dir, SessionOptions.from_settings(settings), fp16)
    except VoxmillError as exc:
        fail(exc.message, code=1)
    render_builds(builds, out)


def main() -> None:
    """The `voxmill` command; an OS error anywhere (a path that cannot be written, say) is one line."""
    from pipeline.errors import VoxmillError

    try:
        app()
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        err.print(f"[red]error:[/red] {where}{exc.strerror or exc}")
        sys.exit(2)
    except VoxmillError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        sys.exit(2)
    finally:
        # Done: interpreter shutdown would walk everything Celery, Arrow and pydantic made with
        # the cyclic collector (0.27 s after `extract`); frozen objects are left to the OS.
        # Finalizers and atexit handlers still run.
        gc.freeze()


if __name__ == "__main__":
    main()
