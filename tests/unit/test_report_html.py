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

from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance
from tests.browser import boxes, color_mask, dump_dom, needs_chromium, screenshot
from workers.observe.report_html import (
    BAR,
    BAR_FAILED,
    LINES,
    ReportData,
    load_report_data,
    render_html,
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
    results.append(
        TaskResult(input="u3", op="embed", error={"code": "no_speech", "message": "m"}, stats=stats[3])
    )
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
    columns = pixels("speakers", BAR).sum(axis=0)
    runs, current = [], 0
    for height in columns:
        if height:
            current = max(current, int(height))
        elif current:
            runs.append(current)
            current = 0
    assert len(runs) == 3
    assert runs[0] / runs[1] == pytest.approx(2.0, rel=0.05) and runs[1] / runs[2] == pytest.approx(
        2.0, rel=0.1
    )
