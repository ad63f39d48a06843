"""`voxmill doctor`: the troubleshooting table of docs/operations.md as checks of this machine.

`run_checks(settings)` returns one `Check` per thing looked at, each `ok`, `warning` (works, but
something is off: what to do is in `fix`) or `error` (something voxmill needs is broken). Checks
read and never change anything: no model is hashed into the cache, no key is written to Redis.

What is checked: Python and the installed packages against voxmill's requirements; the ONNX
Runtime providers the settings ask for, by building a one-node session on each (and, for CUDA and
TensorRT, the shared libraries they need, found or missing by name); each model file (a git-lfs
pointer, IR version and opsets against this ONNX Runtime, the signature against the registry, the
variant by sha256, a TensorRT engine for this GPU); the broker (reachable, authenticated, AOF,
`maxmemory-policy`); the allowed roots; the optimized-model cache folder (owner and mode); free
memory against what a worker process needs to load the models.

One module per group of checks (`software`, `models`, `broker`, `host`), each a list of `Check`s
(`check`); this one runs them all and renders the report.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape

from pipeline.settings import Settings
from workers.observe.doctor.broker import (
    broker_checks,
)
from workers.observe.doctor.check import (
    Check,
    Status,
)
from workers.observe.doctor.host import (
    available_memory,
    cache_check,
    memory_check,
    root_checks,
)
from workers.observe.doctor.models import (
    model_checks,
)
from workers.observe.doctor.software import (
    find_shared_library,
    library_report,
    package_checks,
    provider_checks,
    python_check,
)

DOCTOR_VERSION = 1
STATUS_RANK = {"ok": 0, "warning": 1, "error": 2}
STATUS_STYLE = {"ok": "green", "warning": "yellow", "error": "red"}


def run_checks(settings: Settings) -> list[Check]:
    """Every check: software and providers, each model file, the broker, roots and cache, memory."""
    import onnxruntime as ort

    from pipeline.models.registry import Registry

    available = list(ort.get_available_providers())
    checks = [python_check(), *package_checks()]
    checks += provider_checks(settings, available)
    models, model_lines = model_checks(settings, Registry.load(), available)
    checks += model_lines
    checks += broker_checks(settings)
    checks += root_checks(settings)
    checks.append(cache_check(settings))
    checks.append(memory_check(available_memory(), sum(m.load_bytes for m in models), os.cpu_count() or 1))
    return checks


def worst(checks: Sequence[Check]) -> Status:
    return max((c.status for c in checks), key=STATUS_RANK.__getitem__, default="ok")


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check is an error (what `voxmill doctor` exits with), else 0."""
    return 1 if worst(checks) == "error" else 0


def checks_json(checks: Sequence[Check]) -> dict[str, Any]:
    """The report for scripts (`voxmill doctor --json`)."""
    counts = {status: sum(c.status == status for c in checks) for status in STATUS_RANK}
    return {
        "version": DOCTOR_VERSION,
        "status": worst(checks),
        "counts": counts,
        "checks": [dataclasses.asdict(c) for c in checks],
    }


def render(checks: Sequence[Check], console: Console) -> None:
    """One line per check: status, name, what was found, and for a warning or error what to do."""
    width = max((len(c.name) for c in checks), default=0)
    for check in checks:
        style = STATUS_STYLE[check.status]
        line = (
            f"[{style}]{check.status:7s}[/{style}]  {escape(check.name.ljust(width))}  {escape(check.detail)}"
        )
        if check.fix and check.status != "ok":
            line += f" [bold]->[/bold] {escape(check.fix)}"
        console.print(line)
    counts = checks_json(checks)["counts"]
    console.print(f"\n{counts['ok']} ok, {counts['warning']} warning(s), {counts['error']} error(s)")


def doctor_command(settings: Settings, as_json: bool, console: Console) -> int:
    """`voxmill doctor [--json]`: print the report; the exit status."""
    checks = run_checks(settings)
    if as_json:
        print(json.dumps(checks_json(checks), indent=2))
    else:
        render(checks, console)
    return exit_code(checks)


__all__ = [
    "Check",
    "broker_checks",
    "checks_json",
    "doctor_command",
    "exit_code",
    "find_shared_library",
    "library_report",
    "memory_check",
    "package_checks",
    "render",
    "run_checks",
]
