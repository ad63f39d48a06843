"""Progress of a corpus run: a live rich bar on a terminal, plain log lines otherwise, or nothing."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from pipeline.outputs.report import RunReport
from pipeline.run.hooks import Counts, RunHooks, RunRound
from pipeline.units import audio_amount


class ProgressView(RunHooks):
    """Shows a run's `Counts` as a bar (terminal), as a line every few seconds (log), or not at all
    (quiet), with the driver's messages."""

    def __init__(self, n_ops: int, quiet: bool = False, console: Console | None = None) -> None:
        self.counts = Counts(n_ops=n_ops)
        self.asked: tuple[str, ...] = ()  # the run's ops, once its plan says: what extract tasks do
        self.quiet = quiet
        self.console = console or Console(stderr=True)
        self.live = not quiet and self.console.is_terminal
        self._last_line = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def run_started(self) -> None:
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

    def round_ended(self, now: RunRound) -> None:
        self.counts = now.counts
        if now.plan.header is not None:
            self.asked = tuple(now.plan.header.ops)
        self.update()

    def update(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                total=self.counts.units_total,
                completed=self.counts.units_done,
                summary=self.counts.line(self.asked),
            )
        elif not self.quiet and time.monotonic() - self._last_line >= 5.0:
            self._last_line = time.monotonic()
            print(f"extract: {self.counts.line(self.asked)}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def run_ended(self) -> None:
        if self._progress is not None:
            self.update()
            self._progress.stop()
        elif not self.quiet:
            print(f"extract: {self.counts.line(self.asked)}", file=sys.stderr, flush=True)


def summary_table(report: RunReport, out_dir: str) -> Table:
    """The final summary: per op ok/failed, audio, wall time, where the files are."""
    filtered = report.filtered_utterances
    # The progress line counts what the workers failed; the filters apply after, at the merge.
    caption = f"failed includes {filtered} utterance(s) left out by the filters" if filtered else None
    table = Table(title=f"voxmill extract → {out_dir}", caption=caption)
    table.add_column("op")
    table.add_column("ok", justify="right")
    table.add_column("failed", justify="right")
    for op, counts in report.ops.items():
        table.add_row(op, str(counts.ok), str(counts.failed))
    return table


def summary_line(report: RunReport) -> str:
    """Utterances, audio and wall time of a finished run (the extraction's, after a re-merge with
    other filters, which is said apart)."""
    audio = audio_amount(report.audio_seconds)
    line = f"{report.utterances} utterances, {audio} of audio in {report.wall_seconds:.1f} s"
    if report.remerge_wall_seconds is not None:
        line += f"; filters applied anew in {report.remerge_wall_seconds:.1f} s (nothing extracted)"
    return line
