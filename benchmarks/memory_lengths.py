"""Memory under clips of every length: a process's resident memory over thousands of clips of
random length, and after one 10-minute clip, with voxmill's ONNX Runtime settings and the old ones.

    python -m benchmarks.memory_lengths                      # 20,000 clips (hours on 2 cores)
    python -m benchmarks.memory_lengths --clips 1500 --every 100   # what BENCHMARKS.md reports
    python -m benchmarks.memory_lengths --clips 40 --every 20 --first 20 --long-s 60 --block 10 \\
        --embedder tiny --out /tmp/lengths.json          # a smoke run (tests/unit/test_benchmarks.py)

Two child processes, each what a worker process holds after decoding: the speech detector, the
tokenizer and the embedder (`--tokenizer`/`--embedder` stand-in profiles; the tokenizer is tiny by
default, where time forbids the full one, the embedder full), loaded as workers load them (the
optimized-model cache):

- `before`: the settings voxmill had before issue 35: ONNX Runtime's memory patterns on, the CPU
  arena never shrunk, glibc's dynamic mmap threshold (`ort_mem_pattern: true`,
  `ort_arena_shrink: never`, `malloc_mmap_threshold_kb: 0`);
- `after`: voxmill's defaults (`pipeline/settings.py`).

Clip i is the same in both: a 16 kHz wave of uniformly random length 0.5-30 s (seeded by i); each
goes through the detector, `inference.tokenize` and `inference.embed`, one thread. The parent
drives both children in alternating blocks of `--block` clips (the child going first rotates), so
both share whatever else runs on the machine; throughput is audio seconds per second of clip work
(generating the wave left out), compared block by block. Resident memory (VmRSS) is read every
`--every` clips; right after clip `--first` each child runs one `--long-s` clip (10 minutes).

Reported per child: RSS loaded, at clip `--first` (before the long clip) and at the end; growth
after the first clips (the largest RSS after clip `--first`, the long clip included, against the
RSS at `--first`; target <= 5 %); the long clip's peak (VmHWM) and lasting growth (RSS once it is
done against just before it; target <= 10 %); and the `after` / `before` throughput (target: within
3 %). Results: benchmarks/results/memory-lengths.json (`--out`); BENCHMARKS.md renders them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from benchmarks.common import (
    MODEL_CACHE_DIR,
    ROOT,
    child_env,
    load_average,
    log,
    machine_info,
    prime_model_cache,
    python_command,
    summary,
)
from benchmarks.corpus import make_models
from benchmarks.memory import rss_mb

RESULTS = Path(__file__).resolve().parent / "results"
RATE = 16000
MIN_S, MAX_S = 0.5, 30.0
SETTINGS = {
    "before": {"ort_mem_pattern": True, "ort_arena_shrink": "never", "malloc_mmap_threshold_kb": 0},
    "after": {},  # voxmill's defaults
}
TARGETS = {"growth_after_first": 0.05, "long_clip_lasting_growth": 0.10, "throughput_cost": 0.03}


def clip_seconds(index: int, seed: int) -> float:
    return float(np.random.default_rng([seed, index]).uniform(MIN_S, MAX_S))


def clip_wave(seconds: float, index: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, index, 1])
    return (rng.standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


# --------------------------------------------------------------------------- child


def child(name: str, tokenizer_dir: Path, embedder_dir: Path, seed: int) -> None:
    """Load the models with `name`'s settings, then answer the parent's requests (JSON lines)."""
    from pipeline.allocator import fix_mmap_threshold
    from pipeline.audio.vad import DETECTOR_FILE, SpeechCheck, SpeechDetector
    from pipeline.inference import embed, open_session, tokenize
    from pipeline.models.options import SessionOptions
    from pipeline.models.registry import Registry
    from pipeline.models.sessions import helper_session
    from pipeline.settings import Settings

    settings = Settings(provider="cpu", model_cache_dir=MODEL_CACHE_DIR, **SETTINGS[name])  # type: ignore[arg-type]
    fix_mmap_threshold(settings.malloc_mmap_threshold_kb)  # as a worker process does
    options = SessionOptions.from_settings(settings)
    registry = Registry.load()
    tokenizer = open_session(registry.find_model("tokenizer", tokenizer_dir), "tokenizer", options, registry)
    embedder = open_session(registry.find_model("embedder", embedder_dir), "embedder", options, registry)
    session, sha256 = helper_session(DETECTOR_FILE, options)  # as `shared_detector`, with these options
    detector = SpeechDetector(session, DETECTOR_FILE, sha256, 0.0)
    check = SpeechCheck(min_speech_ms=0.0)

    def work(wave: np.ndarray) -> float:
        started = time.perf_counter()
        detector.detect(wave, check)
        tokenize(tokenizer, wave)
        embed(embedder, wave)
        return time.perf_counter() - started

    reply({"ready": True, **rss_mb()})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "clips":
            seconds = audio_s = 0.0
            for index in range(request["start"], request["start"] + request["count"]):
                length = clip_seconds(index, seed)
                seconds += work(clip_wave(length, index, seed))
                audio_s += length
            reply({"seconds": seconds, "audio_s": audio_s, **rss_mb()})
        elif request["op"] == "long":
            before = rss_mb()
            seconds = work(clip_wave(request["seconds"], 2**31, seed))  # an index no clip has
            reply({"seconds": seconds, "before": before, "after": rss_mb()})
        else:
            return


def reply(data: dict[str, Any]) -> None:
    print(json.dumps(data), flush=True)


# --------------------------------------------------------------------------- parent


@dataclass
class Child:
    """One child process and what it reported."""

    name: str
    process: subprocess.Popen[str]
    loaded: dict[str, float] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    block_seconds: list[float] = field(default_factory=list)
    block_audio_s: list[float] = field(default_factory=list)
    long_clip: dict[str, Any] = field(default_factory=dict)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin: TextIO | None = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        return self.read()

    def quit(self) -> None:
        stdin = self.process.stdin
        if stdin is not None:
            stdin.write(json.dumps({"op": "quit"}) + "\n")
            stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def read(self) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith("{"):
                data: dict[str, Any] = json.loads(line)
                return data
        raise RuntimeError(f"child {self.name} exited {self.process.wait()}")


def start_child(name: str, tokenizer_dir: Path, embedder_dir: Path, seed: int) -> Child:
    command = python_command(
        "benchmarks.memory_lengths", "--child", name, "--tokenizer-dir", str(tokenizer_dir),
        "--embedder-dir", str(embedder_dir), "--seed", str(seed),
    )  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    started = Child(name, process)
    started.loaded = started.read()
    started.timeline.append({"clips": 0, "rss_mb": started.loaded["VmRSS"], "load": load_average()[0]})
    return started


def run(
    clips: int,
    every: int,
    first: int,
    long_s: float,
    block: int,
    tokenizer: str,
    embedder: str,
    seed: int = 0,
) -> dict[str, Any]:
    """Both children over the same clips; the dict written to memory-lengths.json."""
    if every % block or first % block or first > clips:
        raise ValueError("--every and --first must be multiples of --block, and --first at most --clips")
    tokenizer_dir = prime_model_cache(make_models(tokenizer))
    embedder_dir = prime_model_cache(make_models(embedder))
    started = time.time()
    load_before = load_average()
    children = [start_child(name, tokenizer_dir, embedder_dir, seed) for name in SETTINGS]
    try:
        for number, start in enumerate(range(0, clips, block)):
            count = min(block, clips - start)
            for kid in children[number % 2 :] + children[: number % 2]:
                answer = kid.ask({"op": "clips", "start": start, "count": count})
                kid.block_seconds.append(answer["seconds"])
                kid.block_audio_s.append(answer["audio_s"])
                done = start + count
                if done % every == 0 or done == clips:
                    kid.timeline.append({"clips": done, "rss_mb": answer["VmRSS"], "load": load_average()[0]})
                if done == first:
                    kid.long_clip = kid.ask({"op": "long", "seconds": long_s})
            if (start + count) % every == 0:
                log(f"memory lengths: {start + count}/{clips} clips; " + ", ".join(
                    f"{kid.name} {kid.timeline[-1]['rss_mb']} MB" for kid in children
                ))  # fmt: skip
    finally:
        for kid in children:
            if kid.process.poll() is None:
                kid.quit()
    before, after = children
    ratios = [a / b for a, b in zip(after.block_seconds, before.block_seconds, strict=True)]
    per_child = {kid.name: summarize(kid, first) for kid in children}
    cost = sum(after.block_seconds) / sum(before.block_seconds) - 1.0
    return {
        "machine": machine_info(),
        "clips": clips,
        "every": every,
        "first": first,
        "long_s": long_s,
        "block": block,
        "seed": seed,
        "models": {"tokenizer": tokenizer, "embedder": embedder},
        "lengths_s": [MIN_S, MAX_S],
        "audio_s": round(sum(before.block_audio_s), 1),
        "settings": {name: SETTINGS[name] or "defaults" for name in SETTINGS},
        "children": per_child,
        "throughput_cost": round(cost, 4),
        "block_time_ratio": summary(ratios),
        "targets": TARGETS,
        "bench": {
            "seconds": round(time.time() - started, 1),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
    }


def summarize(kid: Child, first: int) -> dict[str, Any]:
    timeline = kid.timeline
    at_first = next(point["rss_mb"] for point in timeline if point["clips"] == first)
    later = [point["rss_mb"] for point in timeline if point["clips"] > first]
    long_clip = kid.long_clip
    rss_before_long = long_clip["before"]["VmRSS"]
    rss_after_long = long_clip["after"]["VmRSS"]
    highest_after_first = max([*later, rss_after_long])
    return {
        "rss_loaded_mb": kid.loaded["VmRSS"],
        "rss_at_first_mb": at_first,
        "rss_end_mb": timeline[-1]["rss_mb"],
        "growth_after_first": round(highest_after_first / at_first - 1.0, 4),
        "growth_first_to_end": round(timeline[-1]["rss_mb"] / at_first - 1.0, 4),
        "long_clip_peak_mb": long_clip["after"]["VmHWM"],
        "long_clip_rss_before_mb": rss_before_long,
        "long_clip_rss_after_mb": rss_after_long,
        "long_clip_lasting_growth": round(rss_after_long / rss_before_long - 1.0, 4),
        "long_clip_s": round(long_clip["seconds"], 3),
        "audio_s_per_s": round(sum(kid.block_audio_s) / sum(kid.block_seconds), 2),
        "work_s": round(sum(kid.block_seconds), 2),
        "timeline": timeline,
        "median_block_s": round(statistics.median(kid.block_seconds), 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=1000, help="clips between RSS readings")
    parser.add_argument("--first", type=int, default=1000, help="growth is measured after this clip")
    parser.add_argument("--long-s", type=float, default=600.0, help="the long clip, run after --first")
    parser.add_argument("--block", type=int, default=100, help="clips per turn of each child")
    parser.add_argument("--tokenizer", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--embedder", choices=("tiny", "full"), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "memory-lengths.json")
    parser.add_argument("--child", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--embedder-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.tokenizer_dir, args.embedder_dir, args.seed)
        return None
    result = run(
        args.clips, args.every, args.first, args.long_s, args.block, args.tokenizer, args.embedder, args.seed
    )
    given = sys.argv[1:] if argv is None else argv
    result["command"] = " ".join(["python -m benchmarks.memory_lengths", *given])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    children = result["children"].items()
    shown = {name: {k: v for k, v in kid.items() if k != "timeline"} for name, kid in children}
    print(json.dumps({"children": shown, "throughput_cost": result["throughput_cost"]}, indent=1))
    print(f"written to {args.out}")
    return result


if __name__ == "__main__":
    main()
