"""Cold start: how long from process start until a model (or a worker) serves, and the first
inference after warm-up.

- `timeline` (a fresh process per model, `python -m benchmarks.coldstart ...`): spawn ->
  interpreter up -> imports done -> `ModelSession.load` done -> warmed (`warm_up`, as
  `open_session` does it) -> the first inference after warm-up of a 10 s clip (features + model,
  and the model alone), then the median of 4 more runs for comparison.
- `worker_ready`: a real Celery worker (`LocalWorkers`, one process, both queues, both models) on
  an embedded Redis. One `embed` task is queued before the worker is spawned; the worker is
  ready for its first task at (result time - spawn - the task's own time). The heartbeat that
  says the models are loaded is timed too, and the trace hook gives load and warm-up times.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def timeline_main(
    models: Path, role: str, spawned: float, clip_s: float, cache_dir: Path | None
) -> dict[str, Any]:
    marks = {"interpreter": STARTED - spawned}
    import numpy as np  # noqa: F401
    import onnxruntime  # noqa: F401

    from pipeline.demo import speechlike
    from pipeline.features import whisper_log_mel
    from pipeline.inference import embedder_inputs, tokenizer_inputs, warm_up
    from pipeline.models.options import SessionOptions
    from pipeline.models.registry import Registry
    from pipeline.models.sessions import ModelSession

    marks["imported"] = time.time() - spawned
    registry = Registry.load()
    options = SessionOptions(provider="cpu", model_cache_dir=cache_dir)
    session = ModelSession.load(registry.find_model(role, models), role, options, registry)
    marks["loaded"] = time.time() - spawned
    warm_up(session, options.warmup_runs)
    marks["warmed"] = time.time() - spawned
    wave = speechlike(clip_s, 16000, 150.0, seed=10)

    def features() -> list[Any]:
        return tokenizer_inputs(whisper_log_mel(wave)) if role == "tokenizer" else embedder_inputs(wave)

    started = time.perf_counter()
    inputs = features()
    features_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    session.run(inputs)
    first_ms = (time.perf_counter() - started) * 1000
    later = []
    for _ in range(4):
        started = time.perf_counter()
        session.run(features())
        later.append((time.perf_counter() - started) * 1000)
    return {
        "role": role,
        "model_cache": session.cache_state,
        "marks_s": {k: round(v, 4) for k, v in marks.items()},
        "load_s": round(session.load_s, 4),
        "warmup_s": round(session.warmup_s, 4),
        "warmup_first_run_ms": round(session.first_run_ms or 0.0, 2),
        "first_inference_ms": round(features_ms + first_ms, 2),
        "first_inference_model_ms": round(first_ms, 2),
        "features_ms": round(features_ms, 2),
        "steady_inference_ms": round(statistics.median(later), 2),
        "clip_s": clip_s,
    }


def measure_timeline(
    models: Path, role: str, clip_s: float = 10.0, cache_dir: Path | None = None
) -> dict[str, Any]:
    """One fresh process loading one model (the parent records the spawn time).

    `cache_dir`: the optimized-model cache folder, as a worker has it (None: no cache).
    """
    from benchmarks.common import child_env, python_command, run_json_child

    command = python_command(
        "benchmarks.coldstart", "timeline", "--models", str(models), "--role", role, "--clip-s", str(clip_s)
    )
    if cache_dir is not None:
        command += ["--cache-dir", str(cache_dir)]
    command += ["--spawned", repr(time.time())]
    return run_json_child(command, child_env(), timeout_s=300)


def measure_worker_ready(
    models: Path, clip: Path, cache_dir: Path | None, timeout_s: float = 300
) -> dict[str, Any]:
    """Spawn one worker process (both queues, both models) and time it to its first task.

    `cache_dir`: the worker's optimized-model cache folder (None: `model_cache` off).
    """
    import redis

    from benchmarks.common import ROOT, TRACE_DIR
    from benchmarks.corpus import WORK_DIR
    from benchmarks.extract_run import read_traces
    from pipeline.settings import Settings
    from workers.embedded import EmbeddedRedis, LocalWorkers
    from workers.heartbeat import count_ready_workers
    from workers.queue.app import TASK_NAMES, create_app

    trace_dir = WORK_DIR / "runs" / f"coldstart-{time.time_ns()}"
    trace_dir.mkdir(parents=True)
    embedded = EmbeddedRedis().start()
    settings = Settings.load(environ={}).model_copy(
        update={
            "broker_url": embedded.url,
            "model_dir": models,
            "provider": "cpu",
            "speech_check": False,  # generated clips are not speech
            "allowed_roots": (clip.parent.resolve(),),
            "model_cache": cache_dir is not None,
            **({"model_cache_dir": cache_dir} if cache_dir is not None else {}),
        }
    )
    env = {"BENCH_TRACE_DIR": str(trace_dir), "PYTHONPATH": f"{TRACE_DIR}:{ROOT}"}
    app = create_app(settings)
    client = redis.Redis.from_url(embedded.url)
    cluster = LocalWorkers(settings, 1, queues=["tokenize", "embed"], extra_env=env)
    try:
        pending = app.send_task(TASK_NAMES["embed"], args=[{"path": str(clip.resolve())}], queue="embed")
        spawned = time.time()
        cluster.start()
        heartbeat_s = None
        while heartbeat_s is None and time.time() - spawned < timeout_s:
            if count_ready_workers(client) >= 1:
                heartbeat_s = time.time() - spawned
            else:
                time.sleep(0.02)
        result = pending.get(timeout=timeout_s)
        done_s = time.time() - spawned
    finally:
        cluster.stop(timeout_s=5.0)
        client.close()
        embedded.stop()
    task_s = sum(result.get("timings_ms", {}).values()) / 1000
    models_loaded = {}
    for records in read_traces(trace_dir).values():
        for record in records:
            if record["kind"] == "model":
                models_loaded[record["role"]] = {
                    "started_s": round(record["start"] - spawned, 3),
                    "load_s": round(record["load_s"], 3),
                    "warmup_s": round(record["warmup_s"], 3),
                    "ready_s": round(record["end"] - spawned, 3),
                }
    return {
        "heartbeat_ready_s": None if heartbeat_s is None else round(heartbeat_s, 3),
        "first_task_result_s": round(done_s, 3),
        "first_task_own_s": round(task_s, 4),
        "ready_for_first_task_s": round(done_s - task_s, 3),
        "models": models_loaded,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("timeline",))
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--role", default="tokenizer")
    parser.add_argument("--clip-s", type=float, default=10.0)
    parser.add_argument("--spawned", type=float, default=STARTED)
    parser.add_argument("--cache-dir", type=Path, default=None, help="optimized-model cache folder")
    args = parser.parse_args()
    print(json.dumps(timeline_main(args.models, args.role, args.spawned, args.clip_s, args.cache_dir)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
