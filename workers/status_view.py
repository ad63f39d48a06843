"""Terminal rendering of `voxmill status` (rich tables)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table


def _short(sha: str | None) -> str:
    return (sha or "")[:12]


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
            models += " [red](" + "; ".join(w["load_errors"].values()) + ")[/red]"
        workers.add_row(
            w["worker_id"],
            ",".join(w.get("queues", [])),
            w.get("pool", ""),
            models,
            str(w.get("tasks_done", 0)),
            str(w.get("tasks_last_minute", 0)),
            f"{now - w.get('last_seen', now):.0f} s ago",
        )
    console.print(workers)

    model_table = Table(title="models")
    for column in ("role", "published", "generation", "served by", "last rejection"):
        model_table.add_column(column)
    for role, info in report["models"].items():
        published = info.get("published") or {}
        rejection = info.get("last_rejection") or {}
        serving = "; ".join(f"{_short(sha)}: {len(ids)} proc" for sha, ids in info.get("serving", {}).items())
        model_table.add_row(
            role,
            _short(published.get("sha256")),
            str(published.get("generation", "")),
            serving,
            rejection.get("reason", ""),
        )
    console.print(model_table)
    throughput = report["throughput"]
    console.print(
        f"throughput: {throughput['tasks_last_minute']} tasks in the last minute "
        f"({throughput['per_second']}/s)"
    )
