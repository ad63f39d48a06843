"""The progress line of a corpus run: utterances, audio as people say it, failures per op."""

from __future__ import annotations

import time

from pipeline.outputs.report import RunReport
from pipeline.run.hooks import Counts
from pipeline.units import audio_amount
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
    report = RunReport.from_dict({"utterances": 14, "audio_seconds": 95.0, "wall_seconds": 3.21})
    assert summary_line(report) == ("14 utterances, 1.6 min of audio in 3.2 s")


def test_an_extract_tasks_failures_count_for_each_op_asked_as_the_table_does() -> None:
    counts = Counts(n_ops=1, units_total=14, units_done=14, failed={"extract": 1})
    assert counts.line(("tokenize", "embed")).endswith("failed: 1 tokenize, 1 embed")
    assert counts.line().endswith("failed: 1 extract")  # before the plan says what was asked


def test_a_resumed_run_counts_the_audio_an_earlier_run_did_but_not_towards_its_speed() -> None:
    counts = Counts(n_ops=2, units_total=8, units_done=8, units_resumed=6, started=time.monotonic() - 10)
    counts.audio_done_s = 40.0  # 20 s each op, this run
    counts.add_resumed("tokenize", 1, 50.0)
    counts.add_resumed("embed", 1, 50.0)
    line = counts.line()
    assert line.startswith("4/4 utterances, 1.2 min audio, ")  # (40 + 100) / 2 = 70 s
    assert 1.5 < counts.rtf() <= 2.0 and line.endswith("failed: 1 tokenize, 1 embed")
    counts.resumed_uncounted = 1  # an earlier shard in an object store: its audio is not known
    assert counts.line().startswith("4/4 utterances, 20 s audio in this run, ")


def test_the_summary_table_says_how_many_of_its_failures_the_filters_left_out() -> None:
    from workers.corpus.progress import summary_table

    found = {"ops": {"embed": {"ok": 11, "failed": 3}}, "filters": {"filtered_utterances": 2}}
    report = RunReport.from_dict(found)
    assert summary_table(report, "out").caption == "failed includes 2 utterance(s) left out by the filters"
    unfiltered = RunReport.from_dict({"ops": {"embed": {"ok": 13, "failed": 1}}})
    assert summary_table(unfiltered, "out").caption is None


def test_the_summary_line_keeps_the_extractions_time_after_a_re_merge() -> None:
    report = {"utterances": 14, "audio_seconds": 68.8, "wall_seconds": 1.1, "remerge_wall_seconds": 0.5}
    assert summary_line(RunReport.from_dict(report)) == (
        "14 utterances, 1.1 min of audio in 1.1 s; filters applied anew in 0.5 s (nothing extracted)"
    )
