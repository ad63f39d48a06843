"""Batched speech tokens in whole corpus runs (issue 33): batching on against off, side by side.

    python -m benchmarks.batching                  # 400 short clips, 200 mixed, 3 repeats
    python -m benchmarks.batching --quick          # 60 and 30 clips, 1 repeat, under work/quick

Full-size stand-ins (the tokenizer and its batch twin), `voxmill extract --ops tokenize`, 2 local
workers (`benchmarks.extract_run.run_extract`), on a short-clip corpus (1-3 s, uniform) and a
mixed one (1-25 s, log-uniform, as `make bench`'s main corpus). Each repeat runs
`VOXMILL_BATCH_TOKENIZE=auto` with `VOXMILL_BATCH_MAX_CLIP_S=3` (the CPU's rule where a user opts
in: clips up to 3 s batched; by default the CPU batches nothing) and `=off` back to back, in
alternating order, and checks that both runs wrote the very same tokens. Throughput is audio seconds per wall
second; the ratio is on / off (targets: >= 1.15 short, >= 0.98 mixed). The trace counts the
rows of every batch the workers ran. Then single-job latency through the producer's `Client`
(`voxmill submit`'s path, a 2 s clip, tokenize) on a cluster with batching on and one with it off:
p50 round trip, target within 10 %. Writes `benchmarks/results/batching.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from benchmarks.common import load_average, log, percentile, results_dir, summary, write_result
from benchmarks.corpus import WORK_DIR, CorpusRecipe, make_corpus, make_models
from benchmarks.extract_run import run_extract, write_manifest

OPS = ["tokenize"]
SHORT = CorpusRecipe("batch-short", 400, 1.0, 3.0, "uniform", seed=3)
MIXED = CorpusRecipe("batch-mixed", 200, 1.0, 25.0, seed=4)
MODES = ("auto", "off")
CPU_MAX_CLIP_S = 3.0  # the rule measured on the CPU, where a user opts in (`batch_max_clip_s`)
TARGETS = {"short": 1.15, "mixed": 0.98}


def tokens_of(out_dir: Path) -> dict[str, list[int]]:
    table = pq.read_table(out_dir / "speech_tokens.parquet", columns=["utt", "speech_token"])
    return dict(zip(table.column("utt").to_pylist(), table.column("speech_token").to_pylist(), strict=True))


def batch_rows(trace_dir: Path) -> Counter[int]:
    """How many batches of each size the workers ran (`benchmarks/trace`'s `batch` records)."""
    sizes: Counter[int] = Counter()
    for file in trace_dir.glob("trace-*.jsonl"):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "batch":
                sizes[int(record["rows"])] += 1
    return sizes


def read_once(paths: list[Path]) -> None:
    """Read files whole, so that neither mode's first run pays for a cold page cache (the first
    run of a repeat would otherwise read the model files and clips from disk for both)."""
    for path in paths:
        with path.open("rb") as file:
            while file.read(1 << 24):
                pass


def compare_corpus(
    name: str, recipe: CorpusRecipe, count: int, models: Path, repeats: int, shard_size: int | None
) -> dict[str, Any]:
    clips = make_corpus(replace(recipe, count=max(recipe.count, count)))[:count]
    manifest = write_manifest(clips, WORK_DIR / "manifests" / f"{recipe.name}-{count}.jsonl")
    read_once([*sorted(p for p in models.rglob("*") if p.is_file()), *(Path(c.path) for c in clips)])
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    sizes: Counter[int] = Counter()
    identical = True
    for repeat in range(repeats):
        tokens: dict[str, dict[str, list[int]]] = {}
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            log(f"batching {name}: repeat {repeat + 1}/{repeats}: batch_tokenize={mode}")
            result = run_extract(
                manifest,
                models,
                OPS,
                workers=2,
                shard_size=shard_size,
                settings={"VOXMILL_BATCH_TOKENIZE": mode, "VOXMILL_BATCH_MAX_CLIP_S": str(CPU_MAX_CLIP_S)},
                keep=True,
            )
            out_dir, trace_dir = Path(result.pop("out_dir")), Path(result.pop("trace_dir"))
            tokens[mode] = tokens_of(out_dir)
            if mode == "auto":
                sizes += batch_rows(trace_dir)
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.rmtree(trace_dir, ignore_errors=True)
            result["audio_s_per_s"] = round(result["audio_s"] / result["wall_s"], 2)
            runs[mode].append(result)
        identical = identical and tokens["auto"] == tokens["off"] and len(tokens["auto"]) == len(clips)
    ratios = [a["audio_s_per_s"] / b["audio_s_per_s"] for a, b in zip(runs["auto"], runs["off"], strict=True)]
    rows = sum(size * n for size, n in sizes.items())
    return {
        "clips": len(clips),
        "audio_s": runs["auto"][0]["audio_s"],
        "durations_s": [recipe.min_s, recipe.max_s, recipe.distribution],
        "on_audio_s_per_s": summary([r["audio_s_per_s"] for r in runs["auto"]], 2),
        "off_audio_s_per_s": summary([r["audio_s_per_s"] for r in runs["off"]], 2),
        "ratio_on_to_off": summary(ratios, 3),
        "target": TARGETS[name],
        "met": statistics.median(ratios) >= TARGETS[name],
        "tokens_identical": identical,
        "batch_sizes": {str(size): n for size, n in sorted(sizes.items())},
        "mean_batch_rows": round(rows / sum(sizes.values()), 2) if sizes else 0.0,
        "runs": runs,
    }


def single_job_latency(models: Path, jobs: int) -> dict[str, Any]:
    """p50 round trip of one tokenize job at a time through `Client`, batching on and off."""
    from pipeline.demo import speechlike
    from pipeline.settings import Settings
    from workers.embedded import EmbeddedRedis, LocalWorkers
    from workers.queue.client import Client

    clip = WORK_DIR / "batching" / "single-2s.wav"
    if not clip.exists():
        import soundfile as sf

        clip.parent.mkdir(parents=True, exist_ok=True)
        sf.write(clip, speechlike(2.0, 16000, 165.0, 7), 16000)
    embedded = EmbeddedRedis().start()
    found: dict[str, Any] = {}
    try:
        for mode in MODES:
            settings = Settings.load(environ={}).model_copy(
                update={
                    "broker_url": embedded.url,
                    "model_dir": models,
                    "provider": "cpu",
                    "speech_check": False,
                    "allowed_roots": (clip.parent.resolve(),),
                    "batch_tokenize": mode,
                    "batch_max_clip_s": CPU_MAX_CLIP_S,
                }
            )
            cluster = LocalWorkers(settings, 2, queues=OPS).start()
            try:
                cluster.wait_ready()
                client = Client(settings)
                seen = []
                for index in range(jobs + 5):
                    started = time.perf_counter()
                    job = client.submit("tokenize", clip.resolve())
                    result = next(iter(client.as_completed([job], timeout_s=60)))
                    if result.error:
                        raise RuntimeError(f"job failed: {result.error}")
                    if index >= 5:  # the first jobs warm connections
                        seen.append((time.perf_counter() - started) * 1000)
                found[mode] = {
                    "p50_ms": round(percentile(seen, 50), 2),
                    "p90_ms": round(percentile(seen, 90), 2),
                }
                log(f"single jobs, batch_tokenize={mode}: p50 {found[mode]['p50_ms']} ms")
            finally:
                cluster.stop(timeout_s=5.0)
    finally:
        embedded.stop()
    found["ratio_on_to_off_p50"] = round(found["auto"]["p50_ms"] / found["off"]["p50_ms"], 3)
    found["met"] = found["ratio_on_to_off_p50"] <= 1.10
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=SHORT.count, help="clips of the short corpus")
    parser.add_argument("--mixed", type=int, default=MIXED.count, help="clips of the mixed corpus")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=60, help="single jobs per cluster")
    parser.add_argument("--shard-size", type=int, help="utterances per shard (default: the planner's)")
    parser.add_argument("--models", default="full", choices=("tiny", "full"), help="stand-in profile")
    parser.add_argument("--out", type=Path, help="the result file (default results/batching.json)")
    parser.add_argument("--quick", action="store_true", help="60 and 30 clips, 1 repeat, 20 jobs")
    args = parser.parse_args()
    if args.quick:
        args.short, args.mixed, args.repeats, args.jobs = 60, 30, 1, 20
    models = make_models(args.models)
    load_before = load_average()
    data: dict[str, Any] = {
        "ops": OPS,
        "workers": 2,
        "models": args.models,
        "short": compare_corpus("short", SHORT, args.short, models, args.repeats, args.shard_size),
        "mixed": compare_corpus("mixed", MIXED, args.mixed, models, args.repeats, args.shard_size),
        "single_jobs": single_job_latency(models, args.jobs),
        "load_average": {"before": load_before, "after": load_average()},
    }
    for name in ("short", "mixed"):
        part = data[name]
        log(
            f"{name}: on/off {part['ratio_on_to_off']['median']} (target {part['target']}), tokens "
            f"identical {part['tokens_identical']}, batch sizes {part['batch_sizes']}"
        )
    folder, name = (args.out.parent, args.out.stem) if args.out else (results_dir(args.quick), "batching")
    folder.mkdir(parents=True, exist_ok=True)
    print(write_result(folder, name, data), file=sys.stderr)


if __name__ == "__main__":
    main()
