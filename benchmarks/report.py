"""`BENCHMARKS.md`, rendered as tables from the result files (never edited by hand).

Every number is "median (min–max)" over the repeats of one run; the targets table gives a verdict
for each target a result file carries. The history of the optimisations is in `CHANGELOG.md`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, read_result

Value = dict[str, Any] | float | None
Lines = list[str]
Show = Callable[[Any], str]
Column = tuple[str, str, Show]  # header, key in the result, how to show it
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


# --------------------------------------------------------------------------- formatting


def median(value: Value) -> float | None:
    if isinstance(value, dict):
        med = value.get("median")
        return None if med is None else float(med)
    return value


def fmt(value: Value, digits: int = 2, unit: str = "") -> str:
    """'median (min–max)' of a summary, or one number."""
    med = median(value)
    if med is None:
        return "–"
    if isinstance(value, dict) and len(value.get("runs", [])) > 1 and value["min"] != value["max"]:
        return f"{med:.{digits}f}{unit} ({value['min']:.{digits}f}–{value['max']:.{digits}f})"
    return f"{med:.{digits}f}{unit}"


ms, ms1, ms2 = (partial(fmt, digits=d, unit=" ms") for d in (0, 1, 2))
mb = partial(fmt, digits=0, unit=" MB")
ratio = partial(fmt, digits=3)
times, times3 = partial(fmt, digits=2, unit="×"), partial(fmt, digits=3, unit="×")


def secs(value: Value) -> str:
    """Seconds with as many digits as they need."""
    med = median(value)
    digits = 3 if med is None or med < 0.1 else 2 if med < 10 else 1
    return fmt(value, digits, " s")


def peak_mb(value: Value) -> str:
    """A peak the sampler never saw is said so, not shown as 0 MB."""
    return mb(value) if median(value) else "not recorded"


def pct(value: Value) -> str:
    med = median(value)
    return "–" if med is None else f"{100 * med:.1f} %"


def verdict(value: Value, target: float, higher_is_better: bool) -> str:
    med = median(value)
    if med is None:
        return "–"
    return "met" if (med >= target if higher_is_better else med <= target) else "**not met**"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> Lines:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def columns_table(
    first: str, items: Iterable[tuple[str, dict[str, Any]]], columns: Sequence[Column]
) -> Lines:
    """One row per (name, result), one column per (header, key, show)."""
    rows = [[name, *(show(res.get(key)) for _, key, show in columns)] for name, res in items]
    return table([first, *(header for header, _, _ in columns)], rows)


def corpus_line(data: dict[str, Any]) -> Lines:
    corpus = data["corpus"]
    durations = corpus["duration_s"]
    formats = ", ".join(f"{name} ×{count}" for name, count in corpus["formats"].items())
    return [
        f"Corpus: {corpus['clips']} clips, {corpus['audio_s'] / 60:.1f} min of audio, "
        f"{durations['min']:.1f}–{durations['max']:.1f} s (median {durations['median']:.1f} s, "
        f"{corpus['recipe']['distribution']}); {formats}; {data['models']} stand-ins; "
        f"{data['repeats']} repeats.",
        "",
    ]


def machine_line(data: dict[str, Any]) -> Lines:
    m = data["machine"]
    return [
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gb']} GB; Python {m['python']}, "
        f"onnxruntime {m['onnxruntime']}, numpy {m['numpy']}, scipy {m.get('scipy')}, celery {m['celery']}.",
        "",
    ]


def measured_line(data: dict[str, Any]) -> Lines:
    bench, machine = data.get("bench", {}), data.get("machine")
    if not machine:  # a result file that does not record where it was measured
        return []
    before, after = bench.get("load_average_before"), bench.get("load_average_after")
    load = f", load average {before[0]} → {after[0]}" if before and after else ""
    commit = (machine.get("commit") or "?")[:10] + (" + local changes" if machine.get("dirty") else "")
    took = f"; {bench['seconds']} s" if "seconds" in bench else ""  # sections run on their own record none
    return [f"_Measured {machine.get('time', '?')}{load}{took}; commit `{commit}`._", ""]


# --------------------------------------------------------------------------- targets

Target = tuple[str, Value, float, Show, bool]  # measure, value, target, how to show both, higher is better


def targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    """Every target the result files carry, with the value measured against it."""
    out: list[Target] = []
    if main := results.get("limit-vs-voxmill"):
        goal = main["targets"]
        for op, res in main["ops"].items():
            to_limit, speedup = goal[f"{op}_to_limit"], goal["speedup_vs_plain"]
            others = 1 - res["stages"]["share_per_utterance"]["inference"]
            out += [
                (f"{op}: voxmill extract / limit", res["ratio_to_limit"], to_limit, ratio, True),
                (f"{op}: the same in CPU seconds", res.get("cpu_ratio_to_limit"), to_limit, ratio, True),
                (f"{op}: speed-up vs plain loop", res["speedup_vs_plain"], speedup, times, True),
                (f"{op}: not inference, per utterance", others, goal["non_inference_share"], pct, False),
            ]
    if scaling := results.get("scaling"):
        speedup = scaling["end_to_end"]["speedup_2_vs_1_process"]
        out.append(("1 → 2 worker processes, end to end", speedup, scaling["target_speedup"], times3, True))
    if cold := results.get("coldstart"):
        goal = cold["targets"]
        ready = cold["worker"]["ready_for_first_task_s"]
        out.append(("worker ready for its first task", ready, goal["worker_ready_s"], secs, False))
        for role, res in cold["per_model"].items():
            out.append((f"{role}: load", res["load_s"], goal["load_s"], secs, False))
            first = res["first_inference_ms"]
            out.append((f"{role}: first 10 s inference", first, goal["first_inference_ms"], ms, False))
    if (memory := results.get("memory")) and "voxmill" in memory["tokenizer"]:
        peak = memory["tokenizer"]["voxmill"]["peak_mb"]
        label = f"peak RSS, {memory['models']} tokenizer, 25 s clip"
        out.append((label, peak, memory["target_worker_mb"], mb, False))
    out += lengths_targets(results.get("memory-lengths"))
    if queue := results.get("queue-overhead"):
        p50 = queue["overhead_p50_ms"]
        out.append(("queue overhead per task, p50", p50, queue["target_p50_ms"], ms2, False))
    if scale := results.get("corpus-scale"):
        at = f"{scale['targets_at']:,} utterances"
        shows: dict[str, tuple[str, Show]] = {
            "first_shard_submitted_s": ("first shard submitted", secs),
            "driver_peak_rss_mb": ("driver peak RSS", mb),
            "merge_peak_rss_mb": ("merge peak RSS", mb),
            "resume_s": ("resume of a finished run", secs),
            "ratio_to_plain_loop": ("whole run / 2-process plain loop", ratio),
        }
        for key, goal in scale["targets"].items():
            label, show = shows[key]
            higher = key == "ratio_to_plain_loop"
            out.append((f"corpus of {at}: {label}", goal["measured"], goal["target"], show, higher))
    out += store_targets(results)
    out += batching_targets(results.get("batching"))
    if (speech := results.get("speech-check-full")) and "target_embed_overhead" in speech:
        goal = speech["target_embed_overhead"]
        if embed_runs := speech.get("extract", {}).get("embed"):
            label = "speech check: embed `voxmill extract` runs, on / off − 1"
            out.append((label, embed_runs["overhead"], goal, pct, False))
        label = "speech check: embed in-process loop, on / off − 1"
        out.append((label, speech["whole_run"]["embed"]["overhead"], goal, pct, False))
    return out


def store_targets(results: dict[str, dict[str, Any]]) -> list[Target]:
    """The targets of `benchmarks/latency.py` and `benchmarks/shard_sizing.py` (issue 34)."""
    out: list[Target] = []
    # The latency target is the full-size models' (issue 34); the CPU per GET is clearest with tiny ones.
    for name, models in (("latency-full", "full-size"), ("latency", "tiny")):
        if (latency := results.get(name)) and "reads in flight" in latency["settings"]:
            ahead = latency["settings"]["reads in flight"]
            slowest = max((d for d in ahead if d != "local"), key=lambda name: float(name.strip("+ ms")))
            label = f"objects at {slowest}, reads in flight, {models} models: rate / the same at +0 ms"
            out.append((label, ahead[slowest]["ratio_to_plus0"], 0.9, ratio, True))
            if name == "latency":
                cpu = ahead[slowest]["worker_cpu_ms_per_clip_over_local"]
                out.append(("worker CPU per GET (per clip, over local files)", cpu, 0.5, ms2, False))
    for name, models in (("latency_outputs-full", "full-size"), ("latency_outputs", "tiny")):
        if (outputs := results.get(name)) and "uploads behind" in outputs.get("settings", {}):
            behind = outputs["settings"]["uploads behind"]
            slowest = max(outputs["delays_ms"])
            label = f"outputs in the bucket at +{slowest:g} ms, {models} models: whole run / local outputs"
            out.append((label, behind[f"bucket +{slowest:g} ms"]["wall_over_local"], 1.1, ratio, False))
    if sizing := results.get("shard-sizing"):
        label = f"{sizing['utterances']:,} short clips without durations / plain loop"
        value = sizing["after"]["ratio_to_plain_loop"]
        out.append((label, value, sizing["target"]["ratio_to_plain_loop"], ratio, True))
    return out


def batching_targets(data: dict[str, Any] | None) -> list[Target]:
    """The targets of `benchmarks/batching.py` (issue 33)."""
    if not data:
        return []
    out: list[Target] = []
    for name, what in (("short", "short clips"), ("mixed", "a mixed corpus")):
        part = data[name]
        out.append(
            (
                f"batched tokens on {what}: rate / unbatched",
                part["ratio_on_to_off"],
                part["target"],
                times3,
                True,
            )
        )
    latency = data["single_jobs"]["ratio_on_to_off_p50"]
    out.append(("batched tokens: single-job p50 / unbatched", latency, 1.10, times3, False))
    return out


def lengths_targets(data: dict[str, Any] | None) -> list[Target]:
    """The targets of `benchmarks/memory_lengths.py` (issue 35), met by voxmill's defaults."""
    if not data:
        return []
    after, goal = data["children"]["after"], data["targets"]
    span = f"{data['clips']:,} clips of 0.5–30 s"
    return [
        (f"{span}: RSS growth after clip {data['first']:,}", after["growth_after_first"],
         goal["growth_after_first"], pct, False),
        (f"a {data['long_s'] / 60:g}-minute clip: lasting RSS growth", after["long_clip_lasting_growth"],
         goal["long_clip_lasting_growth"], pct, False),
        (f"{span}: time against the old memory settings − 1", data["throughput_cost"],
         goal["throughput_cost"], pct, False),
    ]  # fmt: skip


def targets_section(results: dict[str, dict[str, Any]]) -> Lines:
    rows = [
        [label, show(value), f"{'≥' if higher else '≤'} {show(goal)}", verdict(value, goal, higher)]
        for label, value, goal, show, higher in targets(results)
    ]
    return ["## Targets", "", *table(["measure", "value", "target", ""], rows)] if rows else []


# --------------------------------------------------------------------------- sections

MAIN_COLUMNS: list[Column] = [
    ("limit", "limit_wall_s", secs),
    ("voxmill extract", "voxmill_wall_s", secs),
    ("plain loop", "plain_wall_s", secs),
    ("voxmill / limit", "ratio_to_limit", ratio),
    ("CPU: limit / voxmill", "cpu_ratio_to_limit", ratio),
    ("in-task / limit", "steady_ratio_to_limit", ratio),
    ("speed-up vs loop", "speedup_vs_plain", times),
    ("worker peak RSS", "worker_peak_mb", peak_mb),
]
COLDSTART_COLUMNS: list[Column] = [
    ("spawn → imported", "spawn_to_imported_s", secs),
    ("load", "load_s", secs),
    ("first load (empty cache)", "first_load_s", secs),
    ("warm-up", "warmup_s", secs),
    ("spawn → warmed", "spawn_to_warmed_s", secs),
    ("first 10 s inference", "first_inference_ms", ms),
    ("of which model", "first_inference_model_ms", ms),
]
MEMORY_COLUMNS: list[Column] = [
    ("file", "file_mb", mb),
    ("load time", "load_s", secs),
    ("RSS loaded", "rss_loaded_mb", mb),
    ("RSS after 25 s clip", "rss_after_clip_mb", mb),
    ("peak RSS", "peak_mb", mb),
    ("10 s clip", "latency_10s_ms", ms),
    ("outputs", "outputs", str),
]
LOAD_COLUMNS: list[Column] = [
    ("load", "load_s", secs),
    ("first 10 s inference", "first_inference_ms", ms1),
    ("of which model", "first_inference_model_ms", ms1),
]


def main_section(data: dict[str, Any]) -> Lines:
    ops = data["ops"]
    shares = {"share_of_wall": "of wall", "share_per_utterance": "per utterance"}
    stages = [
        [label, *(pct(res["stages"][share].get(stage)) for res in ops.values() for share in shares)]
        for stage, label in STAGE_LABELS.items()
    ]
    return [
        "## Voxmill against the raw-inference limit",
        "",
        "Per op, interleaved repeats: the limit is `session.run` alone on precomputed features, the "
        "corpus balanced over the processes (`benchmarks/limit.py`); `voxmill extract` and the plain "
        f"`Extractor` loop are whole processes timed from outside; {data['workers']} processes × 1 thread. "
        "Ratios are taken within each repeat; *in-task* leaves the workers' start-up and tail out.",
        "",
        *corpus_line(data),
        *columns_table("op", ops.items(), MAIN_COLUMNS),
        "Where the time goes in the median `voxmill extract` run (worker trace, `benchmarks/trace`): shares "
        "of wall × worker processes, and per utterance (start-up and tail left out).",
        "",
        *table(["stage", *(f"{op}: {label}" for op in ops for label in shares.values())], stages),
    ]


def scaling_section(data: dict[str, Any]) -> Lines:
    cases = [("end to end", data["end_to_end"])]
    cases += [(f"{op}, model only", res) for op, res in data["model_only"].items()]
    columns: list[Column] = [
        *((name, name, secs) for name in ("1x1", "2x1", "1x2")),
        (f"2x1, --shard-size {data.get('small_shard_size')}", "2x1/s8", secs),
        ("2 vs 1 process", "speedup_2_vs_1_process", times3),
        ("the same, small shards", "speedup_2_vs_1_process_small_shards", times3),
        ("2x1 faster than 1x2 by", "processes_vs_threads", times),
    ]
    return [
        "## Scaling",
        "",
        "PxT = worker processes × intra-op threads. End to end: `voxmill extract --ops tokenize,embed` "
        "(automatic shard size unless named); model only: the limit measurement.",
        "",
        *corpus_line(data),
        *columns_table("", ((label, {**res["wall_s"], **res}) for label, res in cases), columns),
    ]


def coldstart_section(data: dict[str, Any]) -> Lines:
    worker = data["worker"]
    rows = [
        ["ready for its first task", secs(worker["ready_for_first_task_s"])],
        ["heartbeat says the models are loaded", secs(worker["heartbeat_ready_s"])],
        [
            "ready for its first task, `model_cache: false`",
            secs(data.get("worker_no_cache", {}).get("ready_for_first_task_s")),
        ],
    ]
    return [
        "## Cold start",
        "",
        "A fresh process per model: spawn → imports → load (the optimized-model cache entry already built, "
        "except for *first load*) → warm-up, then a 10 s clip on one thread. Then a worker process (both "
        f"queues, both {data['models']} models) spawned with one task already queued.",
        "",
        *columns_table("model", data["per_model"].items(), COLDSTART_COLUMNS),
        *table(["worker process", "after spawn"], rows),
    ]


def memory_section(data: dict[str, Any]) -> Lines:
    reference = data["tokenizer"].get("voxmill", {}).get("outputs_sha256")
    items = [
        (
            f"tokenizer, {mode}",
            {**res, "outputs": "same" if res["outputs_sha256"] == reference else "**different**"},
        )
        for mode, res in data["tokenizer"].items()
    ]
    items.append(("embedder, voxmill", {**data["embedder"], "outputs": ""}))
    return [
        "## Memory and model loading",
        "",
        "A fresh process loads a model one way (the modes are `benchmarks/memory.py`'s), warms it up and "
        "runs a 25 s clip; peak = VmHWM. Outputs: sha256 of the 10 s and 25 s clips' outputs against "
        "`voxmill`'s.",
        "",
        *columns_table("model, load", items, MEMORY_COLUMNS),
    ]


LENGTHS_COLUMNS: list[Column] = [
    ("RSS loaded", "rss_loaded_mb", mb),
    ("RSS at clip {first}", "rss_at_first_mb", mb),
    ("RSS at the end", "rss_end_mb", mb),
    ("growth after clip {first}", "growth_after_first", pct),
    ("long clip: peak", "long_clip_peak_mb", mb),
    ("RSS before it", "long_clip_rss_before_mb", mb),
    ("RSS after it", "long_clip_rss_after_mb", mb),
    ("lasting growth", "long_clip_lasting_growth", pct),
    ("audio s/s", "audio_s_per_s", partial(fmt, digits=1)),
]
LENGTHS_NAMES = {
    "before": "before: memory patterns on, arena never shrunk, glibc's mmap threshold",
    "after": "after: voxmill's defaults",
}


def memory_lengths_section(data: dict[str, Any]) -> Lines:
    kids, first = data["children"], f"{data['first']:,}"
    columns = [(header.format(first=first), key, show) for header, key, show in LENGTHS_COLUMNS]
    items = [(LENGTHS_NAMES.get(name, name), res) for name, res in kids.items()]
    readings = {name: {p["clips"]: p["rss_mb"] for p in res["timeline"]} for name, res in kids.items()}
    clips = sorted({c for values in readings.values() for c in values})
    rows = [[f"{c:,}", *(mb(readings[name].get(c)) for name in kids)] for c in clips]
    models = data["models"]
    return [
        "## Memory under clips of every length",
        "",
        f"`{data.get('command', 'python -m benchmarks.memory_lengths')}`: two "
        f"processes, each holding the speech detector, the {models['tokenizer']} tokenizer and the "
        f"{models['embedder']} embedder, run the same {data['clips']:,} clips of random length 0.5–30 s "
        f"({data['audio_s'] / 3600:.1f} h of audio) through the detector, tokenize and embed, in "
        f"alternating blocks of {data['block']}; after clip {first}, one {data['long_s']:g} s clip. "
        "RSS is VmRSS; the long clip's peak is VmHWM.",
        "",
        *columns_table("memory settings", items, columns),
        f"Time of the same clips, after / before − 1: **{pct(data['throughput_cost'])}** (per block of "
        f"{data['block']}: {fmt(data['block_time_ratio'], 3)}).",
        "",
        *table(["clips", *(LENGTHS_NAMES.get(name, name).split(":")[0] for name in kids)], rows),
    ]


def queue_section(data: dict[str, Any]) -> Lines:
    split = data.get("split") or {}
    rows = [
        ["overhead p50", ms2(data["overhead_p50_ms"])],
        ["overhead p99", ms2(data["overhead_p99_ms"])],
        ["overhead p50 through `Client` (woken by results)", ms2(data["client_overhead_p50_ms"])],
        [
            f"the same, polling every {data.get('client_polling_s', 0.02) * 1000:.0f} ms",
            ms2(data.get("client_polling_overhead_p50_ms")),
        ],
        [f"tasks/s, all submitted at once, {data['workers']} processes", fmt(data["tasks_per_s"], 1)],
    ]
    legs = [
        [
            "submit → `run_clip` starts",
            ms2(split.get("to_worker_ms_p50")),
            ms2(split.get("to_worker_ms_p99")),
        ],
        ["`run_clip`", ms2(split.get("process_ms_p50")), ""],
        ["its stages (`timings_ms`)", ms2(split.get("stages_ms_p50")), ""],
        ["`run_clip` returns → result seen", ms2(split.get("back_ms_p50")), ms2(split.get("back_ms_p99"))],
    ]
    return [
        "## Queue overhead",
        "",
        f"{data['tasks']} tasks per repeat × {data['repeats']}, one at a time, alternating `tokenize` and "
        f"`embed` of a {data['clip_s']:.0f} s clip by path ({data['models']} models, Redis on loopback); "
        "overhead = submit → result minus the time inside the task. Legs: on workers that trace each task.",
        "",
        *table(["measure", "value"], rows),
        *(table(["leg", "p50", "p99"], legs) if "to_worker_ms_p50" in split else []),
    ]


def throughput_section(data: dict[str, Any]) -> Lines:
    rows = [
        ["`voxmill extract` (whole process)", fmt(data["voxmill_audio_s_per_s"], 1), times(data["speedup"])],
        ["`Extractor` plain loop (whole process)", fmt(data["plain_audio_s_per_s"], 1), "1×"],
        ["`Extractor` plain loop (loop only)", fmt(data["plain_loop_only_audio_s_per_s"], 1), ""],
    ]
    return [
        "## Corpus throughput",
        "",
        f"Both ops ({', '.join(data['ops'])}): `voxmill extract` with {data['workers']} local workers "
        "against `Extractor` in one process, each clip decoded once.",
        "",
        *corpus_line(data),
        *table(["", "audio seconds per wall second", "speed-up vs plain loop"], rows),
    ]


def core_section(data: dict[str, Any]) -> Lines:
    parity = data["parity"]
    both = "{overall:.1e} / {above_minus5:.1e}"
    rows = [
        [
            name,
            f"{errors['128']:.1e}",
            f"{errors['80']:.1e}",
            both.format(**parity["fbank_max_abs"][name]),
            both.format(**parity["fbank_knf_max_abs"][name]),
            f"{parity['embedding_cosine_vs_knf'][name]:.9f}",
        ]
        for name, errors in parity["log_mel_max_abs"].items()
    ]
    header = [
        "clip",
        "log-mel 128",
        "log-mel 80",
        "fbank: overall / above -5",
        "kaldi-native-fbank: the same",
    ]
    resample = parity["resample_vs_torchaudio"]
    mixdown = parity.get("stereo_mixdown_ms_per_audio_s", {})
    sparse = parity.get("log_mel_sparse_vs_blas") or {}
    cpu = sparse.get("cpu_ms_per_10s_clip", {})
    same = {True: "identical", False: "**different**"}
    checks = [
        [
            "soxr vs torchaudio's resampler (44.1 kHz stereo): SNR, below 6 kHz",
            f"{resample['snr_db']:.1f} dB, {resample.get('snr_below_6khz_db', 0):.1f} dB",
        ],
        ["`mel_filters` vs librosa's", same[bool(parity.get("mel_filters_identical_to_librosa"))]],
        ["`to_mono` vs numpy's mean over channels", same[bool(mixdown.get("identical"))]],
        [
            "`to_mono` / numpy's mean, ms per audio second",
            f"{fmt(mixdown.get('to_mono'), 3)} / {fmt(mixdown.get('mean_axis_1'), 3)}",
        ],
        [
            "log-mel, sparse vs dense BLAS product: tokens differing",
            f"{sparse.get('tokens_differing')} of {sparse.get('tokens')}",
        ],
        ["the same: process CPU ms per 10 s clip", f"{cpu.get('sparse')} / {cpu.get('dense_blas')}"],
        *(
            [f"`{name}`, ms per audio second", fmt(value, 3)]
            for name, value in parity["feature_ms_per_audio_s"].items()
        ),
    ]
    return [
        "## Core library",
        "",
        "Max abs difference against the torch references in `tests/fixtures` (the tests' tolerances: log-mel "
        "1e-4; fbank 1e-2 overall, 5e-4 above -5); checks and feature kernels on a 10 s clip, in-process.",
        "",
        *table([*header, f"CAM++ cosine ({data['models_for_cosine']}), fbank vs kaldi-native-fbank"], rows),
        *table(["check", "result"], checks),
        *columns_table("stand-in", data["load"].items(), LOAD_COLUMNS),
    ]


def corpus_scale_section(data: dict[str, Any]) -> Lines:
    rows = [
        [
            f"{run['utterances']:,}",
            "yes" if run.get("durations_listed") else "no",
            fmt(run.get("shard_size"), 0),
            secs(run["first_shard_submitted_s"]),
            fmt(run["driver_peak_rss_mb"], 0, " MB"),
            secs(run["merge_s"]),
            fmt(run["merge_peak_rss_mb"], 0, " MB"),
            secs(run["resume_s"]),
            f"{fmt(run['audio_s_per_s'], 0)} / {fmt(run['plain_loop_audio_s_per_s'], 0)}",
            fmt(run["ratio_to_plain_loop"], 2),
        ]
        for run in data["runs"]
    ]
    header = ["utterances", "utt2dur", "shard size", "first shard", "driver RSS", "merge", "merge RSS"]
    return [
        "## Corpus scale",
        "",
        f"`python -m benchmarks.corpus_scale`: a Kaldi dir of N utterances over {data['distinct_clips']} "
        f"distinct short clips, ops {data['ops']}, {data['workers']} local workers, tiny stand-ins; the "
        "plain loop is 2 processes over the same clips, in the same run.",
        "",
        *table([*header, "resume", "audio s/s: voxmill / plain loop", "ratio"], rows),
    ]


def storage_section(data: dict[str, Any]) -> Lines:
    rows = [
        [name, fmt(v["audio_s_per_s_median"], 0), fmt(v["ratio_to_local"], 3)]
        for name, v in data["variants"].items()
    ]
    return [
        "## Storage",
        "",
        f"`python -m benchmarks.storage`: {data['clips']} clips "
        f"({fmt(data['audio_seconds'], 0)} s of audio), "
        f"{data['workers']} workers, {data['models']}; local files, local tar shards, and a loopback S3 "
        "server (moto) for the input (`s3-in`) or the input and the outputs (`s3`).",
        "",
        *table(["variant", "audio s/s", "ratio to local files"], rows),
    ]


def latency_section(data: dict[str, Any]) -> Lines:
    first = next(iter(data["settings"].values()))
    delays = sorted(first, key=lambda name: -1.0 if name == "local" else float(name.strip("+ ms")))
    rows = [
        [name, *(f"{fmt(by[d]['audio_s_per_s'], 0)} ({fmt(by[d]['ratio_to_local'], 2)})" for d in delays)]
        for name, by in data["settings"].items()
    ]
    cpu = [
        [name, *(fmt(by[d]["worker_cpu_ms_per_clip_over_local"], 2) for d in delays[1:])]
        for name, by in data["settings"].items()
    ]
    gains = ", ".join(f"{d} {fmt(x, 2)}×" for d, x in data["in_flight_over_one_at_a_time"].items())
    full = not data["models"].startswith("tiny")
    command = "python -m benchmarks.latency" + (" --models full" if full else "")
    return [
        "## Objects at real latency" + (", full-size models" if full else ""),
        "",
        f"`{command}`: {data['clips']} clips ({fmt(data['audio_seconds'], 0)} s of "
        f"audio), one object each on a loopback S3 server (moto) behind a proxy that delays every "
        f"response's first byte (each in a process of its own); `voxmill extract --ops {data['op']}`, "
        f"{data['workers']} workers, "
        f"{data['models']}, {data['repeats']} repeats; reads in flight ({data['reads_in_flight']} at "
        "once) against one read at a time. Audio s/s (ratio to the same clips on local disk):",
        "",
        *table(["reads", *delays], rows),
        f"Reads in flight against one at a time: {gains}. Worker CPU per clip over local files (ms):",
        "",
        *table(["reads", *delays[1:]], cpu),
    ]


def outputs_section(data: dict[str, Any]) -> Lines:
    settings = data["settings"]
    variants = list(dict.fromkeys(v for by in settings.values() for v in by))
    rows = [
        [variant, *(
            f"{fmt(by[variant]['wall_s'], 2)} s ({fmt(by[variant]['wall_over_local'], 2)}×), merge "
            f"{fmt(by[variant]['merge_s'], 2)} s" if variant in by else "—"
            for by in settings.values()
        )]
        for variant in variants
    ]  # fmt: skip
    full = not data["models"].startswith("tiny")
    delays = ",".join(f"{d:g}" for d in data["delays_ms"])
    command = (
        f"python -m benchmarks.latency --outputs --clips {data['clips']} --repeats {data['repeats']} "
        f"--delays {delays}" + (" --models full" if full else "")
    )
    return [
        "## Outputs in a bucket" + (", full-size models" if full else ""),
        "",
        f"`{command}`: {data['clips']} local clips ({fmt(data['audio_seconds'], 0)} s of audio), "
        f"`voxmill extract --ops {data['op']}`, {data['workers']} workers, {data['models']}; the outputs "
        "to a local folder, then to a bucket on a loopback S3 server (moto) behind a proxy that delays "
        f"every response's first byte (each in a process of its own). Workers with shard files "
        "uploaded behind their tasks "
        f"(`uploads_behind: {data['uploads_behind']}`) and by their tasks (`uploads_behind: 0`). The "
        "driver reads the shard objects announced done and keeps them for the merge, which reads the "
        "rest ahead; the serial merge's driver keeps none and its merge reads them one after another "
        "(`reads_in_flight: 1`, `read_ahead_bytes: 0`). Whole run's wall time (over the local outputs' "
        "with the same workers), the merge's:",
        "",
        *table(["outputs", *settings], rows),
    ]


def get_cpu_section(data: dict[str, Any]) -> Lines:
    rows = [
        [name, f"{fmt(by['median'], 3)} ({fmt(min(by['runs']), 3)}–{fmt(max(by['runs']), 3)})"]
        for name, by in data["cpu_ms_per_get"].items()
    ]
    return [
        "## CPU per S3 GET",
        "",
        f"`python -m benchmarks.get_cpu --objects {data['objects']} --kb {data['object_kb']}`: "
        f"{data['objects']} objects of {data['object_kb']} KB read from a loopback S3 server (moto, "
        "in a process of its own) behind a proxy that keeps connections open as a store does; the "
        f"reader's CPU per GET, {data['repeats']} repeats in alternating order. `voxmill`: the "
        "signed GETs of `pipeline.storage.s3_get`, one after another; `voxmill, read ahead`: the "
        "same as a shard task reads, shards of 32 read ahead 8 at once; `s3fs`: the SDK path "
        "voxmill falls back to; `botocore`: the SDK's own synchronous client.",
        "",
        *table(["reader", "CPU ms per GET"], rows),
    ]


def shard_sizing_section(data: dict[str, Any]) -> Lines:
    rows = [
        [name, str(run["shard_size"]), f"{run['shards']:,}", fmt(run["audio_s_per_s"], 0),
         fmt(run["ratio_to_plain_loop"], 3) + _ratio_range(run.get("ratios_to_plain_loop", []))]
        for name, run in (("count (32)", data["before"]), ("from the files' headers", data["after"]))
    ]  # fmt: skip
    return [
        "## Shards sized without listed durations",
        "",
        f"`python -m benchmarks.shard_sizing --utterances {data['utterances']}"
        f"{_repeats(data['after'])}`: a Kaldi dir without "
        f"`utt2dur` of {data['utterances']:,} short clips ({fmt(data['audio_s'] / data['utterances'], 2)} s "
        f"on average), `voxmill extract --ops {','.join(data['ops'])}`, {data['workers']} workers, tiny "
        f"stand-ins, against the {data['workers']}-process plain loop "
        f"({fmt(data['plain_loop']['audio_s_per_s'], 0)} audio s/s{_plain_walls(data['plain_loop'])}).",
        "",
        *table(["shard size", "utterances per shard", "shards", "audio s/s", "ratio to plain loop"], rows),
    ]


def _plain_walls(plain: dict[str, Any]) -> str:
    """The plain loop's runs around the sized ones, where there were several."""
    walls = plain["wall_s"]
    if not isinstance(walls, list):
        return ""
    runs = ", ".join(f"{fmt(w, 1)} s" for w in walls)
    return f"; runs of {runs}, one on each side of every sized run, which is measured against their mean"


def _repeats(run: dict[str, Any]) -> str:
    runs = len(run.get("ratios_to_plain_loop", []))
    return f" --repeats {runs}" if runs > 1 else ""


def _ratio_range(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return ""
    return f" ({fmt(min(ratios), 3)}–{fmt(max(ratios), 3)} over {len(ratios)} runs)"


BATCHING_COLUMNS = ["corpus", "clips", "audio s", "off", "on", "on / off", "target", "same tokens", "batches"]


def batching_section(data: dict[str, Any]) -> Lines:
    rows = [
        [name, f"{part['clips']:,}", fmt(part["audio_s"], 0), fmt(part["off_audio_s_per_s"], 1),
         fmt(part["on_audio_s_per_s"], 1), fmt(part["ratio_on_to_off"], 3),
         f"≥ {part['target']}", "yes" if part["tokens_identical"] else "NO",
         ", ".join(f"{n}×{size}" for size, n in part["batch_sizes"].items()) or "none"]
        for name, part in (("short (1–3 s)", data["short"]), ("mixed (1–25 s)", data["mixed"]))
    ]  # fmt: skip
    jobs = data["single_jobs"]
    machine = data["machine"]
    cpu = machine["cpu_model"] + (f" ({machine['cpu_features']})" if "cpu_features" in machine else "")
    return [
        "## Batched tokens",
        "",
        f"`python -m benchmarks.batching`: `voxmill extract --ops tokenize`, {data['workers']} workers, "
        f"{data['models']} stand-ins (the tokenizer and its batch twin), `batch_tokenize` auto with "
        "`batch_max_clip_s: 3` (the CPU's opt-in rule: clips up to 3 s, sorted 128 at a time into batches "
        "of up to 8 rows; by default the CPU batches nothing) against off, back to back in alternating "
        f"order; audio s/s and the ratio on / off; batch sizes as batches × rows. CPU: {cpu}.",
        "",
        *table(BATCHING_COLUMNS, rows),
        "Single jobs through `Client` (a 2 s clip, tokenize, one at a time): p50 "
        f"{fmt(jobs['auto']['p50_ms'], 1)} ms with batching on, {fmt(jobs['off']['p50_ms'], 1)} ms off "
        f"({fmt(jobs['ratio_on_to_off_p50'], 3)}; target ≤ 1.10). Each worker also loads the batch file "
        "at start, which a short run feels most (CHANGELOG 30 has smaller corpora).",
        "",
    ]


def speech_check_section(data: dict[str, Any]) -> Lines:
    clip = data["per_clip"]
    rows = [[op, fmt(clip[op]["ms_per_audio_s"], 3)] for op in ("speech", "embed", "tokenize")]
    runs = [[op, *on_off_cells(run)] for op, run in data["whole_run"].items()]
    return [
        f"## Speech check ({data['profile']} models)",
        "",
        f"`python -m benchmarks.speech_check`: {data['corpus']['clips']} clips, "
        f"{fmt(data['corpus']['audio_s'], 0)} s; the detector against each op, per clip, in-process. "
        f"Speech check / embed: {pct(clip['speech_vs_embed'])}; "
        f"/ tokenize: {pct(clip['speech_vs_tokenize'])}.",
        "",
        *table(["stage", "ms per audio second"], rows),
        f"Whole in-process runs over the clips, the check off and on, interleaved, {data['repeats']} "
        "repeats each; the overhead from the best run of each, and from the medians.",
        "",
        *table(["op", "check off", "check on", "overhead", "overhead of medians"], runs),
        *speech_check_extract_lines(data.get("extract")),
    ]


def on_off_cells(run: dict[str, Any]) -> list[str]:
    """A speech-check comparison's walls off and on, and its overheads (`speech_check.on_off`)."""
    walls = [secs(run["wall_s_off"]), secs(run["wall_s_on"])]
    return [*walls, pct(run["overhead"]), pct(run["overhead_of_medians"])]


def speech_check_extract_lines(extract: dict[str, Any] | None) -> Lines:
    if not extract:
        return []
    ops = [op for op in ("embed", "tokenize") if op in extract]
    rows = [[op, *on_off_cells(extract[op]), pct(extract[op]["speech_share_of_worker_time"])] for op in ops]
    corpus = extract["corpus"]
    return [
        f"`voxmill extract` over the main benchmark corpus ({corpus['clips']} clips, "
        f"{corpus['audio_s'] / 60:.1f} min, mixed formats and rates), one op, {extract['workers']} local "
        f"workers, whole processes timed from outside, the check off and on interleaved, "
        f"{extract['repeats']} repeats each; the detector's share of the workers' process-seconds from "
        "the worker trace.",
        "",
        *table(["op", "check off", "check on", "overhead", "overhead of medians", "detector share"], rows),
    ]


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], Lines]]] = [
    ("limit-vs-voxmill", main_section),
    ("scaling", scaling_section),
    ("coldstart", coldstart_section),
    ("memory", memory_section),
    ("memory-lengths", memory_lengths_section),
    ("queue-overhead", queue_section),
    ("corpus-throughput", throughput_section),
    ("core", core_section),
    ("corpus-scale", corpus_scale_section),
    ("storage", storage_section),
    ("latency", latency_section),
    ("latency-full", latency_section),
    ("latency_outputs", outputs_section),
    ("latency_outputs-full", outputs_section),
    ("get-cpu", get_cpu_section),
    ("shard-sizing", shard_sizing_section),
    ("batching", batching_section),
    ("speech-check-full", speech_check_section),
]


def write_report(folder: Path, target: Path | None = None) -> Path:
    """Write BENCHMARKS.md (default: the repository root) from the results in `folder`."""
    target = target or ROOT / "BENCHMARKS.md"
    results = {name: data for name, _ in SECTIONS if (data := read_result(folder, name)) is not None}
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    lines = [
        "# voxmill benchmarks",
        "",
        f"Generated by `python -m benchmarks.run` from `{shown}/*.json`; do not edit by hand "
        "(`python -m benchmarks.run --report-only` rebuilds it). Medians over repeats (min–max). The history "
        "of the optimisations, with their measurements, is in [CHANGELOG.md](CHANGELOG.md).",
        "",
    ]
    if results:
        lines += machine_line(next(iter(results.values())))
    lines += targets_section(results)
    for name, render in SECTIONS:
        if name in results:
            lines += render(results[name]) + measured_line(results[name])
    target.write_text("\n".join(lines).rstrip() + "\n")
    return target
