"""`make bench`: every measurement of the performance issue in one run, then `BENCHMARKS.md`.

    python -m benchmarks.run                 # full stand-ins, ~240 clips, 3 repeats (about 35 min on 2 cores)
    python -m benchmarks.run --quick         # tiny stand-ins, a few clips, 1 repeat (< 1 min)
    python -m benchmarks.run --only main,queue --repeats 5
    python -m benchmarks.run --report-only   # rebuild BENCHMARKS.md from the result files

Sections (each writes `benchmarks/results/<section>.json`, machine and versions included):

- `main` (issue 7, items 1-4, 7): per op, the raw-inference limit, `voxmill extract` as a whole
  process and the plain loop, interleaved repeat by repeat (the order rotates), ratios per repeat;
  the stage breakdown and the workers' peak RSS from the traced `voxmill extract` runs.
- `scaling` (item 6): 1 vs 2 worker processes and 2x1 vs 1x2 threads, end to end and for the
  model alone, on a subset of the corpus.
- `coldstart` (item 5): per model, spawn -> loaded -> warmed and the first inference after warm-up
  of a 10 s clip; a real worker's time to its first task with both full models.
- `memory` (item 7): a fresh process holding the full tokenizer running a 25 s clip, and the ways
  `pipeline/models/sessions.py` could load it (`benchmarks/memory.py`), interleaved.
- `queue` (issue 3): per-task queue overhead and tasks/s (`benchmarks/queue_overhead.py`).
- `throughput` (issue 4): 200 clips of 1-20 s, both ops, 2 workers vs `Extractor` in a loop.
- `core` (issue 2): parity errors, load times of the tiny and full stand-ins, first inference.

`--quick` writes to `benchmarks/work/quick/` and never touches `benchmarks/results/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    QUICK_DIR,
    child_env,
    load_average,
    log,
    prime_model_cache,
    python_command,
    results_dir,
    run_json_child,
    summary,
    timed_child,
    write_result,
)
from benchmarks.corpus import (
    MAIN_CORPUS,
    WORK_DIR,
    Clip,
    CorpusRecipe,
    format_counts,
    make_corpus,
    make_models,
    subset,
)
from benchmarks.extract_run import run_extract, write_manifest
from benchmarks.limit import measure_limit

SECTIONS = ("core", "main", "scaling", "coldstart", "memory", "queue", "throughput")
OPS = ("tokenize", "embed")


@dataclass(frozen=True)
class Config:
    """What one benchmark run measures, and how big."""

    quick: bool
    repeats: int
    workers: int
    profile: str
    main: CorpusRecipe
    issue4: CorpusRecipe
    scaling_clips: int
    queue_tasks: int

    @classmethod
    def make(cls, quick: bool, repeats: int | None) -> Config:
        workers = os.cpu_count() or 2
        if quick:
            return cls(
                quick=True,
                repeats=repeats or 1,
                workers=2,
                profile="tiny",
                main=CorpusRecipe("quick", 6, 1.0, 4.0),
                issue4=CorpusRecipe("quick", 6, 1.0, 4.0),
                scaling_clips=4,
                queue_tasks=30,
            )
        return cls(
            quick=False,
            repeats=repeats or 3,
            workers=workers,
            profile="full",
            main=MAIN_CORPUS,
            issue4=CorpusRecipe("issue4", 200, 1.0, 20.0, "uniform", seed=4),
            scaling_clips=60,
            queue_tasks=1000,
        )


def rotate(items: Sequence[str], by: int) -> list[str]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def corpus_info(clips: Sequence[Clip], recipe: CorpusRecipe) -> dict[str, Any]:
    durations = [c.duration_s for c in clips]
    return {
        "recipe": asdict(recipe),
        "clips": len(clips),
        "audio_s": round(sum(durations), 2),
        "duration_s": {"min": min(durations), "median": statistics.median(durations), "max": max(durations)},
        "formats": format_counts(clips),
    }


def plain_loop(manifest: Path, models: Path, ops: Sequence[str]) -> dict[str, Any]:
    """The plain loop as a whole process, timed from outside."""
    command = python_command(
        "benchmarks.plain_loop", str(manifest), "--models", str(models), "--ops", ",".join(ops)
    )
    child = timed_child(command, child_env(), timeout_s=7200)
    inner = [line for line in child.done.stdout.splitlines() if line.startswith("{")]
    result: dict[str, Any] = json.loads(inner[-1])
    result["wall_s"] = round(child.wall_s, 4)
    result["cpu_s"] = round(child.cpu_s, 3)
    result["rtf_x"] = round(result["audio_s"] / child.wall_s, 2)
    sampler = child.sampler
    result["peak_mb"] = max(sampler.peaks_mb.values()) if sampler and sampler.peaks_mb else None
    return result


# --------------------------------------------------------------------------- main (issue 7)


def section_main(cfg: Config) -> dict[str, Any]:
    models = prime_model_cache(make_models(cfg.profile))
    clips = make_corpus(cfg.main)
    manifest = write_manifest(clips, WORK_DIR / "manifests" / f"{cfg.main.name}.jsonl")
    per_op: dict[str, Any] = {}
    for op in OPS:
        runs: dict[str, list[dict[str, Any]]] = {"limit": [], "voxmill": [], "plain": []}
        for repeat in range(cfg.repeats):
            for kind in rotate(("limit", "voxmill", "plain"), repeat):
                log(f"main {op}: repeat {repeat + 1}/{cfg.repeats}: {kind}")
                if kind == "limit":
                    runs["limit"].append(measure_limit(clips, models, op, cfg.workers))
                elif kind == "voxmill":
                    runs["voxmill"].append(run_extract(manifest, models, [op], cfg.workers))
                else:
                    runs["plain"].append(plain_loop(manifest, models, [op]))
        per_op[op] = summarize_main(runs)
    return {
        "corpus": corpus_info(clips, cfg.main),
        "models": cfg.profile,
        "workers": cfg.workers,
        "repeats": cfg.repeats,
        "ops": per_op,
        "targets": {
            "tokenize_to_limit": 0.93,
            "embed_to_limit": 0.85,
            "speedup_vs_plain": 1.8,
            "non_inference_share": 0.10,
        },
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (the one whose details are shown)."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return ordered[(len(ordered) - 1) // 2]


def summarize_main(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    limit, voxmill, plain = runs["limit"], runs["voxmill"], runs["plain"]
    to_limit = [lim["wall_s"] / vox["wall_s"] for lim, vox in zip(limit, voxmill, strict=True)]
    speedup = [pl["wall_s"] / vox["wall_s"] for pl, vox in zip(plain, voxmill, strict=True)]
    steady = []
    for lim, vox in zip(limit, voxmill, strict=True):
        process_s = vox["stages"]["process_s"]
        in_tasks = sum(process_s[k] for k in vox["stages"]["share_per_utterance"])
        steady.append(lim["inference_s"] / in_tasks if in_tasks else float("nan"))
    cpu_to_limit = [lim["inference_cpu_s"] / vox["cpu_s"] for lim, vox in zip(limit, voxmill, strict=True)]
    shown = median_run(voxmill)
    for run in limit:
        run.pop("per_clip_s", None)
    return {
        "limit_cpu_s": summary([r["inference_cpu_s"] for r in limit]),
        "voxmill_cpu_s": summary([r["cpu_s"] for r in voxmill]),
        "plain_cpu_s": summary([r["cpu_s"] for r in plain]),
        "cpu_ratio_to_limit": summary(cpu_to_limit),
        "limit_wall_s": summary([r["wall_s"] for r in limit]),
        "voxmill_wall_s": summary([r["wall_s"] for r in voxmill]),
        "plain_wall_s": summary([r["wall_s"] for r in plain]),
        "ratio_to_limit": summary(to_limit),
        "speedup_vs_plain": summary(speedup),
        "steady_ratio_to_limit": summary(steady),
        "stages": shown["stages"],
        "worker_peak_mb": summary([max(r["memory_mb"].get("worker", [0.0])) for r in voxmill], 1),
        "runs": runs,
    }


# --------------------------------------------------------------------------- scaling (item 6)


def section_scaling(cfg: Config) -> dict[str, Any]:
    """1 vs 2 processes and 2x1 vs 1x2 threads, end to end and for the model alone. The end-to-end
    runs use the automatic shard size (about six shards per worker process); `2x1/s8` is 2
    processes with a fixed `--shard-size` of an eighth of the clips, for comparison."""
    models = prime_model_cache(make_models(cfg.profile))
    clips = subset(make_corpus(cfg.main), cfg.scaling_clips)
    manifest = write_manifest(clips, WORK_DIR / "manifests" / f"{cfg.main.name}-scaling.jsonl")
    small_shards = max(1, cfg.scaling_clips // 8)
    configs: dict[str, tuple[int, int, int | None]] = {
        "1x1": (1, 1, None),
        "2x1": (2, 1, None),
        "1x2": (1, 2, None),
        "2x1/s8": (2, 1, small_shards),
    }
    e2e: dict[str, list[float]] = {name: [] for name in configs}
    model: dict[str, dict[str, list[float]]] = {
        op: {name: [] for name in configs if "/" not in name} for op in OPS
    }
    for repeat in range(cfg.repeats):
        for name in rotate(list(configs), repeat):
            processes, threads, shard_size = configs[name]
            log(f"scaling: repeat {repeat + 1}/{cfg.repeats}: {name} end to end")
            run = run_extract(manifest, models, list(OPS), processes, threads=threads, shard_size=shard_size)
            e2e[name].append(run["wall_s"])
            if "/" in name:
                continue
            for op in OPS:
                log(f"scaling: repeat {repeat + 1}/{cfg.repeats}: {name} {op} model only")
                model[op][name].append(measure_limit(clips, models, op, processes, threads)["wall_s"])

    def ratio(walls: dict[str, list[float]], a: str, b: str) -> dict[str, Any]:
        return summary([x / y for x, y in zip(walls[a], walls[b], strict=True)])

    def ratios(walls: dict[str, list[float]]) -> dict[str, Any]:
        out = {
            "wall_s": {name: summary(values) for name, values in walls.items()},
            "speedup_2_vs_1_process": ratio(walls, "1x1", "2x1"),
            "processes_vs_threads": ratio(walls, "1x2", "2x1"),
            "threads_speedup_1x2_vs_1x1": ratio(walls, "1x1", "1x2"),
        }
        if "2x1/s8" in walls:
            out["speedup_2_vs_1_process_small_shards"] = ratio(walls, "1x1", "2x1/s8")
        return out

    return {
        "corpus": corpus_info(clips, cfg.main),
        "models": cfg.profile,
        "repeats": cfg.repeats,
        "small_shard_size": small_shards,
        "end_to_end": ratios(e2e),
        "model_only": {op: ratios(model[op]) for op in OPS},
        "target_speedup": 1.8,
    }


# --------------------------------------------------------------------------- cold start (item 5)


def section_coldstart(cfg: Config) -> dict[str, Any]:
    from benchmarks.coldstart import measure_timeline, measure_worker_ready
    from benchmarks.queue_overhead import make_clip

    models = make_models(cfg.profile)
    clip = make_clip(WORK_DIR / "queue")
    # The optimized-model cache as workers keep it; emptied first, so the first load of each
    # model is the one a machine that never saw it pays (it writes the entry the others read).
    cache = WORK_DIR / "coldstart-ort-cache"
    shutil.rmtree(cache, ignore_errors=True)
    timelines: dict[str, list[dict[str, Any]]] = {"tokenizer": [], "embedder": []}
    first = {}
    for role in timelines:
        log(f"cold start: {role} first load (builds the optimized-model cache entry)")
        first[role] = measure_timeline(models, role, cache_dir=cache)
    ready: list[dict[str, Any]] = []
    uncached: list[dict[str, Any]] = []
    for repeat in range(cfg.repeats):
        for role in timelines:
            log(f"cold start: repeat {repeat + 1}/{cfg.repeats}: {role} timeline")
            timelines[role].append(measure_timeline(models, role, cache_dir=cache))
        log(f"cold start: repeat {repeat + 1}/{cfg.repeats}: worker ready")
        ready.append(measure_worker_ready(models, clip, cache))
        log(f"cold start: repeat {repeat + 1}/{cfg.repeats}: worker ready, model_cache off")
        uncached.append(measure_worker_ready(models, clip, None))
    per_model = {role: summarize_timelines(runs) for role, runs in timelines.items()}
    for role, run in first.items():
        per_model[role]["first_load_s"] = run["load_s"]
        per_model[role]["first_load_cache"] = run["model_cache"]
    return {
        "models": cfg.profile,
        "repeats": cfg.repeats,
        "per_model": per_model,
        "worker": {
            "ready_for_first_task_s": summary([r["ready_for_first_task_s"] for r in ready], 3),
            "heartbeat_ready_s": summary(
                [r["heartbeat_ready_s"] for r in ready if r["heartbeat_ready_s"]], 3
            ),
            "runs": ready,
        },
        "worker_no_cache": {
            "ready_for_first_task_s": summary([r["ready_for_first_task_s"] for r in uncached], 3),
            "runs": uncached,
        },
        "targets": {"load_s": 5.0, "first_inference_ms": 100.0, "worker_ready_s": 3.0},
    }


def summarize_timelines(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "load_s",
        "warmup_s",
        "first_inference_ms",
        "first_inference_model_ms",
        "features_ms",
        "steady_inference_ms",
    )
    out: dict[str, Any] = {key: summary([r[key] for r in runs]) for key in keys}
    for mark in runs[0]["marks_s"]:
        out[f"spawn_to_{mark}_s"] = summary([r["marks_s"][mark] for r in runs])
    out["runs"] = runs
    return out


# --------------------------------------------------------------------------- memory (item 7)


def section_memory(cfg: Config) -> dict[str, Any]:
    from benchmarks.memory import MODES

    models = make_models(cfg.profile)
    modes = ("voxmill",) if cfg.quick else MODES
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    embedder: list[dict[str, Any]] = []
    for repeat in range(cfg.repeats):
        for mode in rotate(list(modes), repeat):
            log(f"memory: repeat {repeat + 1}/{cfg.repeats}: tokenizer {mode}")
            command = python_command(
                "benchmarks.memory", "--models", str(models), "--mode", mode, "--clip-s", "25"
            )
            runs[mode].append(run_json_child(command, child_env(), timeout_s=600))
        command = python_command(
            "benchmarks.memory", "--models", str(models), "--role", "embedder", "--clip-s", "25"
        )
        embedder.append(run_json_child(command, child_env(), timeout_s=600))
    return {
        "models": cfg.profile,
        "repeats": cfg.repeats,
        "tokenizer": {mode: summarize_memory(values) for mode, values in runs.items()},
        "embedder": summarize_memory(embedder),
        "target_worker_mb": 1024,
    }


def summarize_memory(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    return {
        "file_mb": first["file_mb"],
        "load_s": summary([r["load_s"] for r in runs]),
        "first_run_ms": summary([r["first_run_ms"] for r in runs]),
        "latency_10s_ms": summary([r["latency_10s_ms"] for r in runs]),
        "rss_loaded_mb": summary([r["memory_mb"]["loaded"]["VmRSS"] for r in runs], 1),
        "rss_after_clip_mb": summary([r["memory_mb"]["after_clip"]["VmRSS"] for r in runs], 1),
        "peak_mb": summary([r["peak_mb"] for r in runs], 1),
        "outputs_sha256": sorted({r["outputs_sha256"] for r in runs}),
        "cache_build_s": next((r["cache_build_s"] for r in runs if "cache_build_s" in r), None),
        "runs": runs,
    }


# --------------------------------------------------------------------------- issue 3, issue 4, issue 2


def section_queue(cfg: Config) -> dict[str, Any]:
    from benchmarks.queue_overhead import measure_queue

    return measure_queue(cfg.queue_tasks, cfg.repeats, cfg.quick)


def section_throughput(cfg: Config) -> dict[str, Any]:
    models = prime_model_cache(make_models(cfg.profile))
    clips = make_corpus(cfg.issue4)
    manifest = write_manifest(clips, WORK_DIR / "manifests" / f"{cfg.issue4.name}.jsonl")
    runs: dict[str, list[dict[str, Any]]] = {"voxmill": [], "plain": []}
    for repeat in range(cfg.repeats):
        for kind in rotate(list(runs), repeat):
            log(f"throughput: repeat {repeat + 1}/{cfg.repeats}: {kind}")
            if kind == "plain":
                runs[kind].append(plain_loop(manifest, models, list(OPS)))
            else:
                runs[kind].append(run_extract(manifest, models, list(OPS), 2))
    audio_s = sum(c.duration_s for c in clips)
    voxmill, plain = runs["voxmill"], runs["plain"]
    return {
        "corpus": corpus_info(clips, cfg.issue4),
        "models": cfg.profile,
        "ops": list(OPS),
        "workers": 2,
        "repeats": cfg.repeats,
        "voxmill_audio_s_per_s": summary([audio_s / r["wall_s"] for r in voxmill], 2),
        "plain_audio_s_per_s": summary([audio_s / r["wall_s"] for r in plain], 2),
        "plain_loop_only_audio_s_per_s": summary([audio_s / r["loop_s"] for r in plain], 2),
        "speedup": summary([p["wall_s"] / v["wall_s"] for p, v in zip(plain, voxmill, strict=True)]),
        "stages": median_run(voxmill)["stages"],
        "runs": runs,
    }


def section_core(cfg: Config) -> dict[str, Any]:
    from benchmarks.coldstart import measure_timeline
    from benchmarks.parity import measure_parity

    log("core: parity")
    paths = [c.path for c in subset(make_corpus(cfg.main), 6 if cfg.quick else 30)]
    parity = measure_parity(make_models(cfg.profile), paths)
    loads: dict[str, dict[str, Any]] = {}
    for profile in ("tiny",) if cfg.quick else ("tiny", "full"):
        models = make_models(profile)
        for role in ("tokenizer", "embedder"):
            runs = []
            for repeat in range(cfg.repeats):
                log(f"core: {profile} {role} load, repeat {repeat + 1}/{cfg.repeats}")
                runs.append(measure_timeline(models, role))
            loads[f"{profile}/{role}"] = summarize_timelines(runs)
    return {"parity": parity, "load": loads, "models_for_cosine": cfg.profile, "repeats": cfg.repeats}


RUNNERS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "core": section_core,
    "main": section_main,
    "scaling": section_scaling,
    "coldstart": section_coldstart,
    "memory": section_memory,
    "queue": section_queue,
    "throughput": section_throughput,
}
RESULT_NAMES = {
    "core": "core",
    "main": "limit-vs-voxmill",
    "scaling": "scaling",
    "coldstart": "coldstart",
    "memory": "memory",
    "queue": "queue-overhead",
    "throughput": "corpus-throughput",
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, a few clips, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", default="", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    parser.add_argument("--report-only", action="store_true", help="only rebuild BENCHMARKS.md")
    args = parser.parse_args(argv)
    cfg = Config.make(args.quick, args.repeats)
    chosen = [s for s in (args.only.split(",") if args.only else SECTIONS) if s]
    skipped = set(filter(None, args.skip.split(",")))
    unknown = [s for s in (*chosen, *skipped) if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    folder = results_dir(cfg.quick)
    if not args.report_only:
        log(f"models: {make_models(cfg.profile)}; corpus: {len(make_corpus(cfg.main))} clips")
        for section in chosen:
            if section in skipped:
                continue
            started = time.time()
            load_before = load_average()
            data = RUNNERS[section](cfg)
            data["bench"] = {
                "section": section,
                "config": {**asdict(replace(cfg)), "main": asdict(cfg.main), "issue4": asdict(cfg.issue4)},
                "seconds": round(time.time() - started, 1),
                "load_average_before": load_before,
                "load_average_after": load_average(),
            }
            path = write_result(folder, RESULT_NAMES[section], data)
            log(f"{section}: wrote {path} ({data['bench']['seconds']} s)")
    from benchmarks.report import write_report

    target = (QUICK_DIR / "BENCHMARKS.md") if cfg.quick else None
    log(f"report: {write_report(folder, target)}")


if __name__ == "__main__":
    main()
