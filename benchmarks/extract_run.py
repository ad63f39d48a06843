"""`voxmill extract` end to end, as a whole process timed from outside, and where its time went.

`run_extract` spawns `python -m workers.cli extract MANIFEST --out DIR --ops ... --workers N`
without a broker (embedded Redis, local workers), times it from spawn to exit, samples the
process tree's memory, and reads the worker trace (`benchmarks/trace/sitecustomize.py`) to split
the run's process-seconds (wall x worker processes) into stages:

- `startup`: from spawn until the worker's first utterance (driver start and planning, embedded
  Redis, Celery start, model load and warm-up);
- `decode`, `resample`, `speech` (the speech check), `features` (log-mel or fbank), `inference`:
  the utterances' own stages (`TaskResult.timings_ms`);
- `task_other`: inside a shard task but outside those stages (path checks, result records);
- `write`: writing the shard file;
- `queue_wait`: between two shard tasks of a worker (acknowledging, fetching and dispatching the
  next message: the queue's cost);
- `tail`: after the worker's last task until the whole process exits (waiting for the other
  workers' last shards, the merge, shutdown).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import TRACE_DIR, child_env, python_command, timed_child
from benchmarks.corpus import WORK_DIR, Clip

RUNS_DIR = WORK_DIR / "runs"
FEATURE_STAGES = ("log_mel", "fbank")
INFERENCE_STAGES = ("tokenize", "embed")
STAGES = (
    "startup",
    "decode",
    "resample",
    "speech",
    "features",
    "inference",
    "task_other",
    "write",
    "queue_wait",
    "tail",
)
PER_UTTERANCE_STAGES = tuple(s for s in STAGES if s not in ("startup", "tail"))


def write_manifest(clips: Sequence[Clip], path: Path) -> Path:
    """A JSONL manifest (`utt`, `path`, `spk`) of `clips` for `voxmill extract`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"utt": c.utt, "path": c.path, "spk": c.spk}) for c in clips]
    path.write_text("\n".join(lines) + "\n")
    return path


def extract_command(
    manifest: Path,
    out_dir: Path,
    models: Path,
    ops: Sequence[str],
    workers: int,
    shard_size: int | None,
) -> list[str]:
    """`voxmill extract MANIFEST --out DIR --ops ... --models M --workers N [--shard-size S] --quiet`."""
    args = [str(manifest), "--out", str(out_dir), "--ops", ",".join(ops), "--models", str(models)]
    args += ["--workers", str(workers)]
    if shard_size:
        args += ["--shard-size", str(shard_size)]
    return python_command("workers.cli", "extract", *args, "--quiet")


def run_extract(
    manifest: Path,
    models: Path,
    ops: Sequence[str],
    workers: int,
    *,
    threads: int = 1,
    shard_size: int | None = None,
    timeout_s: float = 3600,
    settings: dict[str, str] | None = None,
    keep: bool = False,
) -> dict[str, Any]:
    """One `voxmill extract` run in a fresh output folder (`settings`: `VOXMILL_*` variables);
    `keep`: the output and trace folders are left for the caller (`out_dir`, `trace_dir`)."""
    run_id = f"{'-'.join(ops)}-w{workers}-t{threads}-{uuid.uuid4().hex[:8]}"
    out_dir = RUNS_DIR / run_id
    trace_dir = RUNS_DIR / f"{run_id}-trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    extra = {"VOXMILL_INTRA_OP_THREADS": str(threads), "BENCH_TRACE_DIR": str(trace_dir), **(settings or {})}
    env = child_env(extra)
    env["PYTHONPATH"] = f"{TRACE_DIR}:{env['PYTHONPATH']}"
    argv = extract_command(manifest, out_dir, models, ops, workers, shard_size)
    spawned = time.time()
    child = timed_child(argv, env, timeout_s)
    wall_s, sampler = child.wall_s, child.sampler
    ended = spawned + wall_s
    report = json.loads((out_dir / "report.json").read_text())
    failed = {op: v["failed"] for op, v in report["ops"].items() if v["failed"]}
    if failed:
        raise RuntimeError(f"extract run {run_id} had failures: {failed}; see {out_dir / 'errors.jsonl'}")
    traces = read_traces(trace_dir)
    result: dict[str, Any] = {
        "ops": list(ops),
        "workers": workers,
        "threads": threads,
        "shard_size": shard_size,
        "wall_s": round(wall_s, 4),
        "cpu_s": round(child.cpu_s, 3),
        "driver_wall_s": report.get("wall_seconds"),
        "utterances": report["utterances"],
        "audio_s": report["audio_seconds"],
        "rtf_x": round(report["audio_seconds"] / wall_s, 2),
        "stages": stage_breakdown(traces, spawned, ended, workers),
        "memory_mb": sampler.peaks_by_kind() if sampler else {},
        "tree_peak_mb": round(sampler.total_peak_mb, 1) if sampler else None,
    }
    if keep:
        return {**result, "out_dir": str(out_dir), "trace_dir": str(trace_dir)}
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return result


def read_traces(trace_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """The trace records of each worker process (by pid)."""
    traces: dict[int, list[dict[str, Any]]] = {}
    for file in sorted(trace_dir.glob("trace-*.jsonl")):
        for line in file.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                traces.setdefault(int(record["pid"]), []).append(record)
    return traces


def stage_breakdown(
    traces: dict[int, list[dict[str, Any]]], spawned: float, ended: float, workers: int
) -> dict[str, Any]:
    """Process-seconds per stage over all workers; shares of wall x workers and per utterance."""
    totals = dict.fromkeys(STAGES, 0.0)
    model_s = 0.0
    first_task_s: list[float] = []
    utterances = 0
    for records in traces.values():
        shards = sorted(
            (r for r in records if r["kind"] == "shard" and r["utts"]), key=lambda r: r["write_start"]
        )
        written = {(r["op"], r["shard"]): r["write_end"] for r in records if r["kind"] == "written"}
        for shard in shards:  # a worker killed right after its last write: no end recorded
            shard["write_end"] = written.get((shard["op"], shard["shard"]), shard["write_start"])
        models = [r for r in records if r["kind"] == "model"]
        model_s += sum(r["end"] - r["start"] for r in models)
        if not shards:
            totals["tail"] += ended - spawned
            continue
        first_start = shards[0]["utts"][0]["start"]
        first_task_s.append(first_start - spawned)
        totals["startup"] += first_start - spawned
        previous_end = None
        for shard in shards:
            start = shard["utts"][0]["start"]
            if previous_end is not None:
                totals["queue_wait"] += max(0.0, start - previous_end)
            in_task = shard["write_start"] - start
            staged = 0.0
            for utt in shard["utts"]:
                utterances += 1
                ms = utt["ms"]
                totals["decode"] += ms.get("decode", 0.0) / 1000
                totals["resample"] += ms.get("resample", 0.0) / 1000
                totals["speech"] += ms.get("speech", 0.0) / 1000
                totals["features"] += sum(ms.get(s, 0.0) for s in FEATURE_STAGES) / 1000
                totals["inference"] += sum(ms.get(s, 0.0) for s in INFERENCE_STAGES) / 1000
                staged += sum(ms.values()) / 1000
            totals["task_other"] += max(0.0, in_task - staged)
            totals["write"] += shard["write_end"] - shard["write_start"]
            previous_end = shard["write_end"]
        totals["tail"] += max(0.0, ended - (previous_end or spawned))
    capacity = (ended - spawned) * workers
    steady = sum(totals[s] for s in PER_UTTERANCE_STAGES)
    return {
        "process_s": {k: round(v, 4) for k, v in totals.items()},
        "share_of_wall": {k: round(v / capacity, 5) for k, v in totals.items()} if capacity else {},
        "share_per_utterance": {k: round(totals[k] / steady, 5) for k in PER_UTTERANCE_STAGES}
        if steady
        else {},
        "model_load_warm_s": round(model_s, 4),
        "first_task_after_spawn_s": [round(s, 3) for s in first_task_s],
        "traced_workers": len(traces),
        "traced_utterances": utterances,
        "unaccounted_s": round(capacity - sum(totals.values()), 4),
    }
