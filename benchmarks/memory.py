"""Memory and load time of one model in a fresh process, the way voxmill loads it and the ways
`pipeline/sessions.py` could load it instead.

    python -m benchmarks.memory --models DIR --role tokenizer --mode voxmill [--clip-s 25]

Modes (all CPU, ORT_ENABLE_ALL, one intra-op thread, no spinning, as `sessions._build_session`):
- `voxmill`: `ModelSession.load`, exactly what a worker process does (the bytes are read once,
  hashed, and the session is built from them; the warm-up follows, as in `open_session`);
- `released`: the same, then the reference ONNX Runtime's Python wrapper keeps to the model
  bytes (`InferenceSession._model_bytes`, used only to rebuild the session on a provider
  fallback) is dropped;
- `no-prepack`: built from the same bytes with `session.disable_prepacking=1`;
- `cached`: the file is hashed in a stream (no copy in memory) and the session is built from
  an optimized-model cache (`optimized_model_filepath`, initializers in an external file that
  ONNX Runtime maps) keyed by sha256, provider and ONNX Runtime version, with graph optimisation
  off (the cached graph is already optimised). The cache is built first when missing
  (`cache_build_s`, not counted in `load_s`);
- `cached-portable`: the same with the cache optimised only up to ORT_ENABLE_EXTENDED (no
  hardware-specific layouts, so it may be shared between machines) and ORT_ENABLE_ALL at load.

Prints one JSON line: load time, RSS and peak RSS (VmHWM) after import, load, warm-up and a
`--clip-s` clip, the 10 s clip's latency (median of 5 runs after warm-up) and the outputs' sha256,
so that modes can be checked to give identical outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.corpus import WORK_DIR

MODES = ("voxmill", "released", "no-prepack", "cached", "cached-portable")
CACHE_DIR = WORK_DIR / "ort-cache"


def rss_mb() -> dict[str, float]:
    """VmRSS and VmHWM of this process (MiB)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            values[key] = round(int(value.split()[0]) / 1024, 1)
    return values


def stream_sha256(path: Path, chunk_bytes: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def session_options(ort: Any, level: str = "all") -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }.get(level, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def build_cache(ort: Any, data: bytes, target: Path, level: str) -> float:
    """Write the optimized model (+ external initializers) for `data` into `target`; seconds."""
    started = time.perf_counter()
    target.mkdir(parents=True, exist_ok=True)
    so = session_options(ort, level)
    so.optimized_model_filepath = str(target / "model.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
    return time.perf_counter() - started


def load(mode: str, path: Path, role: str) -> tuple[Any, dict[str, Any]]:
    """(callable running inputs by position, facts) for `mode`."""
    import onnxruntime as ort

    from pipeline.registry import Registry
    from pipeline.sessions import ModelSession, SessionOptions

    facts: dict[str, Any] = {}
    started = time.perf_counter()
    if mode in ("voxmill", "released"):
        registry = Registry.load()
        session = ModelSession.load(path, role, SessionOptions(provider="cpu"), registry)
        facts["load_s"] = session.load_s
        if mode == "released":
            session.session._model_bytes = None
        return session.run, facts
    if mode == "no-prepack":
        data = path.read_bytes()
        so = session_options(ort)
        so.add_session_config_entry("session.disable_prepacking", "1")
        raw = ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
        raw._model_bytes = None
        del data
    else:
        sha256 = stream_sha256(path)
        facts["hash_s"] = round(time.perf_counter() - started, 4)
        portable = mode == "cached-portable"
        target = CACHE_DIR / f"{sha256}-cpu-ort{ort.__version__}{'-portable' if portable else ''}"
        if not (target / "model.onnx").exists():
            level = "extended" if portable else "all"
            facts["cache_build_s"] = round(build_cache(ort, path.read_bytes(), target, level), 4)
            started = time.perf_counter() - facts["hash_s"]
        raw = ort.InferenceSession(
            str(target / "model.onnx"),
            sess_options=session_options(ort, "all" if portable else "none"),
            providers=["CPUExecutionProvider"],
        )
    facts["load_s"] = time.perf_counter() - started
    names = [i.name for i in raw.get_inputs()]
    return (lambda inputs: raw.run(None, dict(zip(names, inputs, strict=False)))), facts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--role", default="tokenizer")
    parser.add_argument("--mode", choices=MODES, default="voxmill")
    parser.add_argument("--clip-s", type=float, default=25.0)
    args = parser.parse_args()

    import numpy as np

    from pipeline.demo import speechlike
    from pipeline.extraction import embedder_inputs, tokenizer_inputs, warmup_wave
    from pipeline.features import whisper_log_mel
    from pipeline.registry import Registry

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
