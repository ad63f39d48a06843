"""Progress of a corpus run: a live rich bar on a terminal, plain log lines otherwise, or nothing."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table


@dataclass
class Counts:
    """What a run has done so far, in work units (utterance x op) and audio seconds."""

    units_total: int
    audio_total_s: float
    n_ops: int
    units_done: int = 0
    audio_done_s: float = 0.0
    failed: int = 0
    started: float = field(default_factory=time.monotonic)

    def rtf(self) -> float:
        """Audio seconds processed per wall second (real-time factor)."""
        elapsed = time.monotonic() - self.started
        return (self.audio_done_s / max(self.n_ops, 1)) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        utts_done = self.units_done // max(self.n_ops, 1)
        utts_total = self.units_total // max(self.n_ops, 1)
        hours = f"{self.audio_done_s / max(self.n_ops, 1) / 3600:.2f}/{self.audio_total_s / 3600:.2f} h"
        speed = f"{self.rtf():.1f}x real time"
        return f"{utts_done}/{utts_total} utterances, {hours} audio, {speed}, {self.failed} failed"


class ProgressView:
    """Reports `Counts` as a bar (terminal), as a line every few seconds (log), or not at all (quiet)."""

    def __init__(self, counts: Counts, quiet: bool = False, console: Console | None = None) -> None:
        self.counts = counts
        self.quiet = quiet
        self.console = console or Console(stderr=True)
        self.live = not quiet and self.console.is_terminal
        self._last_line = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressView:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]extract"),
                BarColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("extract", total=self.counts.units_total, summary="")
        return self

    def update(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self.counts.units_done, summary=self.counts.line())
        elif not self.quiet and time.monotonic() - self._last_line >= 5.0:
            self._last_line = time.monotonic()
            print(f"extract: {self.counts.line()}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def __exit__(self, *_: Any) -> None:
        if self._progress is not None:
            self.update()
            self._progress.stop()
        elif not self.quiet:
            print(f"extract: {self.counts.line()}", file=sys.stderr, flush=True)


def summary_table(report: dict[str, Any], out_dir: str) -> Table:
    """The final summary: per op ok/failed, audio, wall time, where the files are."""
    table = Table(title=f"voxmill extract → {out_dir}")
    table.add_column("op")
    table.add_column("ok", justify="right")
    table.add_column("failed", justify="right")
    for op, counts in report.get("ops", {}).items():
        table.add_row(op, str(counts.get("ok", 0)), str(counts.get("failed", 0)))
    return table


def summary_line(report: dict[str, Any]) -> str:
    """Utterances, hours of audio and wall time of a finished run."""
    return (
        f"{report.get('utterances', 0)} utterances, {report.get('audio_seconds', 0.0) / 3600:.3f} h of audio "
        f"in {report.get('wall_seconds', 0.0):.1f} s"
    )
