"""`voxmill`: the command line. It only parses and dispatches; the work lives below it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from pipeline.settings import Settings

app = typer.Typer(
    help="voxmill: speech tokens and speaker embeddings for CosyVoice-style TTS, over Celery and Redis.",
    no_args_is_help=True,
    add_completion=False,
)
models_app = typer.Typer(help="Inspect, verify and create model files.", no_args_is_help=True)
app.add_typer(models_app, name="models")
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def load_settings() -> Settings:
    try:
        return Settings.load()
    except Exception as exc:  # pydantic's validation errors are readable as they are
        err.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None


def require_broker(settings: Settings) -> str:
    if not settings.broker_url:
        from workers.queue.client import BrokerNotConfigured

        err.print(f"[red]error:[/red] {BrokerNotConfigured()}")
        raise typer.Exit(2)
    return settings.broker_url


# --------------------------------------------------------------------------------- serving
@app.command()
def worker(
    queues: str = typer.Option(
        "tokenize,embed,extract", "-Q", "--queues", help="Queues to consume, comma-separated."
    ),
    concurrency: int = typer.Option(0, "-c", "--concurrency", help="Pool processes (default: one per core)."),
    pool: str = typer.Option(
        "prefork", "--pool", help="prefork | solo | threads (solo or threads on a GPU)."
    ),
    loglevel: str = typer.Option("", "-l", "--loglevel", help="Log level (default: settings' log_level)."),
    hostname: str = typer.Option("", "-n", "--hostname", help="Celery node name."),
    log_format: str = typer.Option("", "--log-format", help="text | json (default: settings' log_format)."),
) -> None:
    """Run a Celery worker that holds warm model sessions.

    The same as `celery -A workers.app worker --without-mingle --without-gossip`: voxmill never
    revokes tasks, so a worker does not spend a second at start asking its neighbours for their
    revoked ids (mingle), nor follow every other worker's heartbeats (gossip).
    """
    from workers.worker import build_worker_app, check_pool_for_provider, start_worker

    settings = load_settings()
    if log_format:
        settings = settings.model_copy(update={"log_format": log_format})
    require_broker(settings)
    problem = check_pool_for_provider(settings, pool)
    if problem:
        err.print(f"[red]error:[/red] {problem}")
        raise typer.Exit(2)
    queue_list = [q.strip() for q in queues.split(",") if q.strip()]
    code = start_worker(
        build_worker_app(settings),
        queue_list,
        concurrency or os.cpu_count() or 1,
        pool,
        loglevel or settings.log_level,
        hostname,
    )
    raise typer.Exit(code)


@app.command()
def up(
    workers: int = typer.Option(0, "--workers", "-w", help="Worker processes (default: one per core)."),
    queues: str = typer.Option(
        "tokenize,embed,extract", "-Q", "--queues", help="Queues the local workers serve."
    ),
    no_watch: bool = typer.Option(False, "--no-watch", help="Do not start the model watcher."),
) -> None:
    """Embedded Redis + N workers + the model watcher, in the foreground. Ctrl-C stops everything."""
    from workers.embedded import LocalCluster

    settings = load_settings()
    count = workers or os.cpu_count() or 1
    cluster = LocalCluster(settings, workers=count, queues=queues.split(","), watch=not no_watch)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cluster.start()
        out.print(f"voxmill is up: {count} worker process(es), models from {settings.model_dir}")
        out.print("In another shell:")
        if cluster.redis is not None:
            # The one place the embedded Redis's password is shown: its user needs it to connect.
            print(f"  export VOXMILL_BROKER_URL={shlex.quote(cluster.broker_url)}", flush=True)
        else:  # the user's own broker: they have its URL already, and it is not ours to print
            out.print(f"  (VOXMILL_BROKER_URL as set: {settings.redacted_broker_url()})")
        out.print("  voxmill submit tokenize some.wav")
        out.print("Ctrl-C stops everything.")
        sys.stdout.flush()
        cluster.wait()
    except KeyboardInterrupt:
        out.print("stopping…")
    except (RuntimeError, TimeoutError) as exc:  # a part exited, or the workers never got ready
        from workers.observe.logs import redact

        err.print(f"[red]error:[/red] {redact(str(exc))}")
        raise typer.Exit(1) from None
    finally:
        cluster.stop()


@app.command()
def watch(
    model_dir: Path | None = typer.Option(
        None, "--model-dir", help="Model folder to watch (default: settings' model_dir)."
    ),
    log_format: str = typer.Option("", "--log-format", help="text | json (default: settings' log_format)."),
) -> None:
    """Watch the model folder: validate each new model file, publish it; the workers swap to it."""
    from workers.observe.logs import setup_logging
    from workers.reload.watcher import serve

    settings = load_settings()
    require_broker(settings)
    if model_dir is not None:
        settings = settings.model_copy(update={"model_dir": model_dir})
    setup_logging(settings.log_level, log_format or settings.log_format)
    serve(settings)


# --------------------------------------------------------------------------------- producing
@app.command()
def submit(
    op: str = typer.Argument(..., help="tokenize | embed | extract"),
    audio: list[Path] = typer.Argument(..., help="Audio files (sent as paths the workers read)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per input, one per line."),
    send_bytes: bool = typer.Option(False, "--bytes", help="Send the file contents instead of the path."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for all results."),
) -> None:
    """Submit audio to the workers; exit 0 when every input succeeded, 1 otherwise."""
    from workers.queue.client import Client

    if op not in ("tokenize", "embed", "extract"):
        err.print(f"[red]error:[/red] op must be tokenize, embed or extract, not {op!r}")
        raise typer.Exit(2)
    import redis
    from kombu.exceptions import OperationalError

    from workers.queue.client import read_payload

    settings = load_settings()
    require_broker(settings)
    client = Client(settings)
    jobs, refused = [], []
    try:
        for path in audio:
            if not send_bytes:
                jobs.append(client.submit(op, path))
                continue
            payload, problem = read_payload(path, op, settings.max_payload_bytes)
            if problem is not None:
                refused.append(problem)
            else:
                jobs.append(client.submit(op, payload, name=str(path)))
        results = [*refused, *client.as_completed(jobs, timeout_s=timeout)]
    except (OperationalError, redis.RedisError) as exc:
        err.print(f"[red]error:[/red] cannot reach the broker at {settings.redacted_broker_url()}: {exc}")
        raise typer.Exit(2) from None
    for result in results:
        if as_json:
            print(json.dumps(result.to_dict()), flush=True)
        else:
            print_result(result)
    raise typer.Exit(1 if any(not r.ok for r in results) else 0)


def print_result(result: object) -> None:
    from pipeline.records import TaskResult

    assert isinstance(result, TaskResult)
    if result.error:
        out.print(f"[red]✗[/red] {result.input}: {result.error['code']}: {result.error['message']}")
        return
    parts = [f"{result.audio_seconds:.2f} s"]
    if result.speech_token is not None:
        parts.append(f"{len(result.speech_token)} tokens")
    if result.embedding is not None:
        parts.append(f"embedding[{len(result.embedding)}]")
    out.print(f"[green]✓[/green] {result.input}: {', '.join(parts)}")


# --------------------------------------------------------------------------------- corpora
@app.command()
def extract(
    source: Path = typer.Argument(
        ..., metavar="INPUT", help="Kaldi data dir (wav.scp), JSONL manifest, or audio folder."
    ),
    out: Path = typer.Option(..., "--out", help="Output folder; re-running on it resumes."),
    ops: str = typer.Option("tokenize,embed", "--ops", help="Comma-separated: tokenize, embed."),
    models: Path | None = typer.Option(None, "--models", help="Model folder for local workers."),
    workers: int = typer.Option(0, "--workers", help="Local worker processes (default: one per core)."),
    shard_size: int = typer.Option(
        0,
        "--shard-size",
        help="Utterances per shard task (default: the settings' shard_size, fewer for a small corpus "
        "so every worker gets several shards).",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
) -> None:
    """Extract speech tokens and speaker embeddings for a whole corpus (sharded, resumable).

    Without VOXMILL_BROKER_URL it starts an embedded Redis and local workers; with it, it only
    submits shards and waits for workers anywhere that can read the same paths.
    """
    from workers.corpus.plan import RunError
    from workers.corpus.run import extract_corpus

    op_list = [op.strip() for op in ops.split(",") if op.strip()]
    bad = [op for op in op_list if op not in ("tokenize", "embed")]
    if bad or not op_list:
        err.print(f"[red]error:[/red] --ops takes tokenize and/or embed, not {ops!r}")
        raise typer.Exit(2)
    settings = load_settings()
    if models is not None:
        if settings.broker_url:
            err.print(
                "[yellow]note:[/yellow] --models applies to local workers only; remote workers use their own"
            )
        settings = settings.model_copy(update={"model_dir": models})
    try:
        report = extract_corpus(
            settings,
            source,
            out,
            op_list,
            workers or os.cpu_count() or 1,
            shard_size,
            quiet,
        )
    except RunError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print(f"interrupted; run the same command again to resume from {out}")
        raise typer.Exit(130) from None
    print_outputs(out, report)


@app.command("export-cosyvoice")
def export_cosyvoice_command(
    data_dir: Path = typer.Argument(..., help="Kaldi data dir (wav.scp, text, utt2spk)."),
    features_dir: Path = typer.Argument(..., help="An `extract` output folder."),
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Where to write CosyVoice's parquet lists."),
    utts_per_parquet: int = typer.Option(1000, "--utts-per-parquet", help="Utterances per parquet file."),
) -> None:
    """Write CosyVoice training parquet files (as tools/make_parquet_list.py does) from extract outputs."""
    from pipeline.errors import VoxmillError
    from pipeline.export import export_cosyvoice

    try:
        written = export_cosyvoice(data_dir, features_dir, out_dir, utts_per_parquet)
    except VoxmillError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    out.print(f"wrote {len(written)} parquet file(s); list: {out_dir / 'data.list'}")


@app.command()
def demo(
    folder: Path = typer.Option(
        Path("demo"), "--dir", help="Where to put the demo corpus, models and outputs."
    ),
    workers: int = typer.Option(0, "--workers", help="Local worker processes (default: one per core)."),
) -> None:
    """Generate a small demo corpus and tiny stand-in models, then run `extract` on it (embedded Redis)."""
    from pipeline.demo import make_demo_corpus
    from pipeline.standin import make_standins
    from workers.corpus.plan import RunError
    from workers.corpus.run import extract_corpus

    settings = load_settings()
    data_dir = make_demo_corpus(folder / "corpus")
    make_standins(folder / "models", profile="tiny")
    out_dir = folder / "out"
    out.print(f"demo corpus: {data_dir} (Kaldi data dir: wav.scp, utt2spk, text)")
    out.print(f"stand-in models (tiny, meaningless weights): {folder / 'models'}")
    settings = settings.model_copy(update={"model_dir": folder / "models", "broker_url": None})
    try:
        report = extract_corpus(
            settings,
            data_dir,
            out_dir,
            ["tokenize", "embed"],
            workers or os.cpu_count() or 1,
            shard_size=4,
        )
    except RunError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    print_outputs(out_dir, report)
    out.print("errors.jsonl names the broken clip; `make demo` again resumes (every shard is already done).")


def print_outputs(out_dir: Path, report: dict[str, Any]) -> None:
    """The summary of a run and its output files, one per line."""
    from workers.corpus.progress import summary_line, summary_table

    out.print(summary_table(report, str(out_dir)))
    out.print(summary_line(report))
    for name in (
        "speech_tokens.parquet",
        "utt_embeddings.parquet",
        "spk_embeddings.parquet",
        "errors.jsonl",
        "report.json",
    ):
        if (out_dir / name).exists():
            out.print(f"  {out_dir / name}")


# --------------------------------------------------------------------------------- status
@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="Stable JSON for scripts.")) -> None:
    """Queues, workers and their models, published generations, rejections, throughput."""
    import redis

    from workers.observe.status import collect_status
    from workers.observe.status_view import render_status

    settings = load_settings()
    url = require_broker(settings)
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        report = collect_status(client)
    except redis.RedisError as exc:
        err.print(f"[red]error:[/red] cannot reach the broker at {settings.redacted_broker_url()}: {exc}")
        raise typer.Exit(2) from None
    report["broker"] = settings.redacted_broker_url()
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        render_status(report, out)


# --------------------------------------------------------------------------------- models
@models_app.command("make-standin")
def models_make_standin(
    out_dir: Path = typer.Option(Path("models"), "--out", help="Folder to write the two ONNX files into."),
    profile: str = typer.Option(
        "tiny", "--profile", help="tiny (tests, < 1 MB) | full (real dimensions, ~520 MB)."
    ),
    seed: int = typer.Option(0, "--seed", help="Weights seed; the same seed writes byte-identical files."),
) -> None:
    """Write stand-in speech_tokenizer_v2.onnx and campplus.onnx (real signatures, meaningless weights)."""
    from pipeline.standin import PROFILES, make_standins

    if profile not in PROFILES:
        err.print(f"[red]error:[/red] profile must be one of {', '.join(PROFILES)}")
        raise typer.Exit(2)
    started = time.perf_counter()
    written = make_standins(out_dir, profile=profile, seed=seed)
    for role, path in written.items():
        out.print(f"{role:9s} {path}  ({path.stat().st_size / 1e6:.1f} MB)")
    out.print(f"done in {time.perf_counter() - started:.1f} s")


@models_app.command("list")
def models_list(
    model_dir: Path | None = typer.Argument(None, help="Model folder (default: settings' model_dir)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What a model folder holds and which known variants were recognised (by sha256 or name)."""
    from workers.models import describe_folder, render_models

    settings = load_settings()
    rows = describe_folder(model_dir or settings.model_dir, load=False)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        render_models(rows, out)


@models_app.command("verify")
def models_verify(
    model_dir: Path | None = typer.Argument(None, help="Model folder (default: settings' model_dir)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Load every model of a folder, check its signature and warm it up; exit 1 if any fails."""
    from workers.models import describe_folder, render_models

    settings = load_settings()
    rows = describe_folder(model_dir or settings.model_dir, load=True, settings=settings)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        render_models(rows, out)
    raise typer.Exit(0 if rows and all(r.get("ok") for r in rows) else 1)


@models_app.command("build-engine")
def models_build_engine(
    model_dir: Path = typer.Argument(..., help="Model folder whose models get TensorRT engines."),
    fp16: bool | None = typer.Option(
        None, "--fp16/--fp32", help="Engine precision (default: settings' trt_fp16, which workers use)."
    ),
) -> None:
    """Build TensorRT engines ahead of time, into the cache workers on this kind of GPU will read."""
    from rich.markup import escape

    from pipeline.engines import build_engines, tensorrt_unavailable
    from pipeline.errors import VoxmillError
    from pipeline.sessions import SessionOptions
    from workers.models import render_builds

    settings = load_settings()
    missing = tensorrt_unavailable()
    if missing:
        err.print(f"[red]error:[/red] TensorRT is not available: {escape(missing)}")
        raise typer.Exit(2)
    try:
        builds = build_engines(model_dir, SessionOptions.from_settings(settings), fp16)
    except VoxmillError as exc:
        err.print(f"[red]error:[/red] {escape(exc.message)}")
        raise typer.Exit(1) from None
    render_builds(builds, out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
