"""`voxmill report --html`: the page is self-contained and drawn from the data; the loader reads a run's
files; a real headless Chromium renders the plots (pixels counted in each chart's box)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ErrorRecord
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance
from tests.browser import boxes, color_mask, dump_dom, needs_chromium, screenshot
from workers.observe.report_html import (
    BAR,
    BAR_FAILED,
    FIRST_FAILURES,
    HEIGHT,
    LINES,
    MARGIN_BOTTOM,
    MARGIN_TOP,
    ReportData,
    load_report_data,
    render_html,
    render_text,
    write_report,
)


def sample_data() -> ReportData:
    rng = np.random.default_rng(0)
    return ReportData(
        title="run <x> & co",
        durations_s=rng.uniform(1, 20, 300).tolist(),
        speech_ratios=rng.beta(5, 2, 300).tolist(),
        utts_per_speaker={"spk<a>": 40, "b": 20, "c": 10},
        failures_by_code={"no_speech": 12, "unreadable": 3},
        progress={
            "embed": [(2.0 * i, 50.0 * i) for i in range(1, 11)],
            "tokenize": [(2.5 * i, 40.0 * i) for i in range(1, 11)],
        },
        models={"embedder": {"file": "campplus.onnx", "sha256": "ab" * 32}},
        summary={
            "utterances": 315,
            "audio_seconds": 3000.0,
            "wall_seconds": 40.0,
            "ops": {"embed": {"ok": 300, "failed": 15}},
        },
    )


def bar_heights(mask: np.ndarray) -> list[int]:
    """The heights in pixels of the bars a colour mask of a chart holds, left to right."""
    runs, current = [], 0
    for height in mask.sum(axis=0):
        if height:
            current = max(current, int(height))
        elif current:
            runs.append(current)
            current = 0
    return runs


def test_the_page_loads_nothing_from_elsewhere() -> None:
    page = render_html(sample_data())
    without_svg_namespace = page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for fetches in ("http://", "https://", "src=", "<link", "@import", "url(", "@font-face"):
        assert fetches not in without_svg_namespace
    assert page.count("<svg") == 5 and page.count("<script>") == 1


def test_text_from_the_run_is_escaped() -> None:
    page = render_html(sample_data())
    assert "spk&lt;a&gt;" in page and "<a>" not in page and "run &lt;x&gt; &amp; co" in page


def test_bars_follow_the_data() -> None:
    page = render_html(sample_data())
    speakers = page.split('id="speakers"')[1].split("</svg>")[0]
    heights = [float(h) for h in re.findall(r'class="bar"[^>]* height="([\d.]+)"', speakers)]
    assert len(heights) == 3 and heights[0] == pytest.approx(2 * heights[1]) == pytest.approx(4 * heights[2])
    many = render_html(ReportData(utts_per_speaker={f"s{i:03d}": i + 1 for i in range(100)}))
    chart = many.split('id="speakers"')[1].split("</svg>")[0]
    assert chart.count('class="bar"') == 30 and "71 more: " in chart  # 30 bars: 29 speakers + the rest


def test_empty_data_still_renders_every_chart() -> None:
    page = render_html(ReportData())
    assert page.count("<svg") == 5 and page.count('class="chart empty"') == 5 and 'class="bar"' not in page


def test_the_loader_reads_a_run_folder(tmp_path: Path) -> None:
    utts = [Utterance(f"u{i}", f"/a/u{i}.wav", "s1" if i < 3 else "s2") for i in range(4)]
    stats = [
        {"duration_s": 1.0 + i, "speech_ratio": 0.2 * i, "speech_s": 0.2 * i * (1.0 + i)} for i in range(4)
    ]
    results = [
        TaskResult(input=u.utt, op="embed", embedding=[0.0] * 4, audio_seconds=1.0 + i, stats=stats[i])
        for i, u in enumerate(utts[:3])
    ]
    results.append(TaskResult(input="u3", op="embed", error=ErrorRecord("no_speech", "m"), stats=stats[3]))
    write_shard(RunFolder.of(tmp_path), ShardSpec(0, "embed", str(tmp_path), utts[:2]), results[:2])
    time.sleep(0.05)
    write_shard(RunFolder.of(tmp_path), ShardSpec(1, "embed", str(tmp_path), utts[2:]), results[2:])
    errors = [{"utt": "u3", "op": "embed", "code": "no_speech", "message": "m"}] * 2  # twice: counted once
    (tmp_path / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors))
    report = {
        "utterances": 4,
        "audio_seconds": 10.0,
        "wall_seconds": 30.0,
        "ops": {},
        "models": {"embedder": {"file": "c", "sha256": "e"}},
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    now = time.time()
    os.utime(tmp_path / "report.json", (now, now))
    data = load_report_data(tmp_path)
    assert sorted(data.durations_s) == [1.0, 2.0, 3.0, 4.0]  # the refused clip's duration too
    assert sorted(data.speech_ratios) == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert data.utts_per_speaker == {"s1": 3, "s2": 1}
    assert data.failures_by_code == {"no_speech": 1}
    assert [y for _, y in data.progress["embed"]] == [3.0, 6.0]  # audio seconds done, cumulative
    first, second = (x for x, _ in data.progress["embed"])
    assert 25.0 < first < second <= 31.0  # seconds since the start: report.json's time less 30 s
    assert data.models == report["models"] and data.summary["wall_seconds"] == 30.0
    page = write_report(tmp_path, tmp_path / "page.html")
    assert "Failures by code" in page.read_text()


@needs_chromium
def test_chromium_draws_every_plot(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    data = sample_data()
    data.speech_ratios = []  # one chart without data: its box must stay free of bars
    page.write_text(render_html(data))
    laid_out = boxes(dump_dom(page, tmp_path / "profile-dom"))
    assert set(laid_out) == {"durations", "speech-ratio", "speakers", "failures", "throughput"}
    image = screenshot(page, tmp_path / "report.png", tmp_path / "profile-shot")
    assert image.shape == (2000, 1200, 3)

    def pixels(chart: str, color: str) -> np.ndarray:
        x, y, w, h = laid_out[chart]
        assert y + h <= image.shape[0], f"{chart} is below the window"
        return color_mask(image[y : y + h, x : x + w], color)

    counts = {
        "durations": int(pixels("durations", BAR).sum()),
        "speech-ratio": int(pixels("speech-ratio", BAR).sum()),
        "speakers": int(pixels("speakers", BAR).sum()),
        "failures": int(pixels("failures", BAR_FAILED).sum()),
        "throughput": int(pixels("throughput", LINES[0]).sum() + pixels("throughput", LINES[1]).sum()),
    }
    print(f"plot pixels: {counts}")
    assert counts["durations"] > 5000 and counts["speakers"] > 5000 and counts["failures"] > 3000
    assert counts["throughput"] > 500 and counts["speech-ratio"] == 0
    # The speakers' bars, measured on screen: 40, 20, 10 utterances.
    runs = bar_heights(pixels("speakers", BAR))
    assert len(runs) == 3
    assert runs[0] / runs[1] == pytest.approx(2.0, rel=0.05) and runs[1] / runs[2] == pytest.approx(
        2.0, rel=0.1
    )


def test_a_speaker_whose_every_clip_failed_has_its_bar_and_the_failures_are_listed(tmp_path: Path) -> None:
    """The speakers come from utt_stats.parquet (every utterance), the failures from errors.jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    out.mkdir()
    utts = {"a1": "a", "a2": "a", "b1": "broken-spk", "b2": "broken-spk"}
    pq.write_table(pa.table({"utt": list(utts), "spk": list(utts.values())}), out / "utt_stats.parquet")
    errors = [
        {"utt": u, "op": op, "code": "unreadable", "message": f"{u}.wav is <not> audio"}
        for u in ("b1", "b2")
        for op in ("tokenize", "embed")
    ]
    (out / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors))
    report = {"utterances": 4, "audio_seconds": 60.0, "wall_seconds": 3.0, "remerge_wall_seconds": 0.2}
    (out / "report.json").write_text(json.dumps(report))
    data = load_report_data(out)
    assert data.utts_per_speaker == {"a": 2, "broken-spk": 2}
    assert data.failed_per_speaker == {"broken-spk": 2}
    assert data.failure_rows == 4 and data.first_failures[0] == errors[0]

    page = write_report(out, tmp_path / "pages" / "run.html").read_text()
    speakers = page.split('id="speakers"')[1].split("</svg>")[0]
    assert "broken-spk failed: 2" in speakers and f'fill="{BAR_FAILED}"' in speakers
    listed = page.split('id="failures-list"')[1].split("</table>")[0]
    assert listed.count("<tr>") == 5 and "b1.wav is &lt;not&gt; audio" in listed  # header + 4 rows
    assert '<a href="../out/errors.jsonl">errors.jsonl</a>' in page  # relative to the page
    assert "filters applied anew" in page and "20.0x real time" in page  # the extraction's speed

    text = render_text(data, "out/errors.jsonl")
    assert "speakers              2; every utterance failed for broken-spk" in text
    assert "4 failure(s) (utterance and op), from out/errors.jsonl:" in text
    assert "  b2  embed  unreadable: b2.wav is <not> audio" in text
    assert "failed utterances     2 by code: unreadable 2" in text


def test_many_failures_list_the_first_few_and_say_where_the_rest_are(tmp_path: Path) -> None:
    errors = [{"utt": f"u{i}", "op": "embed", "code": "no_speech", "message": "m"} for i in range(25)]
    (tmp_path / "errors.jsonl").write_text("".join(json.dumps(e) + "\n" for e in errors))
    data = load_report_data(tmp_path)
    assert data.failure_rows == 25 and len(data.first_failures) == FIRST_FAILURES
    assert f"25 failure(s) (utterance and op) in x; the first {FIRST_FAILURES}:" in render_text(data, "x")


@needs_chromium
def test_chromium_draws_the_failed_part_of_each_speakers_bar_and_lists_the_failures(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    data = sample_data()
    data.failed_per_speaker = {"c": 10, "b": 5}  # every clip of c failed, a quarter of b's
    data.first_failures = [{"utt": "c_001", "op": "embed", "code": "no_speech", "message": "0 ms of speech"}]
    data.failure_rows = 1
    page.write_text(render_html(data))
    dom = dump_dom(page, tmp_path / "profile-dom")
    x, y, w, h = boxes(dom)["speakers"]
    image = screenshot(page, tmp_path / "report.png", tmp_path / "profile-shot")
    chart = image[y + MARGIN_TOP : y + HEIGHT - MARGIN_BOTTOM, x : x + w]  # the plot, not its legend
    runs = bar_heights(color_mask(chart, BAR_FAILED))  # the red bars, left to right: b, then c
    assert len(runs) == 2 and runs[1] / runs[0] == pytest.approx(2.0, rel=0.1)
    blue = color_mask(chart, BAR).sum(axis=0)
    assert int(blue.sum()) > 3000  # a's and b's ok parts
    listed = dom.split('id="failures-list"')[1].split("</table>")[0]
    assert "c_001" in listed and "0 ms of speech" in listed and 'href="errors.jsonl"' in dom
