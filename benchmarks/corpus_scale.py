"""A corpus run at scale: does the coordinator's memory and start-up grow with the corpus?

    python -m benchmarks.corpus_scale                 # N = 100k and 1M utterances
    python -m benchmarks.corpus_scale --quick         # N = 100k only
    python -m benchmarks.corpus_scale --sizes 20000   # any sizes

For each N: a Kaldi dir (wav.scp, utt2spk, utt2dur; `--unlisted-durations`: no utt2dur, so
shards of `shard_size` utterances) of N utterances over a few dozen distinct short clips (0.5-2 s,
so disk space is not the limit), the tiny stand-ins, both ops, 2 local workers.
Measured, in one run: `voxmill extract` (`benchmarks.scale_driver`: time to the first shard
submitted, driver peak RSS, merge time and peak RSS, whole run), then the same command again on
the finished folder (a resume), and the plain loop over the same clips in 2 processes side by side
(`benchmarks.plain_loop` over halves of a manifest), as audio seconds per wall second. The slopes
(bytes and microseconds per utterance, between the two sizes) say where 10M would land. Writes
`benchmarks/results/corpus-scale.json` (`--quick`: under benchmarks/work/quick/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from benchmarks.common import (
    child_env,
    log,
    machine_info,
    python_command,
    results_dir,
    timed_child,
    write_result,
)
from benchmarks.corpus import WORK_DIR
from pipeline.demo import speechlike
from pipeline.models.standin import make_standins

SCALE_DIR = WORK_DIR / "scale"
DISTINCT_CLIPS = 48
TARGETS = {  # at 1M utterances (issue 17)
    "first_shard_submitted_s": 10.0,
    "driver_peak_rss_mb": 400.0,
    "merge_peak_rss_mb": 1024.0,
    "resume_s": 15.0,
    "ratio_to_plain_loop": 0.8,
}


def make_clips(folder: Path) -> list[tuple[Path, float]]:
    """A few dozen distinct speech-like 16 kHz WAVs of 0.5-2 s."""
    rng = np.random.default_rng(17)
    clips = []
    for index in range(DISTINCT_CLIPS):
        seconds = float(rng.uniform(0.5, 2.0))
        path = folder / f"clip{index:02d}.wav"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            sf.write(
                path,
                speechlike(seconds, 16000, 100.0 + 10 * (index % 8), seed=index),
                16000,
                subtype="PCM_16",
            )
        clips.append((path, seconds))
    return clips


def make_corpus(n: int, clips: list[tuple[Path, float]], durations: bool) -> tuple[Path, Path, float]:
    """The Kaldi dir of N utterances, with `utt2dur` or without (and a JSONL manifest of them for
    the plain loop); the audio seconds."""
    data = SCALE_DIR / (f"corpus-{n}" if durations else f"corpus-{n}-unlisted")
    manifest = SCALE_DIR / f"corpus-{n}.jsonl"
    audio_s = sum(clips[i % len(clips)][1] for i in range(n))
    if (data / "utt2spk").exists() and (data / "utt2dur").exists() == durations and manifest.exists():
        return data, manifest, audio_s
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    with ExitStack() as files:
        scp, spk, jsonl = (
            files.enter_context(open(p, "w")) for p in (data / "wav.scp", data / "utt2spk", manifest)
        )
        dur = files.enter_context(open(data / "utt2dur", "w")) if durations else None
        for i in range(n):
            path, seconds = clips[i % len(clips)]
            utt = f"u{i:08d}"
            scp.write(f"{utt} {path}\n")
            spk.write(f"{utt} s{i % 500:03d}\n")
            if dur is not None:
                dur.write(f"{utt} {seconds:.4f}\n")
            jsonl.write(json.dumps({"utt": utt, "path": str(path)}) + "\n")
    return data, manifest, audio_s


def run_voxmill(data: Path, out: Path, models: Path, ops: str) -> dict[str, Any]:
    command = python_command("benchmarks.scale_driver", str(data), "--out", str(out), "--models", str(models))
    command += ["--ops", ops, "--workers", "2"]
    child = timed_child(command, child_env(), timeout_s=4 * 3600, sample_memory=False)
    result: dict[str, Any] = json.loads(
        [line for line in child.done.stdout.splitlines() if line.startswith("{")][-1]
    )
    result["process_wall_s"] = round(child.wall_s, 3)
    return result


def run_plain_loop(manifest: Path, models: Path, ops: str, work: Path) -> dict[str, Any]:
    """Two plain-loop processes side by side over the two halves of the manifest."""
    lines = manifest.read_text().splitlines()
    halves = [work / "plain-a.jsonl", work / "plain-b.jsonl"]
    for index, half in enumerate(halves):
        half.write_text("\n".join(lines[index::2]) + "\n")
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            python_command("benchmarks.plain_loop", str(half), "--models", str(models), "--ops", ops),
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in halves
    ]
    outputs = [proc.communicate(timeout=4 * 3600) for proc in procs]
    wall_s = time.perf_counter() - started
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"the plain loop failed: {outputs[0][1][-2000:]}")
    return {"wall_s": round(wall_s, 3)}


def measure(
    n: int, clips: list[tuple[Path, float]], models: Path, ops: str, durations: bool
) -> dict[str, Any]:
    data, manifest, audio_s = make_corpus(n, clips, durations)
    work = SCALE_DIR / f"run-{n}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log(f"{n} utterances: voxmill extract")
    first = run_voxmill(data, work / "out", models, ops)
    shard_size = json.loads((work / "out" / "plan" / "header.json").read_text())["shard_size"]
    log(f"{n} utterances: resume of the finished run")
    resume = run_voxmill(data, work / "out", models, ops)
    log(f"{n} utterances: plain loop, 2 processes")
    plain = run_plain_loop(manifest, models, ops, work)
    voxmill_rate = audio_s / first["process_wall_s"]
    plain_rate = audio_s / plain["wall_s"]
    result = {
        "utterances": n,
        "durations_listed": durations,
        "shard_size": shard_size,
        "audio_s": round(audio_s, 1),
        "first_shard_submitted_s": first.get("first_shard_submitted_s"),
        "driver_peak_rss_mb": first.get("driver_peak_rss_mb"),
        "merge_s": first.get("merge_s"),
        "merge_peak_rss_mb": first.get("merge_peak_rss_mb"),
        "wall_s": first["process_wall_s"],
        "resume_s": resume["process_wall_s"],
        "resume_driver_peak_rss_mb": resume.get("driver_peak_rss_mb"),
        "plain_loop_wall_s": plain["wall_s"],
        "audio_s_per_s": round(voxmill_rate, 2),
        "plain_loop_audio_s_per_s": round(plain_rate, 2),
        "ratio_to_plain_loop": round(voxmill_rate / plain_rate, 3),
        "report": first.get("report"),
    }
    log(json.dumps(result))
    shutil.rmtree(work / "out" / "shards", ignore_errors=True)  # the disk, not the result
    return result


def slopes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per utterance, between the smallest and the largest run: where 10M would land."""
    if len(runs) < 2:
        return {}
    a, b = runs[0], runs[-1]
    dn = b["utterances"] - a["utterances"]
    out: dict[str, Any] = {"between": [a["utterances"], b["utterances"]]}
    for key, unit, scale in (
        ("driver_peak_rss_mb", "bytes_per_utt", 1024 * 1024),
        ("merge_peak_rss_mb", "bytes_per_utt", 1024 * 1024),
        ("merge_s", "us_per_utt", 1e6),
        ("first_shard_submitted_s", "us_per_utt", 1e6),
        ("resume_s", "us_per_utt", 1e6),
        ("wall_s", "us_per_utt", 1e6),
    ):
        if a.get(key) is not None and b.get(key) is not None:
            per = (b[key] - a[key]) * scale / dn
            out[key] = {
                unit: round(per, 3),
                "at_10M": round(b[key] + per * (10_000_000 - b["utterances"]) / scale, 1),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k utterances only")
    parser.add_argument("--sizes", default="", help="comma-separated corpus sizes")
    parser.add_argument("--ops", default="tokenize,embed")
    parser.add_argument(
        "--unlisted-durations", action="store_true", help="no utt2dur: shards of shard_size utterances"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s] or (
        [100_000] if args.quick else [100_000, 1_000_000]
    )
    models = SCALE_DIR / "models"
    if not (models / "campplus.onnx").exists():
        make_standins(models, profile="tiny")
    clips = make_clips(SCALE_DIR / "clips")
    runs = [measure(n, clips, models, args.ops, not args.unlisted_durations) for n in sizes]
    largest = runs[-1]
    verdicts = {
        key: {"target": target, "measured": largest.get(key), "met": _met(key, largest.get(key), target)}
        for key, target in TARGETS.items()
    }
    data = {
        "machine": machine_info(),
        "ops": args.ops,
        "workers": 2,
        "distinct_clips": DISTINCT_CLIPS,
        "runs": runs,
        "slopes": slopes(runs),
        "targets_at": largest["utterances"],
        "targets": verdicts,
    }
    path = write_result(results_dir(args.quick), "corpus-scale", data)
    print(path, file=sys.stderr)


def _met(key: str, value: float | None, target: float) -> bool | None:
    if value is None:
        return None
    return value >= target if key == "ratio_to_plain_loop" else value <= target


if __name__ == "__main__":
    main()
