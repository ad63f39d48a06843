"""`voxmill models list|verify|build-engine`: what a model folder holds, and whether each file works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.engines import EngineBuild, installed_engine_status
from pipeline.errors import VoxmillError
from pipeline.inference import open_session
from pipeline.registry import Registry
from pipeline.sessions import SessionOptions, hash_model_file
from pipeline.settings import Settings


def describe_folder(folder: Path, load: bool, settings: Settings | None = None) -> list[dict[str, Any]]:
    """One row per model file the registry recognises in `folder` (and per role missing)."""
    registry = Registry.load()
    rows: list[dict[str, Any]] = []
    for role in registry.roles:
        try:
            path = registry.find_model(role, folder)
        except VoxmillError as exc:
            rows.append({"role": role, "file": None, "ok": False, "error": exc.to_dict()})
            continue
        rows.append(describe_file(registry, role, path, load, settings))
    return rows


def describe_file(
    registry: Registry, role: str, path: Path, load: bool, settings: Settings | None
) -> dict[str, Any]:
    """Size, sha256, recognised variant, and (with `load`) load/warm-up results of one file."""
    row: dict[str, Any] = {"role": role, "file": path.name, "path": str(path), "size": path.stat().st_size}
    try:
        sha256 = hash_model_file(path)  # streamed: listing never holds a model in memory
        identified = registry.identify(role, path.name, sha256)
        row.update(
            sha256=sha256,
            variant=identified.variant.name,
            recognised_by=identified.by,
            description=identified.variant.description,
            ok=True,
        )
        if load:
            options = SessionOptions.from_settings(settings) if settings else SessionOptions()
            session = open_session(path, role, options, registry)
            row.update(session.describe())
            session.close()
            row["engine"] = installed_engine_status(sha256, options.provider_options).to_dict()
    except VoxmillError as exc:
        row.update(ok=False, error=exc.to_dict())
    return row


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    """A table of `describe_folder` rows."""
    table = Table()
    columns = ["role", "file", "variant", "by", "sha256", "size", "load s", "warm ms", "status"]
    with_engine = any("engine" in row for row in rows)
    for column in [*columns, "TensorRT engine"] if with_engine else columns:
        table.add_column(column)
    for row in rows:
        status = (
            "[green]ok[/green]"
            if row.get("ok")
            else f"[red]{row.get('error', {}).get('message', 'failed')}[/red]"
        )
        size = f"{row['size'] / 1e6:.1f} MB" if row.get("size") is not None else ""
        cells = [
            row["role"],
            row.get("file") or "-",
            row.get("variant", ""),
            row.get("recognised_by", ""),
            (row.get("sha256") or "")[:12],
            size,
            f"{row['load_s']:.2f}" if row.get("load_s") is not None else "",
            f"{row['warm_latency_ms']:.1f}" if row.get("warm_latency_ms") is not None else "",
            status,
        ]
        if with_engine:
            cells.append(row.get("engine", {}).get("detail", ""))
        table.add_row(*cells)
    console.print(table)


def render_builds(builds: list[EngineBuild], console: Console) -> None:
    """Where each engine went and how long it took."""
    for build in builds:
        precision = "fp16" if build.fp16 else "fp32"
        shapes = ", ".join(f"{level} {ms:.0f} ms" for level, ms in build.run_ms.items())
        head = f"{build.role:9s} {build.file} ({build.sha256[:12]}, {precision})"
        console.print(f"{head}: built in {build.build_s:.1f} s")
        console.print(f"          engine: {build.engine_dir} ({', '.join(build.engine_files)})")
        console.print(f"          runs at the profile shapes: {shapes}")
