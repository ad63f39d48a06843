"""The queue's own cost per task (issue 3): tiny models, 2 worker processes, Redis on loopback.

    python -m benchmarks.queue_overhead [--tasks 1000] [--quick]

- latency: tasks sent one at a time (alternating `tokenize` and `embed` of a 1 s WAV by path);
  overhead = submit -> result (Celery `AsyncResult.get`, which the Redis result backend
  answers by pub/sub) minus the time inside the task (`timings_ms`: decode, features, model).
  p50 and p99 (target p50 < 5 ms). The same through `workers.queue.client.Client` (`submit` +
  `as_completed`, woken by each result's announcement), and a polling-only client (every 20 ms).
- throughput: all tasks submitted at once, then collected: tasks per second with 2 worker
  processes.
- split: on a second cluster whose workers trace each task (`benchmarks/trace`), the overhead
  split into submit -> the task's `run_clip` call starts, and `run_clip` returns -> result seen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import soundfile as sf

from benchmarks.common import log, percentile, results_dir, summary, write_result
from benchmarks.corpus import WORK_DIR, make_models
from workers.queue.app import TASK_NAMES

OPS = ("tokenize", "embed")
POLLING_ONLY_S = 0.02  # a polling-only client (`Client(wakeups=False)`), the interval used before wake-ups


def make_clip(folder: Path, seconds: float = 1.0) -> Path:
    from pipeline.demo import speechlike

    path = folder / "queue-clip.wav"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        sf.write(path, speechlike(seconds, 16000, 150.0, seed=1), 16000, subtype="PCM_16")
    return path


def own_seconds(value: dict[str, Any]) -> float:
    if value.get("error"):
        raise RuntimeError(f"task failed: {value['error']}")
    return float(sum(value.get("timings_ms", {}).values())) / 1000


def latency(app: Any, clip: Path, count: int) -> dict[str, Any]:
    overheads: dict[str, list[float]] = {op: [] for op in OPS}
    totals = []
    for index in range(count):
        op = OPS[index % 2]
        started = time.perf_counter()
        result = app.send_task(TASK_NAMES[op], args=[{"path": str(clip)}], queue=op)
        value = result.get(timeout=60)
        elapsed = time.perf_counter() - started
        result.forget()
        overheads[op].append((elapsed - own_seconds(value)) * 1000)
        totals.append(elapsed * 1000)
    everything = [x for values in overheads.values() for x in values]
    return {
        "tasks": count,
        "overhead_ms": {
            "p50": round(percentile(everything, 50), 3),
            "p90": round(percentile(everything, 90), 3),
            "p99": round(percentile(everything, 99), 3),
            "mean": round(statistics.fmean(everything), 3),
        },
        "overhead_ms_by_op": {op: round(percentile(v, 50), 3) for op, v in overheads.items() if v},
        "round_trip_ms_p50": round(percentile(totals, 50), 3),
    }


def client_latency(settings: Any, clip: Path, count: int, poll_s: float | None) -> dict[str, Any]:
    """The producer's view: `Client.submit` then `Client.as_completed`.

    `poll_s` None: the default client (woken by each result's announcement); else a polling-only
    client reading every `poll_s`.
    """
    from pipeline import tuning
    from workers.queue.client import Client

    client = Client(settings, wakeups=poll_s is None)
    poll_s = poll_s or tuning.RESULT_POLL_S
    overheads = []
    for index in range(count):
        op = OPS[index % 2]
        started = time.perf_counter()
        job = client.submit(op, clip)
        result = next(iter(client.as_completed([job], timeout_s=60, poll_s=poll_s)))
        elapsed = time.perf_counter() - started
        if result.error:
            raise RuntimeError(f"task failed: {result.error}")
        overheads.append((elapsed - sum(result.timings_ms.values()) / 1000) * 1000)
    return {
        "tasks": count,
        "overhead_ms": {
            "p50": round(percentile(overheads, 50), 3),
            "p99": round(percentile(overheads, 99), 3),
        },
    }


def throughput(app: Any, clip: Path, count: int) -> dict[str, Any]:
    started = time.perf_counter()
    pending = [
        app.send_task(TASK_NAMES[OPS[i % 2]], args=[{"path": str(clip)}], queue=OPS[i % 2])
        for i in range(count)
    ]
    submitted = time.perf_counter()
    inside = 0.0
    for result in pending:
        inside += own_seconds(result.get(timeout=120))
        result.forget()
    elapsed = time.perf_counter() - started
    return {
        "tasks": count,
        "submit_s": round(submitted - started, 4),
        "wall_s": round(elapsed, 4),
        "tasks_per_s": round(count / elapsed, 1),
        "inside_tasks_s": round(inside, 4),
    }


def latency_split(settings: Any, clip: Path, count: int) -> dict[str, Any]:
    """Where the overhead goes: a separate cluster whose workers trace every `run_clip` call
    (`benchmarks/trace`), so each task splits into submit -> `run_clip` start (to the worker),
    `run_clip` itself, and `run_clip` end -> result seen (back to the producer)."""
    from benchmarks.common import ROOT, TRACE_DIR
    from benchmarks.extract_run import read_traces
    from workers.embedded import LocalWorkers
    from workers.queue.app import create_app

    trace_dir = WORK_DIR / "runs" / f"queue-trace-{time.time_ns()}"
    trace_dir.mkdir(parents=True)
    env = {"BENCH_TRACE_DIR": str(trace_dir), "BENCH_TRACE_EACH": "1", "PYTHONPATH": f"{TRACE_DIR}:{ROOT}"}
    cluster = LocalWorkers(settings, 2, queues=list(OPS), extra_env=env).start()
    sent: list[tuple[float, float]] = []
    try:
        cluster.wait_ready()
        app = create_app(settings)
        latency(app, clip, 10)
        for path in trace_dir.glob("*.jsonl"):
            path.unlink()
        for index in range(count):
            op = OPS[index % 2]
            submitted = time.time()
            result = app.send_task(TASK_NAMES[op], args=[{"path": str(clip)}], queue=op)
            result.get(timeout=60)
            sent.append((submitted, time.time()))
            result.forget()
    finally:
        cluster.stop(timeout_s=5.0)
    records = sorted(
        (r for records in read_traces(trace_dir).values() for r in records if r["kind"] == "task"),
        key=lambda r: r["start"],
    )
    if len(records) != len(sent):
        return {"error": f"{len(records)} traced tasks for {len(sent)} sent"}
    to_worker = [(r["start"] - s) * 1000 for r, (s, _) in zip(records, sent, strict=True)]
    inside = [(r["end"] - r["start"]) * 1000 for r in records]
    staged = [sum(r["ms"].values()) for r in records]
    back = [(done - r["end"]) * 1000 for r, (_, done) in zip(records, sent, strict=True)]
    return {
        "tasks": count,
        "to_worker_ms_p50": round(percentile(to_worker, 50), 3),
        "process_ms_p50": round(percentile(inside, 50), 3),
        "stages_ms_p50": round(percentile(staged, 50), 3),
        "back_ms_p50": round(percentile(back, 50), 3),
        "to_worker_ms_p99": round(percentile(to_worker, 99), 3),
        "back_ms_p99": round(percentile(back, 99), 3),
    }


def measure_queue(tasks: int, repeats: int, quick: bool = False) -> dict[str, Any]:
    from pipeline.settings import Settings
    from workers.embedded import EmbeddedRedis, LocalWorkers
    from workers.queue.app import create_app

    models = make_models("tiny")
    clip = make_clip(WORK_DIR / "queue").resolve()
    embedded = EmbeddedRedis().start()
    settings = Settings.load(environ={}).model_copy(
        update={
            "broker_url": embedded.url,
            "model_dir": models,
            "provider": "cpu",
            "speech_check": False,  # generated clips are not speech
            "allowed_roots": (clip.parent,),
        }
    )
    cluster = LocalWorkers(settings, 2, queues=list(OPS)).start()
    runs: dict[str, list[dict[str, Any]]] = {
        "latency": [],
        "client": [],
        "client_polling": [],
        "throughput": [],
    }
    try:
        cluster.wait_ready()
        app = create_app(settings)
        latency(app, clip, 20)  # warm connections and code paths
        for repeat in range(repeats):
            log(f"queue overhead: repeat {repeat + 1}/{repeats}")
            runs["latency"].append(latency(app, clip, tasks))
            runs["client"].append(client_latency(settings, clip, max(20, tasks // 5), None))
            runs["client_polling"].append(client_latency(settings, clip, max(20, tasks // 5), POLLING_ONLY_S))
            runs["throughput"].append(throughput(app, clip, tasks))
        cluster.stop(timeout_s=5.0)
        log("queue overhead: traced split")
        split = latency_split(settings, clip, max(20, tasks // 5))
    finally:
        cluster.stop(timeout_s=5.0)
        embedded.stop()
    return {
        "tasks": tasks,
        "repeats": repeats,
        "workers": 2,
        "models": "tiny",
        "clip_s": float(sf.info(str(clip)).duration),
        "overhead_p50_ms": summary([r["overhead_ms"]["p50"] for r in runs["latency"]], 3),
        "overhead_p99_ms": summary([r["overhead_ms"]["p99"] for r in runs["latency"]], 3),
        "client_overhead_p50_ms": summary([r["overhead_ms"]["p50"] for r in runs["client"]], 3),
        "client_polling_overhead_p50_ms": summary(
            [r["overhead_ms"]["p50"] for r in runs["client_polling"]], 3
        ),
        "client_polling_s": POLLING_ONLY_S,
        "tasks_per_s": summary([r["tasks_per_s"] for r in runs["throughput"]], 1),
        "split": split,
        "target_p50_ms": 5.0,
        "runs": runs,
        "quick": quick,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tasks = 50 if args.quick else args.tasks
    data = measure_queue(tasks, 1 if args.quick else args.repeats, args.quick)
    path = write_result(results_dir(args.quick), "queue-overhead", data)
    print(json.dumps({k: data[k] for k in ("overhead_p50_ms", "overhead_p99_ms", "tasks_per_s")}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
