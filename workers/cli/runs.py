"""`voxmill extract`, `audit`, `report`, `export-cosyvoice` and `demo`: corpus runs and their outputs."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.outputs.folder import RunFolder
    from pipeline.outputs.report import RunReport
from workers.cli.console import (
    MODELS_HELP,
    app,
    err,
    fail,
    load_settings,
    note,
    out,
    require_models,
    split_list,
)


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
    from pipeline.errors import RunError
    from workers.extract import current_model_sha256, other_models_note

    if settings.broker_url:  # workers elsewhere, with models of their own
        return
    try:
        said = other_models_note(report, current_model_sha256(settings, ops), settings.model_dir)
    except RunError:  # a model gone since the run began: nothing to compare with
        return
    if said:
        note(said)


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
    from pipeline.errors import RunError, VoxmillError
    from pipeline.outputs.folder import RunFolder
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
    from pipeline.errors import RunError
    from pipeline.models.standin import make_standins
    from pipeline.outputs.folder import RunFolder
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
