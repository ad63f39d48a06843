"""`voxmill`: the command line. It only parses and dispatches; the work lives below it.

One module per group of commands (`serve`, `runs`, `observe`, `models`), each adding its commands
to the app in `console`; they are imported here in the order `voxmill --help` lists them.
"""

from __future__ import annotations

import gc
import sys

# isort: off
# Each module adds its commands to the app, in the order `voxmill --help` lists them.
from workers.cli import serve, runs, observe, models  # noqa: F401
from workers.cli.console import app, err

# isort: on

__all__ = ["app", "main"]


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
