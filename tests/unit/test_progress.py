"""The progress line of a corpus run: utterances, audio as people say it, failures per op."""

from __future__ import annotations

import time

from pipeline.units import audio_amount
from workers.corpus.hooks import Counts
from workers.corpus.progress import summary_line


def test_audio_is_said_in_seconds_minutes_or_hours() -> None:
    assert (
        audio_amount(42.4) == "42 s" and audio_amount(750) == "12.5 min" and audio_amount(11_700) == "3.25 h"
    )


def test_failures_are_counted_per_op_as_the_summary_table_counts_them() -> None:
    counts = Counts(n_ops=2, units_total=28, audio_total_s=36.0)
    counts.units_done, counts.audio_done_s, counts.failed = 28, 72.0, {"tokenize": 2, "embed": 2}
    line = counts.line()
    assert line.startswith("14/14 utterances, 36 s of 36 s audio, ")
    assert line.endswith("failed: 2 tokenize, 2 embed")


def test_a_resumed_run_shows_no_speed_for_work_an_earlier_run_did() -> None:
    counts = Counts(n_ops=1, units_total=4, audio_total_s=7200.0)
    counts.units_done = counts.units_resumed = 4
    assert "real time" not in counts.line() and counts.rtf() == 0.0
    assert counts.line() == "4/4 utterances, 2.00 h audio, all done by an earlier run"


def test_totals_unknown_until_the_listing_is_read_and_the_speed_counts_this_runs_audio() -> None:
    counts = Counts(n_ops=1, started=time.monotonic() - 10)
    counts.units_done, counts.audio_done_s = 64, 100.0
    assert counts.line().startswith("64/… utterances, 1.7 min audio, ")
    assert 9.0 < counts.rtf() <= 10.0


def test_the_summary_line_says_minutes_for_a_short_corpus() -> None:
    assert summary_line({"utterances": 14, "audio_seconds": 95.0, "wall_seconds": 3.21}) == (
        "14 utterances, 1.6 min of audio in 3.2 s"
    )
