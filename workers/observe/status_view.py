"""Terminal rendering of `voxmill status`: one short block per worker process and per role, so it
reads on an 80-column terminal (`voxmill status --json` has everything, for scripts)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape

from workers.queue.delivery import start_command

SHA_SHOWN = 12
INDENT = "    "


def _short(sha: str | None) -> str:
    return (sha or "")[:SHA_SHOWN]


def _ago(epoch_s: float | None, now: float) -> str:
    return f"{now - (epoch_s or now):.0f} s ago"


def render_status(report: dict[str, Any], console: Console) -> None:
    """The broker, queue depths, each worker process, each role's models, corpus runs, throughput."""
    now = time.time()
    console.print(f"broker: {escape(str(report.get('broker')))}")
    unserved = set(report.get("queues_without_consumer", []))
    console.print(
        "queues: " + ", ".join(f"{name} {depth} waiting" for name, depth in report["queues"].items())
    )
    for name in sorted(unserved):
        console.print(f"  [red]{name}: no worker consumes it[/red]; start one: {escape(start_command(name))}")
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
    runs = report.get("runs") or []
    if runs:
        console.print(f"\n[bold]corpus runs[/bold]: {len(runs)} in progress")
        for run in runs:
            _run_block(run, console, now)


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


def _run_block(run: dict[str, Any], console: Console, now: float) -> None:
    """One corpus run its driver reports: where from and to, how far, the ETA."""
    from pipeline.units import audio_amount

    console.print(f"  {escape(str(run.get('input', '')))} -> {escape(str(run.get('out', '')))}")
    total, listed = run.get("utterances_total"), run.get("audio_total_s")
    shards = run.get("shards", {})
    done = f"{run.get('utterances_done', 0)}/{'…' if total is None else total} utterances"
    audio = audio_amount(run.get("audio_done_s", 0.0)) + (
        "" if listed is None else f" of {audio_amount(listed)}"
    )
    eta = run.get("eta_s")
    when = audio_amount(eta) if eta is not None else "unknown"
    if eta is None and not shards.get("plan_complete"):
        when += " (still reading the listing)"
    console.print(f"{INDENT}{done}; audio {audio} (this run); ETA {when}")
    planned = f"{shards.get('planned', 0)}{'' if shards.get('plan_complete') else '+'}"
    before = f" ({shards['done_before']} before)" if shards.get("done_before") else ""
    console.print(
        f"{INDENT}shards {shards.get('done', 0)}/{planned} done{before}, "
        f"{shards.get('in_flight', 0)} in flight, {shards.get('resubmitted', 0)} resubmitted"
    )
    failed = ", ".join(f"{n} {op}" for op, n in run.get("failed", {}).items() if n) or "none"
    console.print(f"{INDENT}failed: {failed}")
    where = f"{run.get('host', '')} pid {run.get('pid', '')}"
    console.print(
        f"{INDENT}run {escape(str(run.get('run', ''))[:SHA_SHOWN])} on {escape(where)}, "
        f"seen {_ago(run.get('time'), now)}"
    )
