"""A real `voxmill extract` run (embedded Redis, a local worker, tiny stand-ins), then the audit of
its outputs and the report of its folder, rendered by a real headless Chromium."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.audio.quality import STAT_FIELDS
from pipeline.outputs.audit import AuditThresholds, audit_run, paths_by_utt, read_stored_rows
from pipeline.outputs.folder import RunFolder
from tests.browser import boxes, color_mask, dump_dom, needs_chromium, screenshot
from tests.conftest import voxmill
from tests.helpers import make_audio_folder
from workers.observe.report_html import BAR, LINES, load_report_data, write_report

CLIPS = 8


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_models: Path) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("audit-run")
    corpus = make_audio_folder(root / "corpus", CLIPS, 0.5, 3.0, speakers=2, seed=3)
    out = root / "out"
    done = voxmill(
        "extract", str(corpus), "--out", str(out), "--models", str(tiny_models), "--workers", "1",
        "--shard-size", "2", "--quiet", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return corpus, out, tiny_models


def corpus_paths(corpus: Path) -> dict[str, str]:
    """A folder corpus's (utt, path): utt is the path below the folder without its extension."""
    return paths_by_utt((str(p.relative_to(corpus).with_suffix("")), str(p)) for p in corpus.rglob("*.wav"))


def test_the_shard_files_carry_the_stats(finished: tuple[Path, Path, Path]) -> None:
    _, out, models = finished
    rows = [
        row for path in sorted((out / "shards").glob("*.parquet")) for row in pq.read_table(path).to_pylist()
    ]
    assert len(rows) == CLIPS  # tokenize and embed as one extract task: both in each row
    for row in rows:
        assert row["source_codec"] == "WAV/PCM_16" and row["source_rate_hz"] == 16000
        assert 0.5 <= row["duration_s"] <= 3.0 and row["rms_dbfs"] < row["peak_dbfs"] <= 0.0
        assert set(STAT_FIELDS) <= set(row)
        assert row["tokenizer_sha256"] and row["embedder_sha256"]


def test_an_honest_run_passes_its_audit(finished: tuple[Path, Path, Path]) -> None:
    corpus, out, models = finished
    rows = read_stored_rows(RunFolder.of(out))
    assert len(rows) == CLIPS and all(r.speech_token and r.embedding for r in rows.values())
    report = audit_run(rows, corpus_paths(corpus), models, sample=5, seed=7, thresholds=AuditThresholds())
    assert report.ok, report.reasons
    assert report.to_dict()["sampled"] == 5
    assert all(group.judged for group in report.models)  # the run's models are the folder's


def test_a_tampered_output_fails_its_audit(finished: tuple[Path, Path, Path], tmp_path: Path) -> None:
    corpus, out, models = finished
    copy = tmp_path / "out"
    copy.mkdir()
    for name in ("utt_embeddings.parquet", "report.json"):
        (copy / name).write_bytes((out / name).read_bytes())
    table = pq.read_table(out / "speech_tokens.parquet")
    tokens = table.column("speech_token").to_pylist()
    tokens[0] = [(t + 1) % 4096 for t in tokens[0]]
    victim = table.column("utt")[0].as_py()
    changed = table.set_column(1, "speech_token", pa.array(tokens, pa.list_(pa.int32())))
    pq.write_table(changed, copy / "speech_tokens.parquet")
    rows = read_stored_rows(RunFolder.of(copy))
    report = audit_run(rows, corpus_paths(corpus), models, CLIPS, 0, AuditThresholds())
    assert not report.ok and any(victim in reason for reason in report.reasons), report.reasons


def test_the_report_reads_the_run(finished: tuple[Path, Path, Path]) -> None:
    _, out, _ = finished
    data = load_report_data(out)
    assert len(data.durations_s) == CLIPS and sum(data.utts_per_speaker.values()) == CLIPS
    assert set(data.progress) == {"extract"}  # the shard tasks' op: both ops in one task
    assert data.progress["extract"][-1][1] == pytest.approx(sum(data.durations_s), abs=0.01)
    assert data.speech_ratios == []  # the worker ran no speech check
    assert data.failures_by_code == {}


def test_voxmill_report_without_html_prints_a_summary(finished: tuple[Path, Path, Path]) -> None:
    _, out, _ = finished
    done = voxmill("report", str(out), env={"COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert f"  utterances            {CLIPS}" in done.stdout
    assert f"  wall time             {report['wall_seconds']:.1f} s" in done.stdout
    assert f"  op embed              {CLIPS} ok, 0 failed" in done.stdout and "x real time" in done.stdout
    assert f"  failures              none ({out}/errors.jsonl is empty)" in done.stdout
    assert "  speakers              2" in done.stdout
    missing = voxmill("report", str(out / "shards"))
    assert missing.returncode == 2 and "not a finished `voxmill extract` output folder" in missing.stderr


@needs_chromium
def test_the_report_page_renders_in_chromium(finished: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, out, _ = finished
    page = write_report(out, tmp_path / "report.html")
    dom = dump_dom(page, tmp_path / "dom-profile")
    laid_out = boxes(dom)
    listed = dom.split('id="failures-list"')[1].split("</p>")[0]  # none failed: says so, with the link
    assert listed.startswith(">none: ") and listed.endswith("</a> is empty")
    href = listed.split('href="')[1].split('"')[0]  # relative to the page, wherever it was written
    assert (page.parent / href).resolve() == (out / "errors.jsonl").resolve()
    image = screenshot(page, tmp_path / "report.png", tmp_path / "shot-profile")

    def count(chart: str, color: str) -> int:
        x, y, w, h = laid_out[chart]
        return int(color_mask(image[y : y + h, x : x + w], color).sum())

    assert count("durations", BAR) > 2000 and count("speakers", BAR) > 2000
    assert count("throughput", LINES[0]) + count("throughput", LINES[1]) > 300
    assert count("speech-ratio", BAR) == 0 and count("failures", BAR) == 0
