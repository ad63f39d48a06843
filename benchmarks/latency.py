"""A store at real latency: per-clip objects read through a delaying proxy, reads in flight on and off.

    python -m benchmarks.latency                     # 600 clips, +0/+20/+50 ms, 2 repeats
    python -m benchmarks.latency --clips 200 --repeats 2 --delays 0,50 --out /tmp/latency.json

One corpus of speech-like clips of 1-3 s (`benchmarks.corpus`, mixed formats), each stored as one
object on a loopback S3 server (moto in server mode) behind `benchmarks.delay_proxy`, which holds
the first byte of every answer until N ms after its request (a remote store's time to first byte).
Whole `voxmill extract --ops embed` runs (`workers.extract.extract_corpus`, as the command runs
it) with the tiny stand-in models (so the data path is what is measured; `--models full`: the
full-size CAM++ stand-in, the issue's target, writes latency-full.json), speech check off, 2
local worker processes; outputs to a local folder. The workers are started twice: with reads in
flight (the default `reads_in_flight`) and without (`reads_in_flight=1`); with each, in
alternating rounds, the same clips from local disk, then from the store at each delay.

With `--outputs`, the inputs are local short clips (0.5-1.5 s) and the outputs go to a local
folder, then to the bucket (behind the proxy) at each delay; the workers are started twice: with
shard files uploaded behind their tasks (the default `uploads_behind`) and by their tasks
(`uploads_behind=0`); with the first, also a run at the longest delay whose driver keeps no shard
file it looked for and whose merge reads the shard objects one after another (`reads_in_flight=1`,
`read_ahead_bytes=0`, given to the driver only: local inputs are never read ahead). Per variant
the whole run's wall time, the merge's, and the ratio to local outputs measured with the same
workers. Writes benchmarks/results/latency_outputs.json
(latency_outputs-full.json with `--models full`).

    python -m benchmarks.latency --outputs --clips 2000 --repeats 2 --delays 0,20

Reported per variant: audio seconds per wall second (median of the repeats), its ratio to local
disk (measured back to back with the same workers) and to the same variant at +0 ms, the wall time
each clip adds per worker process over local disk, and the workers' CPU per clip (the difference
to local disk is the CPU one GET costs). The S3 server and the proxy run in processes of their
own (`benchmarks.common.s3_server`, `benchmarks.delay_proxy.ProxyProcess`): the driver, in this
process, shares no interpreter with them, as with a remote store; they share the cores with the
workers (the difference also holds what sharing them costs: caches, wake-ups).
Writes benchmarks/results/latency.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import RESULTS_DIR, load_average, log, s3_server, write_result
from benchmarks.corpus import Clip, CorpusRecipe, make_corpus, make_models
from benchmarks.delay_proxy import ProxyProcess

BUCKET = "latency"
OUT_BUCKET = "latency-out"
WORKERS = 2


def _tree_cpu_s(pid: int) -> float:
    """User + system seconds of a process and its descendants."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _manifest(path: Path, clips: list[Clip], where: str) -> Path:
    lines = []
    for clip in clips:
        audio = f"s3://{BUCKET}/{clip.utt}{Path(clip.path).suffix}" if where == "s3" else clip.path
        lines.append(json.dumps({"utt": clip.utt, "spk": clip.spk, "path": audio}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _variant_table(runs: dict[str, list[dict[str, Any]]], clips: int) -> dict[str, Any]:
    """Medians, ratios and per-clip costs of one worker setting's runs (`local`, `+N ms`...)."""
    table: dict[str, Any] = {}
    local = runs["local"]
    local_rate = statistics.median(r["audio_s_per_s"] for r in local)
    local_wall = statistics.median(r["wall_s"] for r in local)
    local_cpu = statistics.median(r["worker_cpu_s"] for r in local)
    base_rate = statistics.median(r["audio_s_per_s"] for r in runs.get("+0 ms", local))
    for variant, found in runs.items():
        rate = statistics.median(r["audio_s_per_s"] for r in found)
        wall = statistics.median(r["wall_s"] for r in found)
        cpu = statistics.median(r["worker_cpu_s"] for r in found)
        table[variant] = {
            "audio_s_per_s": round(rate, 2),
            "ratio_to_local": round(rate / local_rate, 4),
            "ratio_to_plus0": round(rate / base_rate, 4) if variant != "local" else None,
            "wall_ms_added_per_clip_per_worker": round((wall - local_wall) * 1000 * WORKERS / clips, 3),
            "worker_cpu_ms_per_clip": round(cpu * 1000 / clips, 3),
            "worker_cpu_ms_per_clip_over_local": round((cpu - local_cpu) * 1000 / clips, 3),
            "runs": found,
        }
    return table


def _rounds(
    settings: Any,
    workers_pid: int,
    proxy: ProxyProcess,
    manifests: dict[str, Path],
    variants: list[str],
    repeats: int,
    work: Path,
) -> dict[str, list[dict[str, Any]]]:
    """Every variant `repeats` times, in rounds of alternating order: wall, rate and worker CPU."""
    from pipeline.outputs.folder import RunFolder
    from workers.extract import extract_corpus

    # Unmeasured: each pool process imports the store's client and opens its session on first use.
    extract_corpus(settings, manifests["s3"], RunFolder.of(work / "warm-up"), ["embed"], WORKERS, 0, True)
    shutil.rmtree(work / "warm-up", ignore_errors=True)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(repeats):
        for variant in variants if repeat % 2 == 0 else reversed(variants):
            proxy.delay_ms = 0.0 if variant == "local" else float(variant[1:].split()[0])
            out = work / f"out-{settings.reads_in_flight}-{variant.replace(' ', '')}-{repeat}"
            source = manifests["local" if variant == "local" else "s3"]
            cpu_before, started = _tree_cpu_s(workers_pid), time.monotonic()
            report = extract_corpus(
                settings, source, RunFolder.of(out), ["embed"], WORKERS, 0, True
            ).to_dict()
            wall = time.monotonic() - started
            cpu = _tree_cpu_s(workers_pid) - cpu_before
            audio_s = report["audio_seconds"]
            runs[variant].append(
                {
                    "wall_s": round(wall, 3),
                    "audio_s": round(audio_s, 2),
                    "audio_s_per_s": round(audio_s / wall, 2),
                    "worker_cpu_s": round(cpu, 3),
                    "failed": report["ops"]["embed"]["failed"],
                }
            )
            rate, in_flight = audio_s / wall, settings.reads_in_flight
            log(f"in flight {in_flight} {variant}: {rate:.1f} audio s/s ({wall:.2f} s, {cpu:.2f} s CPU)")
            shutil.rmtree(out, ignore_errors=True)
    return runs


def _setup(
    name: str, clips: list[Clip], delays: list[float], repeats: int, in_flight: int, models: str = "tiny"
) -> dict[str, Any]:
    """What a result says about how it was measured."""
    return {
        "benchmark": name,
        "clips": len(clips),
        "audio_seconds": round(sum(c.duration_s for c in clips), 1),
        "delays_ms": delays,
        "repeats": repeats,
        "workers": WORKERS,
        "models": f"{models} stand-ins" if models == "tiny" else f"{models}-size stand-ins",
        "op": "embed",
        "reads_in_flight": in_flight,
    }


@contextlib.contextmanager
def _timed_merges(proxy: ProxyProcess) -> Iterator[list[tuple[float, int]]]:
    """(seconds, requests through `proxy`) of each merge meanwhile (the workers are idle then;
    `run_corpus` imports `merge_outputs` when it merges)."""
    from pipeline.outputs import merge as merge_module

    original, times = merge_module.merge_outputs, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        started, requests = time.perf_counter(), proxy.requests
        try:
            return original(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - started, proxy.requests - requests))

    merge_module.merge_outputs = timed
    try:
        yield times
    finally:
        merge_module.merge_outputs = original


def _output_variants(delays: list[float], serial_merge: bool) -> list[tuple[str, float]]:
    """(variant, delay ms): outputs local, then in the bucket at each delay (and, `serial_merge`,
    at the longest delay with the merge reading one shard object after another)."""
    variants = [("local", 0.0), *((f"bucket +{d:g} ms", d) for d in delays)]
    if serial_merge:
        variants.append((f"bucket, serial merge +{max(delays):g} ms", max(delays)))
    return variants


def _output_rounds(
    settings: Any,
    proxy: ProxyProcess,
    manifest: Path,
    variants: list[tuple[str, float]],
    repeats: int,
    work: Path,
) -> dict[str, list[dict[str, Any]]]:
    """Every output variant `repeats` times, in rounds of alternating order: wall and merge time."""
    from pipeline.outputs.folder import RunFolder
    from workers.extract import extract_corpus

    serial = settings.model_copy(update={"reads_in_flight": 1, "read_ahead_bytes": 0})
    extract_corpus(
        settings, manifest, RunFolder.of(f"s3://{OUT_BUCKET}/warm-up"), ["embed"], WORKERS, 0, True
    )
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v, _ in variants}
    behind = settings.uploads_behind
    for repeat in range(repeats):
        for variant, delay in variants if repeat % 2 == 0 else reversed(variants):
            proxy.delay_ms = delay
            name = f"{behind}-{variant.split(',')[-1].strip().replace(' ', '-')}-{repeat}"
            out = work / name if variant == "local" else f"s3://{OUT_BUCKET}/{name}"
            run_settings = serial if "serial" in variant else settings
            with _timed_merges(proxy) as merges:
                started = time.monotonic()
                report = extract_corpus(
                    run_settings, manifest, RunFolder.of(out), ["embed"], WORKERS, 0, True
                ).to_dict()
                wall = time.monotonic() - started
            merge_s, requests = (sum(m) for m in zip(*merges, strict=True))
            shards = len(RunFolder.of(out).shard_files())
            record = {"wall_s": round(wall, 3), "merge_s": round(merge_s, 3), "merge_requests": requests}
            runs[variant].append({**record, "shards": shards, "utts": report["utterances"]})
            log(f"uploads behind {behind}, {variant}: {wall:.2f} s, merge {merge_s:.3f} s ({shards} shards)")
    return runs


def _output_table(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median wall and merge time per variant; each one's wall time over local outputs'."""
    local_wall = statistics.median(r["wall_s"] for r in runs["local"])
    table: dict[str, Any] = {}
    for variant, found in runs.items():
        wall = statistics.median(r["wall_s"] for r in found)
        table[variant] = {
            "wall_s": round(wall, 3),
            "merge_s": round(statistics.median(r["merge_s"] for r in found), 3),
            "wall_over_local": round(wall / local_wall, 4),
            "runs": found,
        }
    return table


UPLOADS = {"uploads behind": None, "uploads in the task": 0}  # None: the default `uploads_behind`


def _outputs_benchmark(args: argparse.Namespace, delays: list[float], proxy: ProxyProcess, work: Path) -> int:
    """`--outputs`: local short clips, outputs local and in the bucket (module docstring)."""
    from pipeline.settings import Settings
    from pipeline.storage import objects
    from workers.embedded import EmbeddedRedis, LocalWorkers

    clips = make_corpus(CorpusRecipe("latency-outputs", args.clips, 0.5, 1.5, distribution="uniform"))
    manifest = _manifest(work / "local.jsonl", clips, "local")
    objects.filesystem("s3").mkdir(OUT_BUCKET)
    redis_server = EmbeddedRedis()
    redis_server.start()
    base = Settings(
        broker_url=redis_server.url,
        model_dir=make_models(args.models),
        allowed_roots=(Path(clips[0].path).parents[2], work, f"s3://{OUT_BUCKET}"),
        provider="cpu",
        speech_check=False,
        run_state_dir=work / "state",
    )
    tables: dict[str, Any] = {}
    try:
        for name, behind in UPLOADS.items():
            settings = base if behind is None else base.model_copy(update={"uploads_behind": behind})
            workers = LocalWorkers(settings, WORKERS, ["embed"], log_path=work / "workers.log").start()
            try:
                workers.wait_ready(180)
                variants = _output_variants(delays, serial_merge=behind is None)
                runs = _output_rounds(settings, proxy, manifest, variants, args.repeats, work)
            finally:
                workers.stop()
            tables[name] = _output_table(runs)
    finally:
        redis_server.stop()
    result = {
        **_setup("latency_outputs", clips, delays, args.repeats, base.reads_in_flight, args.models),
        "uploads_behind": base.uploads_behind,
        "settings": tables,
        "load_average": load_average(),
    }
    suffix = "" if args.models == "tiny" else f"-{args.models}"
    default = args.out == RESULTS_DIR / "latency.json"
    out = RESULTS_DIR / f"latency_outputs{suffix}.json" if default else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out.parent, out.stem, result)
    summary = {n: {v: (t["wall_s"], t["wall_over_local"]) for v, t in by.items()} for n, by in tables.items()}
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=600)
    parser.add_argument("--delays", default="0,20,50", help="ms added to each answer's first byte")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "latency.json")
    parser.add_argument(
        "--outputs", action="store_true", help="local short clips, outputs local vs in the bucket"
    )
    parser.add_argument(
        "--models", default="tiny", choices=("tiny", "full"), help="stand-ins (full: latency-full.json)"
    )
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.delays.split(",")]

    from pipeline.settings import Settings
    from pipeline.storage import objects
    from workers.embedded import EmbeddedRedis, LocalWorkers, free_port

    work = Path(tempfile.mkdtemp(prefix="voxmill-bench-latency-"))
    port = free_port()
    server = s3_server(port)
    proxy = ProxyProcess(port)
    os.environ.update(
        AWS_ENDPOINT_URL=proxy.url,  # the workers (started below) inherit it
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    if args.outputs:
        try:
            return _outputs_benchmark(args, delays, proxy, work)
        finally:
            proxy.stop()
            server.terminate()
            shutil.rmtree(work, ignore_errors=True)
    clips = make_corpus(CorpusRecipe("latency", args.clips, 1.0, 3.0, distribution="uniform"))
    models = make_models(args.models)
    if args.models != "tiny" and args.out == RESULTS_DIR / "latency.json":
        args.out = RESULTS_DIR / f"latency-{args.models}.json"
    redis_server = EmbeddedRedis()
    settings_by_name: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        fs = objects.filesystem("s3")
        fs.mkdir(BUCKET)
        for clip in clips:
            fs.put_file(clip.path, f"{BUCKET}/{clip.utt}{Path(clip.path).suffix}")
        manifests = {"local": _manifest(work / "local.jsonl", clips, "local")}
        manifests["s3"] = _manifest(work / "s3.jsonl", clips, "s3")
        redis_server.start()
        variants = ["local", *(f"+{d:g} ms" for d in delays)]
        default_in_flight = int(Settings.model_fields["reads_in_flight"].default)
        for name, in_flight in (("reads in flight", default_in_flight), ("one read at a time", 1)):
            settings = Settings(
                broker_url=redis_server.url,
                model_dir=models,
                allowed_roots=(Path(clips[0].path).parents[2], work, f"s3://{BUCKET}"),
                provider="cpu",
                speech_check=False,
                run_state_dir=work / "state",
                reads_in_flight=in_flight,
            )
            workers = LocalWorkers(settings, WORKERS, ["embed"], log_path=work / "workers.log").start()
            try:
                workers.wait_ready(180)
                assert workers.process is not None
                runs = _rounds(settings, workers.process.pid, proxy, manifests, variants, args.repeats, work)
            finally:
                workers.stop()
            settings_by_name[name] = runs
        tables = {name: _variant_table(runs, len(clips)) for name, runs in settings_by_name.items()}
        on, off = tables["reads in flight"], tables["one read at a time"]
        result = {
            **_setup("latency", clips, delays, args.repeats, default_in_flight, args.models),
            "settings": tables,
            "in_flight_over_one_at_a_time": {
                v: round(on[v]["audio_s_per_s"] / off[v]["audio_s_per_s"], 4) for v in on if v != "local"
            },
            "load_average": load_average(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out.parent, args.out.stem, result)
        summary = {
            n: {v: (t[v]["audio_s_per_s"], t[v]["ratio_to_local"]) for v in t} for n, t in tables.items()
        }
        print(json.dumps(summary))
        return 0
    finally:
        redis_server.stop()
        proxy.stop()
        server.terminate()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
