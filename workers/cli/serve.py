"""`voxmill worker`, `up`, `watch` and `submit`: the commands that run or feed workers."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    pass
from workers.cli.console import (
    MODELS_HELP,
    QUEUES_HELP,
    WORKERS_HELP,
    app,
    fail,
    load_settings,
    out,
    require_broker,
    require_models,
    split_list,
)


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
        out.print(f"[red]✗[/red] {escape(result.input)}: {result.error.code}: {escape(result.error.message)}")
        return
    parts = [f"{result.audio_seconds:.2f} s"]
    if result.speech_token is not None:
        parts.append(f"{len(result.speech_token)} tokens")
    if result.embedding is not None:
        parts.append(f"embedding[{len(result.embedding)}]")
    out.print(f"[green]✓[/green] {escape(result.input)}: {', '.join(parts)}")


# --------------------------------------------------------------------------------- corpora
