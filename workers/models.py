"""`voxmill models list|verify|build-engine`: what a model folder holds, and whether each file works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from pipeline.batching import check_exact, open_batch_session
from pipeline.errors import VoxmillError
from pipeline.inference import open_session
from pipeline.models.engines import EngineBuild, installed_engine_status
from pipeline.models.files import hash_model_file
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.settings import Settings


def describe_folder(folder: Path, load: bool, settings: Settings | None = None) -> list[dict[str, Any]]:
    """One row per model file the registry recognises in `folder` (and per role missing).

    A role's batch file (the twin of the file that serves it) gets a row of its own, `batch` true.
    """
    registry = Registry.load()
    rows: list[dict[str, Any]] = []
    for role in registry.roles:
        try:
            path = registry.find_model(role, folder)
        except VoxmillError as exc:
            rows.append({"role": role, "file": None, "ok": False, "error": exc.to_dict()})
            continue
        rows.append(describe_file(registry, role, path, load, settings))
        twin = registry.find_batch_model(role, folder)
        if twin is not None:
            rows.append(describe_file(registry, role, twin, load, settings, batch_of=path))
    return rows


def describe_file(
    registry: Registry,
    role: str,
    path: Path,
    load: bool,
    settings: Settings | None,
    batch_of: Path | None = None,
) -> dict[str, Any]:
    """Size, sha256, recognised variant, and (with `load`) load/warm-up results of one file.

    The batch twin of the file `batch_of` is loaded as a batch tokenizer (`open_batch_session`):
    its batch axes checked too, and a padded batch's tokens compared with that file's (`check_exact`).
    """
    row: dict[str, Any] = {"role": role, "file": path.name, "path": str(path), "size": path.stat().st_size}
    if batch_of is not None:
        row["batch"] = True
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
            if batch_of is None:
                opened = open_session(path, role, options, registry)
            else:
                opened = open_batch_session(path, options, registry)
                single = open_session(batch_of, role, options, registry)
                try:
                    check_exact(single, opened)
                finally:
                    single.close()
                row["same_tokens_as"] = batch_of.name
            row.update(opened.describe())
            opened.close()
            row["engine"] = installed_engine_status(sha256, options.provider_options).to_dict()
    except VoxmillError as exc:
        row.update(ok=False, error=exc.to_dict())
    return row


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    """One short block per role (it reads on an 80-column terminal; `--json` has every field)."""
    for row in rows:
        error = row.get("error")
        if row.get("file") is None:
            console.print(
                f"{row['role']:9s}  [red]missing[/red]: {escape(error['message'] if error else '')}"
            )
            continue
        size = f"{row['size'] / 1e6:.1f} MB" if row.get("size") is not None else ""
        status = "[green]ok[/green]" if row.get("ok") else "[red]failed[/red]"
        kind = "  (batch)" if row.get("batch") else ""
        console.print(f"{row['role']:9s}  {escape(row['file'])}  {size}  {status}{kind}")
        if row.get("sha256"):
            by = row.get("recognised_by", "")
            console.print(
                f"           variant {row.get('variant', '')} (by {by}), sha256 {row['sha256'][:12]}"
            )
        if row.get("load_s") is not None:
            warm = row.get("warm_latency_ms")
            timing = f"loaded in {row['load_s']:.2f} s, warm run {warm:.1f} ms" if warm is not None else ""
            engine = row.get("engine", {}).get("detail", "")
            console.print(f"           {timing}" + (f"; TensorRT engine: {escape(engine)}" if engine else ""))
        if error:
            console.print(f"           [red]{escape(error['message'])}[/red]")


def render_builds(builds: list[EngineBuild], console: Console) -> None:
    """Where each engine went and how long it took."""
    for build in builds:
        precision = "fp16" if build.fp16 else "fp32"
        shapes = ", ".join(f"{level} {ms:.0f} ms" for level, ms in build.run_ms.items())
        head = f"{build.role:9s} {build.file} ({build.sha256[:12]}, {precision})"
        console.print(f"{head}: built in {build.build_s:.1f} s")
        console.print(f"          engine: {build.engine_dir} ({', '.join(build.engine_files)})")
        console.print(f"          runs at the profile shapes: {shapes}")
