"""The raw-inference limit: `session.run` on precomputed features only, P processes x T threads.

Each process loads and warms up the model exactly as a worker does (`open_session`), decodes its
share of the corpus and computes the features (untimed), waits at a barrier, then runs the model
over its share. The limit is the wall time from the barrier to the last process done. Shares are
balanced by feature frames (longest first into the least loaded process), so the limit is what P
processes could do with perfect scheduling and no other work at all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.corpus import Clip

ROLE_OF_OP = {"tokenize": "tokenizer", "embed": "embedder"}


def balance(weights: Sequence[float], bins: int) -> list[list[int]]:
    """Indexes of `weights` split into `bins` groups of near-equal sums (longest first, greedy)."""
    groups: list[list[int]] = [[] for _ in range(bins)]
    loads = [0.0] * bins
    for index in sorted(range(len(weights)), key=lambda i: -weights[i]):
        target = loads.index(min(loads))
        groups[target].append(index)
        loads[target] += weights[index]
    return groups


def model_inputs(op: str, wave: Any) -> list[list[Any]]:
    """The session inputs of one clip for `op`, exactly as `pipeline.inference` builds them (one
    list per 30 s window for the tokenizer)."""
    import numpy as np

    from pipeline.features import whisper_log_mel
    from pipeline.inference import WINDOW_FRAMES, embedder_inputs, tokenizer_inputs, window_starts

    if op == "embed":
        return [embedder_inputs(wave)]
    log_mel = np.ascontiguousarray(whisper_log_mel(wave, n_mels=128))
    return [
        tokenizer_inputs(np.ascontiguousarray(log_mel[:, start : start + WINDOW_FRAMES]))
        for start in window_starts(log_mel.shape[1])
    ]


def _worker(
    model_dir: str, op: str, paths: list[str], threads: int, barrier: Any, results: Any
) -> None:  # pragma: no cover - runs in a child process
    from pipeline.audio.decode import load_audio
    from pipeline.inference import open_session
    from pipeline.models.options import SessionOptions
    from pipeline.models.registry import Registry
    from pipeline.settings import AudioLimits

    registry = Registry.load()
    role = ROLE_OF_OP[op]
    options = SessionOptions(provider="cpu", intra_op_threads=threads)
    session = open_session(registry.find_model(role, Path(model_dir)), role, options, registry)
    limits = AudioLimits()
    work = [model_inputs(op, load_audio(path, limits).samples) for path in paths]
    barrier.wait()
    started = time.monotonic()
    cpu_started = time.process_time()
    per_clip = []
    for windows in work:
        clip_started = time.perf_counter()
        for inputs in windows:
            session.run(inputs)
        per_clip.append(time.perf_counter() - clip_started)
    ended = time.monotonic()
    cpu_s = time.process_time() - cpu_started
    results.put(
        {
            "pid": os.getpid(),
            "start": started,
            "end": ended,
            "cpu_s": cpu_s,
            "paths": paths,
            "per_clip_s": per_clip,
        }
    )


def measure_limit(
    clips: Sequence[Clip], model_dir: Path, op: str, processes: int, threads: int = 1, timeout_s: float = 1800
) -> dict[str, Any]:
    """Run the model of `op` over `clips` in `processes` processes; the limit and what made it."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    groups = balance([c.duration_s for c in clips], processes)
    children = [
        ctx.Process(
            target=_worker,
            args=(str(model_dir), op, [clips[i].path for i in group], threads, barrier, results),
        )
        for group in groups
    ]
    for child in children:
        child.start()
    collected = [results.get(timeout=timeout_s) for _ in children]
    for child in children:
        child.join(timeout=60)
        if child.exitcode not in (0, None):
            raise RuntimeError(f"limit worker exited with {child.exitcode}")
    wall_s = max(r["end"] for r in collected) - min(r["start"] for r in collected)
    busy_s = [r["end"] - r["start"] for r in collected]
    per_clip = {path: s for r in collected for path, s in zip(r["paths"], r["per_clip_s"], strict=True)}
    audio_s = sum(c.duration_s for c in clips)
    return {
        "op": op,
        "processes": processes,
        "threads": threads,
        "clips": len(clips),
        "audio_s": round(audio_s, 3),
        "wall_s": round(wall_s, 4),
        "busy_s": [round(b, 4) for b in busy_s],
        "inference_s": round(sum(per_clip.values()), 4),
        "inference_cpu_s": round(sum(r["cpu_s"] for r in collected), 4),
        "rtf_x": round(audio_s / wall_s, 2),
        "per_clip_s": {Path(p).name: round(s, 5) for p, s in per_clip.items()},
    }
