"""The benchmarks of object stores at latency and of batched tokens run end to end on a few clips
and tiny models, and render their sections and targets (beside tests/unit/test_benchmarks.py, in a
file of their own so that the test processes share the benchmark runs' minutes). Nothing here
asserts on a time."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report import targets_section
from tests.helpers import run_benchmark, target_labels


def test_latency_runs_and_reports(tmp_path: Path) -> None:
    """`benchmarks.latency` end to end on a few clips: both worker settings, every delay, every
    clip embedded in every run, through the delaying proxy."""
    out = tmp_path / "latency.json"
    args = ["--clips", "8", "--delays", "0,20", "--repeats", "1", "--out", str(out)]
    run_benchmark(tmp_path / "work", "benchmarks.latency", *args)
    data = json.loads(out.read_text())
    assert set(data["settings"]) == {"reads in flight", "one read at a time"}
    for table in data["settings"].values():
        assert set(table) == {"local", "+0 ms", "+20 ms"}
        assert all(run["failed"] == 0 and run["audio_s"] > 0 for row in table.values() for run in row["runs"])
    assert set(data["in_flight_over_one_at_a_time"]) == {"+0 ms", "+20 ms"}
    from benchmarks.report import latency_section

    section = "\n".join(latency_section(data))
    assert "| reads | local | +0 ms | +20 ms |" in section and "| one read at a time |" in section
    assert target_labels({"latency": data}) == [
        "| objects at +20 ms, reads in flight, tiny models: rate / the same at +0 ms",
        "| worker CPU per GET (per clip, over local files)",
    ]
    full = {**data, "models": "full-size stand-ins"}  # what `--models full` writes, as latency-full
    assert "## Objects at real latency, full-size models" in latency_section(full)
    assert target_labels({"latency": data, "latency-full": full})[0] == (
        "| objects at +20 ms, reads in flight, full-size models: rate / the same at +0 ms"
    )


def test_outputs_in_a_bucket_run_and_report(tmp_path: Path) -> None:
    """`benchmarks.latency --outputs` end to end on a few clips: workers uploading behind their
    tasks and in them, every variant run, each clip once in its outputs."""
    out = tmp_path / "outputs.json"
    args = ["--outputs", "--clips", "8", "--delays", "0,20", "--repeats", "1", "--out", str(out)]
    run_benchmark(tmp_path / "work", "benchmarks.latency", *args)
    data = json.loads(out.read_text())
    behind, in_task = data["settings"]["uploads behind"], data["settings"]["uploads in the task"]
    assert set(behind) == {"local", "bucket +0 ms", "bucket +20 ms", "bucket, serial merge +20 ms"}
    assert set(in_task) == {"local", "bucket +0 ms", "bucket +20 ms"}
    assert all(run["utts"] == 8 for row in [*behind.values(), *in_task.values()] for run in row["runs"])
    from benchmarks.report import outputs_section

    section = "\n".join(outputs_section(data))
    assert "| outputs | uploads behind | uploads in the task |" in section
    target = targets_section({"latency_outputs": data})[4]
    assert "outputs in the bucket at +20 ms, tiny models: whole run / local outputs" in target


def test_cpu_per_get_runs_and_reports(tmp_path: Path) -> None:
    """`benchmarks.get_cpu` on a few objects: every reader measured, voxmill's own GETs used."""
    out = tmp_path / "get-cpu.json"
    run_benchmark(
        tmp_path / "work", "benchmarks.get_cpu", "--objects", "5", "--repeats", "1", "--out", str(out)
    )
    data = json.loads(out.read_text())
    assert set(data["cpu_ms_per_get"]) == {"voxmill", "voxmill, read ahead", "s3fs", "botocore"}
    assert all(by["median"] > 0 for by in data["cpu_ms_per_get"].values())
    from benchmarks.report import get_cpu_section

    assert "| voxmill |" in "\n".join(get_cpu_section(data))


def test_batching_runs_and_reports(tmp_path: Path) -> None:
    """`benchmarks.batching` end to end on tiny models: both corpora with batching on and off, the
    same tokens, the batches the workers ran, single jobs, its section and targets."""
    out = tmp_path / "batching.json"
    args = [
        "--models",
        "tiny",
        "--short",
        "24",
        "--mixed",
        "8",
        "--repeats",
        "1",
        "--jobs",
        "3",
        "--shard-size",
        "12",
    ]
    run_benchmark(tmp_path / "work", "benchmarks.batching", *args, "--out", str(out))
    data = json.loads(out.read_text())
    assert data["short"]["tokens_identical"] and data["mixed"]["tokens_identical"]
    assert data["short"]["clips"] == 24 and sum(data["short"]["batch_sizes"].values()) > 0
    assert data["single_jobs"]["auto"]["p50_ms"] > 0 and data["single_jobs"]["off"]["p50_ms"] > 0
    from benchmarks.report import batching_section

    section = "\n".join(batching_section(data))
    assert "| short (1–3 s) | 24 |" in section and "tiny stand-ins" in section
    assert target_labels({"batching": data}) == [
        "| batched tokens on short clips: rate / unbatched",
        "| batched tokens on a mixed corpus: rate / unbatched",
        "| batched tokens: single-job p50 / unbatched",
    ]
