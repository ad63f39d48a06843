"""`voxmill status` and `doctor`: what runs, and what is broken."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    pass
from workers.cli.console import (
    app,
    fail,
    load_settings,
    out,
    require_broker,
)


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
