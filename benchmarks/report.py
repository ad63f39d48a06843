"""`BENCHMARKS.md` and its plot, generated from the result files (never edited by hand).

Every number is "median (min-max)" over the repeats of one `make bench` run. Results in
`benchmarks/results/baseline/` (the same benchmark before the optimisations) give the
before/after table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT

Summary = dict[str, Any]
STAGE_LABELS = {
    "startup": "start-up (spawn -> first task)",
    "decode": "decode",
    "resample": "resample",
    "features": "features (log-mel / fbank)",
    "inference": "inference",
    "task_other": "other work in tasks",
    "write": "write shard",
    "queue_wait": "queue wait (between tasks)",
    "tail": "tail (last task -> exit)",
}


def load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def fmt(value: Summary | float | None, digits: int = 2, unit: str = "") -> str:
    """'median (min-max)' of a summary, or one number."""
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


def pct(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f} %"


def verdict(value: Summary | float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "–"
    median = value["median"] if isinstance(value, dict) else value
    if median is None:
        return "–"
    met = median >= target if higher_is_better else median <= target
    return "met" if met else "**not met**"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def machine_lines(data: dict[str, Any]) -> list[str]:
    m = data["machine"]
    bench = data.get("bench", {})
    load_avg = bench.get("load_average_before"), bench.get("load_average_after")
    return [
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gb']} GB; Python {m['python']}, "
        f"onnxruntime {m['onnxruntime']}, numpy {m['numpy']}, celery {m['celery']}; commit "
        f"`{(m.get('commit') or '?')[:10]}`{' (+ local changes)' if m.get('dirty') else ''}; measured {m['time']}"
        + (
            f"; load average before/after {load_avg[0][0]}/{load_avg[1][0]}"
            if load_avg[0] and load_avg[1]
            else ""
        )
        + ".",
        "",
    ]


# --------------------------------------------------------------------------- sections


def main_section(data: dict[str, Any]) -> list[str]:
    corpus = data["corpus"]
    targets = data["targets"]
    lines = [
        "## Voxmill against the raw-inference limit (issue 7)",
        "",
        f"Corpus: {corpus['clips']} clips, {corpus['audio_s'] / 60:.1f} min of audio, "
        f"{corpus['duration_s']['min']:.1f}–{corpus['duration_s']['max']:.1f} s (median "
        f"{corpus['duration_s']['median']:.1f} s), formats "
        + ", ".join(f"{k} ×{v}" for k, v in corpus["formats"].items())
        + f"; {data['models']} stand-ins; {data['workers']} processes × 1 thread; {data['repeats']} repeats, "
        "interleaved. Walls are whole processes timed from outside (the limit: barrier to last `run`).",
        "",
    ]
    rows = []
    for op, res in data["ops"].items():
        target = targets[f"{op}_to_limit"]
        rows.append(
            [
                op,
                fmt(res["limit_wall_s"], 1, " s"),
                fmt(res["voxmill_wall_s"], 1, " s"),
                fmt(res["plain_wall_s"], 1, " s"),
                f"{fmt(res['ratio_to_limit'], 3)} — target ≥ {target}: {verdict(res['ratio_to_limit'], target)}",
                fmt(res["steady_ratio_to_limit"], 3),
                f"{fmt(res['speedup_vs_plain'], 2, '×')} — target ≥ {targets['speedup_vs_plain']}×: "
                f"{verdict(res['speedup_vs_plain'], targets['speedup_vs_plain'])}",
            ]
        )
    lines += table(
        [
            "op",
            "limit",
            "voxmill extract",
            "plain loop",
            "voxmill / limit",
            "in-task / limit",
            "speed-up vs loop",
        ],
        rows,
    )
    lines += [
        "*in-task / limit*: the limit's inference time over the workers' time inside and between tasks "
        "(start-up and tail left out): the ratio a corpus large enough to hide the fixed costs would reach.",
        "",
        "### Where the time goes (stage breakdown)",
        "",
        "Share of wall × worker processes of the median `voxmill extract` run, from the worker trace "
        "(`benchmarks/trace/sitecustomize.py`), and per utterance (start-up and tail left out).",
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
    non_inference = {
        op: 1 - data["ops"][op]["stages"]["share_per_utterance"].get("inference", 0.0) for op in ops
    }
    lines += [
        "Everything but inference, per utterance (target ≤ 10 %): "
        + "; ".join(
            f"{op} {pct(v)} ({'met' if v <= targets['non_inference_share'] else 'not met'})"
            for op, v in non_inference.items()
        )
        + ".",
        "",
        "Peak RSS of a worker process during the runs: "
        + "; ".join(f"{op} {fmt(data['ops'][op]['worker_peak_mb'], 0, ' MB')}" for op in ops)
        + ".",
        "",
    ]
    return lines


def scaling_section(data: dict[str, Any]) -> list[str]:
    corpus = data["corpus"]
    lines = [
        "## Scaling (issue 7, item 6)",
        "",
        f"{corpus['clips']} clips ({corpus['audio_s'] / 60:.1f} min); end to end = `voxmill extract --ops "
        "tokenize,embed` as a whole process; model only = the limit measurement. PxT = processes × intra-op threads.",
        "",
    ]
    rows = []
    for label, res in [("end to end", data["end_to_end"])] + [
        (f"{op}, model only", r) for op, r in data["model_only"].items()
    ]:
        rows.append(
            [
                label,
                fmt(res["wall_s"]["1x1"], 1, " s"),
                fmt(res["wall_s"]["2x1"], 1, " s"),
                fmt(res["wall_s"]["1x2"], 1, " s"),
                f"{fmt(res['speedup_2_vs_1_process'], 2, '×')} ({verdict(res['speedup_2_vs_1_process'], data['target_speedup'])})",
                fmt(res["processes_vs_threads"], 2, "×"),
            ]
        )
    lines += table(
        ["", "1x1", "2x1", "1x2", "2 vs 1 process (target ≥ 1.8×)", "2x1 faster than 1x2 by"], rows
    )
    return lines


def coldstart_section(data: dict[str, Any]) -> list[str]:
    lines = [
        "## Cold start (issue 7, item 5)",
        "",
        "A fresh process per model: spawn → imports → `ModelSession.load` → `warm_up` (2 runs of a 3 s clip); "
        "then the first inference after warm-up of a 10 s clip on one thread (features + model, and the model alone).",
        "",
    ]
    rows = []
    for role, res in data["per_model"].items():
        rows.append(
            [
                role,
                fmt(res.get("spawn_to_imported_s"), 2, " s"),
                fmt(res["load_s"], 2, " s"),
                fmt(res.get("spawn_to_warmed_s"), 2, " s"),
                f"{fmt(res['first_inference_ms'], 0, ' ms')} ({fmt(res['first_inference_model_ms'], 0, ' ms')} model)",
                f"load < 5 s: {verdict(res['load_s'], 5.0, False)}; first < 100 ms: "
                f"{verdict(res['first_inference_ms'], 100.0, False)}",
            ]
        )
    lines += table(
        ["model", "spawn → imported", "load", "spawn → warmed", "first 10 s inference", "guide"], rows
    )
    worker = data["worker"]
    lines += [
        f"A Celery worker process (`LocalWorkers`, both queues, both {data['models']} models), spawned with one task "
        f"already queued: ready for its first task after {fmt(worker['ready_for_first_task_s'], 2, ' s')} "
        f"(heartbeat with models loaded: {fmt(worker['heartbeat_ready_s'], 2, ' s')}); target ≤ 3 s: "
        f"{verdict(worker['ready_for_first_task_s'], 3.0, False)}.",
        "",
    ]
    return lines


def memory_section(data: dict[str, Any]) -> list[str]:
    lines = [
        "## Memory and model loading (issue 7, item 7)",
        "",
        "A fresh process loads the tokenizer, warms it up and runs a 25 s clip (`benchmarks/memory.py`). "
        "`voxmill` is what every worker does today; the other rows are the loading options proposed for "
        "`pipeline/sessions.py`. Peak = VmHWM at the end; outputs compared by sha256.",
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
                fmt(res["load_s"], 2, " s"),
                fmt(res["rss_after_clip_mb"], 0, " MB"),
                fmt(res["peak_mb"], 0, " MB"),
                f"{verdict(res['peak_mb'], data['target_worker_mb'], False)}",
                fmt(res["latency_10s_ms"], 0, " ms"),
                "same" if res["outputs_sha256"] == reference else "**different**",
            ]
        )
    emb = data["embedder"]
    rows.append(
        [
            "voxmill (embedder)",
            f"{emb['file_mb']:.0f} MB",
            fmt(emb["load_s"], 2, " s"),
            fmt(emb["rss_after_clip_mb"], 0, " MB"),
            fmt(emb["peak_mb"], 0, " MB"),
            "",
            fmt(emb["latency_10s_ms"], 0, " ms"),
            "",
        ]
    )
    lines += table(
        ["load mode", "file", "load", "RSS after 25 s clip", "peak RSS", "< 1 GB", "10 s clip", "outputs"],
        rows,
    )
    return lines


def variants_section(data: dict[str, Any]) -> list[str]:
    lines = [
        "## Driver changes, measured with a prototype (proposals for `workers/driver.py`)",
        "",
        "`benchmarks/prototype.py` runs `extract_corpus`'s steps with one change at a time (`extract` is "
        "`voxmill extract` itself); `blas-1-thread` is `voxmill extract` with `OPENBLAS_NUM_THREADS=1`; "
        "`shard-size-N` is `--shard-size N`. Tail = last task → exit, start-up = spawn → first task, "
        "per worker process.",
        "",
    ]
    for op, variants in data["ops"].items():
        rows = [
            [
                name,
                fmt(res["wall_s"], 1, " s"),
                fmt(res["vs_extract"], 3, "×"),
                fmt(res["startup_s"], 2, " s"),
                fmt(res["tail_s"], 2, " s"),
            ]
            for name, res in variants.items()
        ]
        lines += [f"**{op}**", ""]
        lines += table(["variant", "wall", "speed-up vs extract", "start-up", "tail"], rows)
    return lines


def queue_section(data: dict[str, Any]) -> list[str]:
    return [
        "## Queue overhead (issue 3)",
        "",
        f"{data['tasks']} tasks × {data['repeats']} repeats, one at a time, alternating `tokenize` and `embed` of a "
        f"{data['clip_s']:.0f} s clip by path, {data['models']} models, {data['workers']} worker processes, Redis on "
        "loopback. Overhead = submit → result (`AsyncResult.get`) minus the time inside the task (`timings_ms`).",
        "",
        *table(
            ["metric", "value", "target"],
            [
                [
                    "overhead p50",
                    fmt(data["overhead_p50_ms"], 2, " ms"),
                    f"< 5 ms: {verdict(data['overhead_p50_ms'], 5.0, False)}",
                ],
                ["overhead p99", fmt(data["overhead_p99_ms"], 2, " ms"), ""],
                [
                    "overhead p50 through `Client.as_completed` (polls every 20 ms)",
                    fmt(data["client_overhead_p50_ms"], 2, " ms"),
                    "",
                ],
                ["tasks/s, all submitted at once, 2 processes", fmt(data["tasks_per_s"], 1), ""],
            ],
        ),
    ]


def throughput_section(data: dict[str, Any]) -> list[str]:
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
        "proposals": "prototype: decode once + longest first + fast stop",
    }
    for kind, res in data.get("prototypes", {}).items():
        rows.append(
            [labels.get(kind, kind), fmt(res["audio_s_per_s"], 1), fmt(res["speedup_vs_plain"], 2, "×")]
        )
    return [
        "## Corpus throughput (issue 4)",
        "",
        f"{corpus['clips']} clips of {corpus['duration_s']['min']:.0f}–{corpus['duration_s']['max']:.0f} s "
        f"({corpus['audio_s'] / 60:.1f} min), {data['models']} stand-ins, ops {', '.join(data['ops'])}; "
        f"`voxmill extract` with {data['workers']} local workers vs `Extractor` in one process "
        "(each clip decoded once, both models).",
        "",
        *table(["", "audio seconds per wall second", "speed-up vs plain loop"], rows),
    ]


def core_section(data: dict[str, Any]) -> list[str]:
    parity = data["parity"]
    logmel = parity["log_mel_max_abs"]
    lines = [
        "## Core library numbers (issue 2)",
        "",
        "Parity against the torch references in `tests/fixtures` (max abs difference):",
        "",
    ]
    rows = []
    for name in logmel:
        fb = parity["fbank_max_abs"][name]
        knf = parity["fbank_knf_max_abs"][name]
        rows.append(
            [
                name,
                f"{logmel[name]['128']:.2e}",
                f"{logmel[name]['80']:.2e}",
                f"{fb['overall']:.2e} / {fb['above_minus5']:.2e}",
                f"{knf['overall']:.2e} / {knf['above_minus5']:.2e}",
                f"{parity['embedding_cosine_vs_knf'][name]:.7f}",
            ]
        )
    lines += table(
        [
            "clip",
            "log-mel 128 (≤ 1e-4)",
            "log-mel 80",
            "fbank overall / above -5 (≤ 1e-2 / 5e-4)",
            "kaldi-native-fbank, same",
            "embedding cosine vs kaldi-native-fbank",
        ],
        rows,
    )
    resample = parity["resample_vs_torchaudio"]
    speeds = parity["feature_ms_per_audio_s"]
    lines += [
        f"soxr vs torchaudio's resampler (44.1 kHz stereo fixture): max abs {resample['max_abs']:.2e}, "
        f"SNR {resample['snr_db']:.1f} dB over the whole band, {resample.get('snr_below_6khz_db', float('nan')):.1f} dB "
        f"below 6 kHz (torchaudio's default filter rolls off early), length difference "
        f"{resample['length_diff']} samples.",
        "",
        "Feature cost, ms per audio second (10 s clip): "
        + "; ".join(f"{name} {fmt(v, 3)}" for name, v in speeds.items())
        + ".",
        "",
    ]
    rows = []
    for key, res in data["load"].items():
        rows.append(
            [
                key,
                fmt(res["load_s"], 3, " s"),
                fmt(res["first_inference_ms"], 1, " ms"),
                fmt(res["first_inference_model_ms"], 1, " ms"),
                f"load < 5 s: {verdict(res['load_s'], 5.0, False)}; first < 100 ms: {verdict(res['first_inference_ms'], 100.0, False)}",
            ]
        )
    lines += ["Load and first inference after warm-up (10 s clip, one CPU thread):", ""]
    lines += table(["stand-in", "load", "first inference", "of which model", "deployment guide"], rows)
    return lines


def before_after(folder: Path) -> list[str]:
    """Before/after of the optimisations, from `baseline/` against the current results."""
    base_dir = folder / "baseline"
    notes_file = folder / "optimisations.json"
    if not base_dir.exists() and not notes_file.exists():
        return []
    lines = ["## Optimisations: before and after", ""]
    if notes_file.exists():
        notes = json.loads(notes_file.read_text())
        rows = [[n["change"], n["where"], n["before"], n["after"], n["kept"]] for n in notes["changes"]]
        lines += table(["change", "where", "before", "after", "kept"], rows)
    before, after = load(base_dir, "limit-vs-voxmill"), load(folder, "limit-vs-voxmill")
    if before and after:
        rows = []
        for op in after["ops"]:
            if op not in before["ops"]:
                continue
            b, a = before["ops"][op], after["ops"][op]
            for label, key, digits in (
                ("voxmill / limit", "ratio_to_limit", 3),
                ("in-task / limit", "steady_ratio_to_limit", 3),
                ("speed-up vs plain loop", "speedup_vs_plain", 2),
            ):
                rows.append([op, label, fmt(b[key], digits), fmt(a[key], digits)])
            rows.append(
                [
                    op,
                    "features per utterance",
                    pct(b["stages"]["share_per_utterance"].get("features")),
                    pct(a["stages"]["share_per_utterance"].get("features")),
                ]
            )
        lines += [
            f"`make bench` before (`baseline/`, {before['machine']['time']}) and after ({after['machine']['time']}); "
            "ratios are taken within each run, so the machine's load at the time cancels out:",
            "",
        ]
        lines += table(["op", "metric", "before", "after"], rows)
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
        ("limit_wall_s", "limit", "#4c72b0"),
        ("voxmill_wall_s", "voxmill extract", "#55a868"),
        ("plain_wall_s", "plain loop", "#c44e52"),
    )
    width = 0.25
    for index, (key, label, color) in enumerate(kinds):
        medians, errors_low, errors_high = [], [], []
        for op in ops:
            wall = main["ops"][op][key]
            rate = audio_s / wall["median"]
            medians.append(rate)
            errors_low.append(rate - audio_s / wall["max"])
            errors_high.append(audio_s / wall["min"] - rate)
        positions = [i + (index - 1) * width for i in range(len(ops))]
        left.bar(
            positions, medians, width, label=label, color=color, yerr=[errors_low, errors_high], capsize=3
        )
    left.set_xticks(range(len(ops)), ops)
    left.set_ylabel("audio seconds per wall second")
    left.set_title(f"Throughput ({main['workers']} cores, {main['models']} stand-ins)")
    left.legend()
    stages = list(STAGE_LABELS)
    bottom = [0.0] * len(ops)
    colors = plt.get_cmap("tab10")
    for index, stage in enumerate(stages):
        shares = [main["ops"][op]["stages"]["share_of_wall"].get(stage, 0.0) * 100 for op in ops]
        right.bar(ops, shares, bottom=bottom, label=STAGE_LABELS[stage], color=colors(index))
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    right.set_ylabel("% of wall × worker processes")
    right.set_title("voxmill extract: where the time goes")
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
    ("limit-vs-voxmill", main_section),
    ("scaling", scaling_section),
    ("coldstart", coldstart_section),
    ("memory", memory_section),
    ("driver-variants", variants_section),
    ("queue-overhead", queue_section),
    ("corpus-throughput", throughput_section),
    ("core", core_section),
]


def write_report(folder: Path, target: Path | None = None) -> Path:
    """Write BENCHMARKS.md (default: the repository root) from the results in `folder`."""
    target = target or ROOT / "BENCHMARKS.md"
    image = plot(folder, folder / "bench.png")
    lines = [
        "# voxmill benchmarks",
        "",
        "Generated by `make bench` (`python -m benchmarks.run`; `--quick` for the smoke version) from "
        f"`{folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder}/*.json`; do not edit by hand. "
        "Numbers are medians over repeats with (min–max). The machine is shared: other jobs ran during the "
        "measurements (load averages are recorded per section), so single runs are noisy; ratios are taken "
        "within one repeat, where both sides saw the same load.",
        "",
    ]
    if image is not None:
        lines += [
            f"![throughput and stages]({image.relative_to(target.parent) if image.is_relative_to(target.parent) else image})",
            "",
        ]
    first = True
    for name, render in SECTIONS:
        data = load(folder, name)
        if data is None:
            continue
        lines += render(data)
        if first:
            lines += machine_lines(data)
            first = False
        else:
            bench = data.get("bench", {})
            if bench.get("load_average_before"):
                lines += [
                    f"_Measured {data['machine']['time']}, load average {bench['load_average_before'][0]} → "
                    f"{bench['load_average_after'][0]}._",
                    "",
                ]
    lines += before_after(folder)
    target.write_text("\n".join(lines).rstrip() + "\n")
    return target
