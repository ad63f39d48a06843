"""Benchmark-only tracing of `voxmill extract` worker processes (never imported by voxmill itself).

`benchmarks/extract_run.py` puts this folder first on PYTHONPATH and names a folder in
BENCH_TRACE_DIR; in Celery worker processes (`python -m workers.worker`, or `celery`) this wraps
`pipeline` functions before `workers.queue.tasks` imports them, and appends one JSON line per shard to
`$BENCH_TRACE_DIR/trace-<pid>.jsonl`:

- `open_session`: when each model was loaded and warmed (wall clock);
- `run_clip`: start and end of every utterance and its `timings_ms` stages; `run_clips` (a shard's
  clips with batched tokens): the call's start and end for each of its utterances;
- `batch_tokens`: the rows of every batch run (one line each);
- `shard_file_table`, then `write_table_at`: start of the shard file's write (with the shard's
  utterances: its table is made), then its end (the file is written).

With BENCH_TRACE_EACH=1 every `run_clip` call is written at once (single-audio tasks, no shards).

Cost: two `time.time()` calls per utterance and two lines written per shard.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _install(trace_dir: str) -> None:
    import pipeline.batching as batching
    import pipeline.inference as inference
    import pipeline.outputs.writers as writers

    each = os.environ.get("BENCH_TRACE_EACH") == "1"
    pending: list[dict[str, object]] = []
    original_run_clip = inference.run_clip
    original_table = writers.shard_file_table
    original_write = writers.write_table_at
    writing: list[tuple[str, int]] = []  # the shard whose table was made last
    original_open = inference.open_session
    original_run_clips = batching.run_clips
    original_batch_tokens = batching.batch_tokens

    def emit(record: dict[str, object]) -> None:
        record["pid"] = os.getpid()
        with open(os.path.join(trace_dir, f"trace-{os.getpid()}.jsonl"), "a") as stream:
            stream.write(json.dumps(record) + "\n")

    def open_session(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.time()
        session = original_open(*args, **kwargs)
        emit(
            {
                "kind": "model",
                "role": session.role,
                "start": started,
                "end": time.time(),
                "load_s": session.load_s,
                "warmup_s": session.warmup_s,
            }
        )
        return session

    def run_clip(label, *args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.time()
        result = original_run_clip(label, *args, **kwargs)
        record = {
            "utt": label,
            "start": started,
            "end": time.time(),
            "ms": result.timings_ms,
            "audio_s": result.audio_seconds,
            "ok": result.ok,
        }
        if each:
            emit({"kind": "task", **record})
        else:
            pending.append(record)
        return result

    def run_clips(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.time()
        results = original_run_clips(*args, **kwargs)
        ended = time.time()
        for result in results:
            pending.append(
                {
                    "utt": result.input,
                    "start": started,
                    "end": ended,
                    "ms": result.timings_ms,
                    "audio_s": result.audio_seconds,
                    "ok": result.ok,
                }
            )
        return results

    def batch_tokens(session, rows):  # type: ignore[no-untyped-def]
        emit({"kind": "batch", "rows": len(rows)})
        return original_batch_tokens(session, rows)

    def shard_file_table(spec, results, *args, **kwargs):  # type: ignore[no-untyped-def]
        # The shard's record goes out before its file: once the last file exists, a finished run
        # kills its workers at once, and a record written after it could be lost.
        utts = list(pending)
        pending.clear()
        writing[:] = [(spec.op, spec.shard)]
        emit({"kind": "shard", "op": spec.op, "shard": spec.shard, "write_start": time.time(), "utts": utts})
        return original_table(spec, results, *args, **kwargs)

    def write_table_at(out, name, table):  # type: ignore[no-untyped-def]
        original_write(out, name, table)
        if writing:
            op, shard = writing.pop()
            emit({"kind": "written", "op": op, "shard": shard, "write_end": time.time()})

    inference.run_clip = run_clip
    batching.run_clips = run_clips
    batching.batch_tokens = batch_tokens
    inference.open_session = open_session
    writers.shard_file_table = shard_file_table
    writers.write_table_at = write_table_at


_TRACE = os.environ.get("BENCH_TRACE_DIR")
_ARGV = getattr(sys, "orig_argv", sys.argv)[:4]
if _TRACE and ("celery" in _ARGV or "workers.worker" in _ARGV):  # `voxmill extract`'s local workers
    _install(_TRACE)
