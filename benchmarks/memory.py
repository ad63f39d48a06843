"""Memory and load time of one model in a fresh process, the way voxmill loads it and the ways
`pipeline/models/sessions.py` could load it instead.

    python -m benchmarks.memory --models DIR --role tokenizer --mode voxmill [--clip-s 25]

Modes (all CPU, ORT_ENABLE_ALL, one intra-op thread, no spinning, as `sessions._build_session`):
- `voxmill`: `ModelSession.load` as every worker does it, with the optimized-model cache
  (`pipeline/models/cache.py`) in `benchmarks/work/ort-cache` and its entry for the model already
  there (built first when missing, `cache_build_s`, not counted in `load_s`): the model file is
  hashed as a stream and the session built from the saved optimised graph;
- `voxmill-first`: the same on a machine that has not seen the model yet: the entry is deleted
  first, so the load builds the session from the bytes and writes the entry;
- `no-cache`: `model_cache` off: the bytes are read once, hashed, and the session is built from
  them (ONNX Runtime's copy of the bytes is dropped after, as voxmill does on the CPU);
- `no-prepack`: built from the same bytes with `session.disable_prepacking=1`, no cache.

Prints one JSON line: load time, RSS and peak RSS (VmHWM) after import, load, warm-up and a
`--clip-s` clip, the 10 s clip's latency (median of 5 runs after warm-up) and the outputs' sha256,
so that modes can be checked to give identical outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import MODEL_CACHE_DIR, prime_model_cache

MODES = ("voxmill", "voxmill-first", "no-cache", "no-prepack")
CACHE_DIR = MODEL_CACHE_DIR  # the cache every benchmark child uses


def rss_mb() -> dict[str, float]:
    """VmRSS and VmHWM of this process (MiB)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            values[key] = round(int(value.split()[0]) / 1024, 1)
    return values


def session_options(ort: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def load(mode: str, path: Path, role: str) -> tuple[Any, dict[str, Any]]:
    """(callable running inputs by position, facts) for `mode`."""
    import onnxruntime as ort

    from pipeline.models.cache import cache_key
    from pipeline.models.files import hash_model_file
    from pipeline.models.options import SessionOptions
    from pipeline.models.registry import Registry
    from pipeline.models.sessions import ModelSession

    facts: dict[str, Any] = {}
    if mode == "no-prepack":
        started = time.perf_counter()
        data = path.read_bytes()
        so = session_options(ort)
        so.add_session_config_entry("session.disable_prepacking", "1")
        raw = ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
        raw._model_bytes = None
        del data
        facts["load_s"] = time.perf_counter() - started
        names = [i.name for i in raw.get_inputs()]
        return (lambda inputs: raw.run(None, dict(zip(names, inputs, strict=False)))), facts
    registry = Registry.load()
    options = SessionOptions(provider="cpu", model_cache_dir=None if mode == "no-cache" else CACHE_DIR)
    if mode != "no-cache":
        key = cache_key(hash_model_file(path), ort.__version__)
        if mode == "voxmill-first":
            shutil.rmtree(CACHE_DIR / key, ignore_errors=True)
        elif not (CACHE_DIR / key).exists():  # built in another process, to keep its peak out
            started = time.perf_counter()
            prime_model_cache(path.parent)
            facts["cache_build_s"] = round(time.perf_counter() - started, 4)
    session = ModelSession.load(path, role, options, registry)
    facts["load_s"] = session.load_s
    facts["model_cache"] = session.cache_state
    return session.run, facts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--role", default="tokenizer")
    parser.add_argument("--mode", choices=MODES, default="voxmill")
    parser.add_argument("--clip-s", type=float, default=25.0)
    args = parser.parse_args()

    import numpy as np

    from pipeline.demo import speechlike
    from pipeline.features import whisper_log_mel
    from pipeline.inference import embedder_inputs, tokenizer_inputs, warmup_wave
    from pipeline.models.registry import Registry

    def inputs_of(wave: Any) -> list[Any]:
        return tokenizer_inputs(whisper_log_mel(wave)) if args.role == "tokenizer" else embedder_inputs(wave)

    path = Registry.load().find_model(args.role, args.models)
    memory = {"imported": rss_mb()}
    run, facts = load(args.mode, path, args.role)
    memory["loaded"] = rss_mb()
    warm = inputs_of(warmup_wave())
    first_started = time.perf_counter()
    run(warm)
    facts["first_run_ms"] = round((time.perf_counter() - first_started) * 1000, 2)
    run(warm)
    memory["warmed"] = rss_mb()
    ten = inputs_of(speechlike(10.0, 16000, 150.0, seed=10))
    latencies = []
    outputs = None
    for _ in range(5):
        started = time.perf_counter()
        outputs = run(ten)
        latencies.append((time.perf_counter() - started) * 1000)
    long_outputs = run(inputs_of(speechlike(args.clip_s, 16000, 150.0, seed=25)))
    memory["after_clip"] = rss_mb()
    digest = hashlib.sha256()
    for out in (*(outputs or []), *long_outputs):
        digest.update(np.ascontiguousarray(out).tobytes())
    print(
        json.dumps(
            {
                "mode": args.mode,
                "role": args.role,
                "file_mb": round(os.path.getsize(path) / 1024**2, 1),
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in facts.items()},
                "latency_10s_ms": round(statistics.median(latencies), 2),
                "memory_mb": memory,
                "peak_mb": memory["after_clip"]["VmHWM"],
                "outputs_sha256": digest.hexdigest(),
            }
        )
    )


if __name__ == "__main__":
    main()
