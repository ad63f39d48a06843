"""`voxmill models ...`: inspect, verify and create model files."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pipeline.settings import Settings

if TYPE_CHECKING:
    pass
from workers.cli.console import (
    MODELS_HELP,
    fail,
    load_settings,
    models_app,
    out,
)


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
