"""The command line's shared parts: the apps, the consoles, settings and the one way to fail."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console

from pipeline.settings import Settings

if TYPE_CHECKING:
    pass


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
