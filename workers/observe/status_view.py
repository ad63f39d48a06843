"""Terminal rendering of `voxmill status` (rich tables)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _short(sha: str | None) -> str:
    return (sha or "")[:12]


def _rejection(rejection: dict[str, Any] | None) -> str:
    """'file (sha256 prefix), N s ago: reason' of a role's last rejected candidate."""
    if not rejection:
        return ""
    age_s = time.time() - float(rejection.get("time") or 0.0)
    head = f"{rejection.get('file', '')} ({_short(rejection.get('sha256'))}), {age_s:.0f} s ago"
    return escape(f"{head}: {rejection.get('reason', '')}")


def render_status(report: dict[str, Any], console: Console) -> None:
    """Queues, workers, models and throughput as three small tables."""
    console.print(f"broker: {report.get('broker')}")
    queues = Table(title="queues")
    queues.add_column("queue")
    queues.add_column("waiting", justify="right")
    for name, depth in report["queues"].items():
        queues.add_row(name, str(depth))
    console.print(queues)

    workers = Table(title=f"workers ({len(report['workers'])} processes)")
    for column in ("worker", "queues", "pool", "models", "done", "last min", "seen"):
        workers.add_column(column)
    now = time.time()
    for w in report["workers"]:
        models = ", ".join(f"{role}={_short(m.get('sha256'))}" for role, m in w.get("models", {}).items())
        if w.get("load_errors"):
            models += " [red](" + escape("; ".join(w["load_errors"].values())) + ")[/red]"
        workers.add_row(
            w["worker_id"] + (" [yellow](aside: reloading)[/yellow]" if w.get("aside") else ""),
            ",".join(w.get("queues", [])),
            w.get("pool", ""),
            models,
            str(w.get("tasks_done", 0)),
            str(w.get("tasks_last_minute", 0)),
            f"{now - w.get('last_seen', now):.0f} s ago",
        )
    console.print(workers)

    model_table = Table(title="models")
    for column in ("role", "published", "generation", "served by", "last rejection", "reload failures"):
        model_table.add_column(column)
    for role, info in report["models"].items():
        published = info.get("published") or {}
        serving = "; ".join(f"{_short(sha)}: {len(ids)} proc" for sha, ids in info.get("serving", {}).items())
        failed = info.get("reload_failures", {})
        failures = escape("; ".join(f"{worker_id}: {f['reason']}" for worker_id, f in failed.items()))
        validating = "".join(f" (validating {_short(c.get('sha256'))})" for c in info.get("validating", []))
        model_table.add_row(
            role,
            _short(published.get("sha256")) + validating,
            str(published.get("generation", "")),
            serving,
            _rejection(info.get("last_rejection")),
            failures,
        )
    console.print(model_table)
    throughput = report["throughput"]
    console.print(
        f"throughput: {throughput['tasks_last_minute']} tasks in the last minute "
        f"({throughput['per_second']}/s)"
    )
