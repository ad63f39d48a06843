"""Terminal rendering of `voxmill status`: one short block per worker process and per role, so it
reads on an 80-column terminal (`voxmill status --json` has everything, for scripts)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape

SHA_SHOWN = 12
INDENT = "    "


def _short(sha: str | None) -> str:
    return (sha or "")[:SHA_SHOWN]


def _ago(epoch_s: float | None, now: float) -> str:
    return f"{now - (epoch_s or now):.0f} s ago"


def render_status(report: dict[str, Any], console: Console) -> None:
    """The broker, queue depths, each worker process, each role's models, throughput."""
    now = time.time()
    console.print(f"broker: {escape(str(report.get('broker')))}")
    console.print(
        "queues: " + ", ".join(f"{name} {depth} waiting" for name, depth in report["queues"].items())
    )
    throughput = report["throughput"]
    console.print(
        f"\n[bold]workers[/bold]: {len(report['workers'])} process(es), "
        f"{throughput['tasks_last_minute']} tasks in the last minute ({throughput['per_second']}/s)"
    )
    for worker in report["workers"]:
        _worker_block(worker, console, now)
    console.print("\n[bold]models[/bold]")
    for role, info in report["models"].items():
        _role_block(role, info, console, now)


def _worker_block(worker: dict[str, Any], console: Console, now: float) -> None:
    aside = " [yellow](aside: reloading)[/yellow]" if worker.get("aside") else ""
    console.print(f"  {escape(worker['worker_id'])}{aside}")
    done = f"{worker.get('tasks_done', 0)} done, {worker.get('tasks_last_minute', 0)} in the last minute"
    queues = ",".join(worker.get("queues", []))
    console.print(
        f"{INDENT}{queues} ({worker.get('pool', '')}); {done}; seen {_ago(worker.get('last_seen'), now)}"
    )
    for role, model in worker.get("models", {}).items():
        generation = model.get("generation")
        which = f"generation {generation}" if generation is not None else "not the published generation"
        console.print(f"{INDENT}{role} {_short(model.get('sha256'))} ({which})")
    for role, reason in worker.get("load_errors", {}).items():
        console.print(f"{INDENT}[red]{role} not loaded: {escape(reason)}[/red]")


def _role_block(role: str, info: dict[str, Any], console: Console, now: float) -> None:
    published = info.get("published") or {}
    if published:
        head = f"published {_short(published.get('sha256'))} (generation {published.get('generation')})"
    else:
        head = "nothing published"
    validating = "".join(f" (validating {_short(c.get('sha256'))})" for c in info.get("validating", []))
    console.print(f"  {role}: {head}{validating}")
    for sha, ids in info.get("serving", {}).items():
        console.print(f"{INDENT}served by {len(ids)} process(es): {_short(sha)}")
    rejection = info.get("last_rejection")
    if rejection:
        what = f"{rejection.get('file', '')} ({_short(rejection.get('sha256'))})"
        reason = escape(str(rejection.get("reason", "")))
        console.print(f"{INDENT}last rejection: {escape(what)}, {_ago(rejection.get('time'), now)}: {reason}")
    for worker_id, failure in info.get("reload_failures", {}).items():
        console.print(
            f"{INDENT}[red]{escape(worker_id)} did not reload: {escape(str(failure['reason']))}[/red]"
        )
