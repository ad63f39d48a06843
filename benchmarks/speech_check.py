"""What the speech check costs: the speech detector per clip against the embed and tokenize per
clip, whole in-process runs over a corpus with the check on and off, and whole `voxmill extract`
runs over the benchmark corpus with the check on and off.

    python -m benchmarks.speech_check [--profile tiny|full] [--clips N] [--repeats R] [--out FILE]
                                      [--extract-ops embed,tokenize] [--extract-repeats R]

The corpus is generated: `pipeline.demo.speechlike` clips, 1-20 s (log-uniform), written as 16 kHz
16-bit WAV files, so a run decodes them as a worker does. Per clip, on the decoded wave: the
detector (`SpeechDetector.detect`), the embedder (`inference.embed`: fbank and model) and the
tokenizer (`inference.tokenize`: log-mel and model), best of `repeats`. Whole runs: `run_clip`
over every file for one op, the check off and on, interleaved, `repeats` times each (the overhead
from the best of each, and from the medians); the check on runs with
`min_speech_ms` 0 so that no clip is refused (speechlike clips are not speech to Silero, and a
refused clip would skip the model and make the check look free). One process, one thread, as
one worker process runs.

The extract runs (`--extract-ops`, none with `--extract-ops ''`): `voxmill extract` over the main
benchmark corpus (`benchmarks.run`'s: 240 clips of 1-25 s in mixed formats and rates), the
profile's stand-ins, one op, 2 local workers, as whole processes timed from outside; the check off
and on (`min_speech_ms` 0 again), interleaved, `--extract-repeats` times each. They say what the
check costs a corpus run: its wall time, and the detector's share of the workers' process-seconds
(the `speech` stage of the worker trace). Results: benchmarks/results/speech-check[-full].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from benchmarks import corpus as benchmark_corpus
from benchmarks.common import load_average, machine_info, prime_model_cache, summary
from benchmarks.extract_run import RUNS_DIR, run_extract, write_manifest
from pipeline.audio.vad import SpeechCheck, shared_detector
from pipeline.demo import speechlike
from pipeline.inference import embed, open_session, run_clip, tokenize
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.standin import make_standins
from pipeline.settings import AudioLimits

RESULTS = Path(__file__).resolve().parent / "results"
RATE = 16000
TARGET_EMBED_OVERHEAD = 0.03  # issue 20: the check under 3 % of an embed run's wall time
EXTRACT_WORKERS = 2


def make_corpus(folder: Path, clips: int, seed: int = 0) -> list[Path]:
    """`clips` speech-like 16 kHz WAVs of 1-20 s (log-uniform lengths), three pitches."""
    rng = np.random.default_rng(seed)
    paths = []
    for index in range(clips):
        seconds = float(np.exp(rng.uniform(np.log(1.0), np.log(20.0))))
        path = folder / f"clip{index:04d}.wav"
        sf.write(path, speechlike(seconds, RATE, (110.0, 165.0, 220.0)[index % 3], seed * 1000 + index), RATE)
        paths.append(path)
    return paths


def per_clip(sessions: dict[str, Any], waves: list[np.ndarray], repeats: int) -> dict[str, Any]:
    """Milliseconds per clip (best of `repeats`) of the detector, the embed and the tokenize."""
    detector = shared_detector(SpeechCheck())
    stages: dict[str, Any] = {
        "speech": lambda w: detector.detect(w, SpeechCheck()),
        "embed": lambda w: embed(sessions["embedder"], w),
        "tokenize": lambda w: tokenize(sessions["tokenizer"], w),
    }
    ms: dict[str, list[float]] = {name: [] for name in stages}
    for wave in waves:
        for name, stage in stages.items():
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                stage(wave)
                best = min(best, (time.perf_counter() - started) * 1000.0)
            ms[name].append(best)
    audio_s = sum(w.shape[0] for w in waves) / RATE
    out: dict[str, Any] = {}
    for name, values in ms.items():
        out[name] = {
            "ms_per_clip_median": round(statistics.median(values), 3),
            "ms_per_audio_s": round(sum(values) / audio_s, 4),
        }
    for op in ("embed", "tokenize"):
        out[f"speech_vs_{op}"] = round(sum(ms["speech"]) / sum(ms[op]), 4)
    return out


def whole_runs(sessions: dict[str, Any], paths: list[Path], repeats: int) -> dict[str, Any]:
    """Wall seconds of `run_clip` over the corpus per op, the check off and on (interleaved)."""
    limits = AudioLimits(max_duration_s=600.0)
    checks = {"off": None, "on": SpeechCheck(min_speech_ms=0.0)}
    out: dict[str, Any] = {}
    for op in ("embed", "tokenize"):
        walls: dict[str, list[float]] = {"off": [], "on": []}
        speech_ms: list[float] = []
        for _ in range(repeats):
            for name, check in checks.items():
                started = time.perf_counter()
                results = [run_clip(p.name, p, op, sessions, limits, check) for p in paths]
                walls[name].append(time.perf_counter() - started)
                assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
                if check is not None:
                    speech_ms += [r.timings_ms.get("speech", 0.0) for r in results]
        out[op] = {
            **on_off(walls),
            "speech_ms_per_utterance_median": round(statistics.median(speech_ms), 3),
        }
    return out


def on_off(walls: dict[str, list[float]]) -> dict[str, Any]:
    """Walls of the check "off" and "on", and the overhead from the best run of each (on two
    shared cores the others' load only ever adds time) and from the medians."""
    off, on = walls["off"], walls["on"]
    return {
        "wall_s_off": summary(off),
        "wall_s_on": summary(on),
        "overhead": round(min(on) / min(off) - 1.0, 4),
        "overhead_of_medians": round(statistics.median(on) / statistics.median(off) - 1.0, 4),
    }


def extract_runs(profile: str, ops: list[str], repeats: int) -> dict[str, Any]:
    """`voxmill extract` over the main benchmark corpus per op, the check off and on (interleaved)."""
    clips = benchmark_corpus.make_corpus(benchmark_corpus.MAIN_CORPUS)
    manifest = write_manifest(clips, RUNS_DIR / "speech-check.jsonl")
    models = prime_model_cache(benchmark_corpus.make_models(profile))
    checks = {
        "off": {"VOXMILL_SPEECH_CHECK": "false"},
        "on": {"VOXMILL_SPEECH_CHECK": "true", "VOXMILL_MIN_SPEECH_MS": "0"},
    }
    out: dict[str, Any] = {
        "corpus": {
            "recipe": benchmark_corpus.MAIN_CORPUS.name,
            "clips": len(clips),
            "audio_s": round(sum(c.duration_s for c in clips), 1),
        },
        "workers": EXTRACT_WORKERS,
        "repeats": repeats,
    }
    for op in ops:
        walls: dict[str, list[float]] = {"off": [], "on": []}
        speech_share: list[float] = []
        for _ in range(repeats):
            for name, settings in checks.items():
                run = run_extract(manifest, models, [op], EXTRACT_WORKERS, settings=settings)
                walls[name].append(run["wall_s"])
                if name == "on":
                    speech_share.append(run["stages"]["share_of_wall"]["speech"])
        out[op] = {**on_off(walls), "speech_share_of_worker_time": summary(speech_share)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--clips", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--extract-ops", default="embed,tokenize", help="ops of the extract runs ('': none)")
    parser.add_argument("--extract-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    extract_ops = [op for op in args.extract_ops.split(",") if op]
    out = args.out or RESULTS / ("speech-check.json" if args.profile == "tiny" else "speech-check-full.json")
    with tempfile.TemporaryDirectory(prefix="voxmill-speech-bench-") as tmp:
        folder = Path(tmp)
        make_standins(folder / "models", profile=args.profile)
        registry = Registry.load()
        sessions = {
            role: open_session(registry.find_model(role, folder / "models"), role, SessionOptions(), registry)
            for role in ("tokenizer", "embedder")
        }
        paths = make_corpus(folder, args.clips)
        waves = [sf.read(p, dtype="float32")[0] for p in paths]
        started = time.perf_counter()
        detector = shared_detector(SpeechCheck())
        result: dict[str, Any] = {
            "machine": machine_info(),
            "profile": args.profile,
            "corpus": {
                "clips": len(paths),
                "audio_s": round(sum(w.shape[0] for w in waves) / RATE, 2),
                "recipe": "pipeline.demo.speechlike, 1-20 s log-uniform, 16 kHz 16-bit WAV, seed 0",
            },
            "detector": {
                "file": detector.path.name,
                "sha256": detector.sha256,
                "load_s": round(time.perf_counter() - started, 4),
            },
            "repeats": args.repeats,
            "load_average_before": load_average(),
            "per_clip": per_clip(sessions, waves, args.repeats),
            "whole_run": whole_runs(sessions, paths, args.repeats),
            "target_embed_overhead": TARGET_EMBED_OVERHEAD,
        }
    if extract_ops:
        result["extract"] = extract_runs(args.profile, extract_ops, args.extract_repeats)
    result["load_average_after"] = load_average()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {k: result.get(k) for k in ("profile", "corpus", "detector", "per_clip", "whole_run", "extract")},
            indent=1,
        )
    )
    print(f"written to {out}")
    return result


if __name__ == "__main__":
    main()
