"""Progress of a corpus run: a live rich bar on a terminal, plain log lines otherwise, or nothing."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table


def audio_amount(seconds: float) -> str:
    """Seconds of audio as people say them: 42 s, 12.5 min, 3.25 h."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


@dataclass
class Counts:
    """What a run has done so far: work units (utterance x op), audio seconds, failures per op.

    The totals are known once the listing has been read (the audio total only when the listing
    gives durations); the audio done is what the workers measured in this run. Shards an earlier
    run did count as done, not towards this run's speed. In a run of tar shards the units are
    tars (their utterances are known once read: `tar_utterances` counts those done).
    """

    n_ops: int
    unit: str = "utterances"
    tar_utterances: int = 0
    units_total: int | None = None
    audio_total_s: float | None = None
    units_done: int = 0
    units_resumed: int = 0
    audio_done_s: float = 0.0
    failed: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def rtf(self) -> float:
        """Audio seconds processed in this run per wall second (real-time factor)."""
        elapsed = time.monotonic() - self.started
        return (self.audio_done_s / max(self.n_ops, 1)) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        n_ops = max(self.n_ops, 1)
        total = "…" if self.units_total is None else str(self.units_total // n_ops)
        parts = [f"{self.units_done // n_ops}/{total} {self.unit}"]
        if self.unit == "tars":
            parts[0] += f" ({self.tar_utterances // n_ops} utterances)"
        if self.audio_done_s > 0:
            audio = audio_amount(self.audio_done_s / n_ops)
            of = f" of {audio_amount(self.audio_total_s)}" if self.audio_total_s else ""
            parts += [f"{audio}{of} audio", f"{self.rtf():.1f}x real time"]
        elif self.audio_total_s:
            parts.append(f"{audio_amount(self.audio_total_s)} audio")
        failed = ", ".join(f"{n} {op}" for op, n in self.failed.items() if n)
        if self.units_resumed and self.units_resumed == self.units_done and not failed:
            parts.append("all done by an earlier run")
        else:
            parts.append(f"failed: {failed}" if failed else "none failed")
        return ", ".join(parts)


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
            self._task = self._progress.add_task("extract", total=None, summary="")
        return self

    def update(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                total=self.counts.units_total,
                completed=self.counts.units_done,
                summary=self.counts.line(),
            )
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
    """Utterances, audio and wall time of a finished run."""
    audio = audio_amount(report.get("audio_seconds", 0.0))
    wall_s = report.get("wall_seconds", 0.0)
    return f"{report.get('utterances', 0)} utterances, {audio} of audio in {wall_s:.1f} s"
