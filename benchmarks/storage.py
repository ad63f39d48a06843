"""Where the corpus lives, side by side: local files, tar shards on local disk, and S3.

`python -m benchmarks.storage [--clips N] [--repeats R]`: one corpus of speech-like 16 kHz WAVs,
read by `workers.extract.extract_corpus` (op `extract`, shards of `PER_SHARD` clips, tars of
the same clips) with the tiny stand-in models and 2 local worker processes started once, in
rounds that interleave the variants:

- `local`: a JSONL manifest of local paths, outputs to a local folder (the baseline);
- `tar-local`: the same clips as WebDataset tar shards in a local folder, outputs local;
- `s3-in`: the manifest names `s3://` URLs on a loopback S3 server (moto in server mode),
  outputs local: what reading through the store costs;
- `s3`: `s3://` URLs in, outputs to `s3://` (plan, shard objects, merge): no shared disk at all.

Reported per variant: audio seconds per wall second (median of the repeats, `report.json`'s
audio over its wall time) and its ratio to `local`; for the S3 variants, the requests the server
answered by kind (GET, HEAD, PUT, LIST) per run, and the time one worker-like loop spends
fetching each clip (HEAD + GET) against reading the file. Writes benchmarks/results/storage.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import logging
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.outputs.folder import RunFolder

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "storage.json"
PER_SHARD = 10
VARIANTS = ("local", "tar-local", "s3-in", "s3")
BUCKET = "bench"


class _RequestCounter(logging.Handler):
    """Counts the requests the moto server logs (werkzeug's access lines), by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for method in ("GET", "HEAD", "PUT", "POST", "DELETE"):
            if f'"{method} ' in text:
                kind = "LIST" if method == "GET" and "list-type=" in text else method
                self.counts[kind] += 1
                return


def _make_corpus(folder: Path, clips: int) -> list[dict[str, Any]]:
    import numpy as np
    import soundfile as sf

    from pipeline.demo import speechlike

    rng = np.random.default_rng(5)
    entries = []
    for index in range(clips):
        spk = f"spk{index % 8}"
        seconds = float(rng.uniform(2.0, 6.0))
        wave = speechlike(seconds, 16000, 100.0 + 15.0 * (index % 8), seed=index)
        path = folder / spk / f"utt{index:05d}.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, wave, 16000, subtype="PCM_16")
        entries.append({"utt": f"{spk}/utt{index:05d}", "spk": spk, "file": path})
    return entries


def _tars(entries: list[dict[str, Any]], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(0, len(entries), PER_SHARD):
        with tarfile.open(folder / f"{number // PER_SHARD:06d}.tar", "w") as tar:
            for entry in entries[number : number + PER_SHARD]:
                meta = json.dumps({"speaker": entry["spk"]}).encode()
                info = tarfile.TarInfo(f"{entry['utt']}.json")
                info.size = len(meta)
                tar.addfile(info, io.BytesIO(meta))
                tar.add(entry["file"], arcname=f"{entry['utt']}.wav")


def _manifest(path: Path, entries: list[dict[str, Any]], where: str) -> Path:
    lines = []
    for entry in entries:
        audio = f"s3://{BUCKET}/audio/{entry['utt']}.wav" if where == "s3" else str(entry["file"])
        lines.append(json.dumps({"utt": entry["utt"], "spk": entry["spk"], "path": audio}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _fetch_costs(entries: list[dict[str, Any]], limit: int = 60) -> dict[str, float]:
    """Per clip: reading the file vs HEAD + GET of its object, in this process, milliseconds."""
    from pipeline.storage import objects

    sample = entries[:limit]
    started = time.perf_counter()
    for entry in sample:
        Path(entry["file"]).read_bytes()
    local_ms = (time.perf_counter() - started) * 1000 / len(sample)
    started = time.perf_counter()
    for entry in sample:
        url = f"s3://{BUCKET}/audio/{entry['utt']}.wav"
        objects.url_size(url)
        head_done = time.perf_counter()
        objects.read_url(url)
    total_ms = (time.perf_counter() - started) * 1000 / len(sample)
    head_ms = 0.0
    for entry in sample[:20]:
        t0 = time.perf_counter()
        objects.url_size(f"s3://{BUCKET}/audio/{entry['utt']}.wav")
        head_ms += (time.perf_counter() - t0) * 1000
    del head_done
    return {
        "local_read_ms_per_clip": round(local_ms, 3),
        "s3_head_plus_get_ms_per_clip": round(total_ms, 3),
        "s3_head_ms": round(head_ms / 20, 3),
    }


def _self_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from moto.server import ThreadedMotoServer

    from pipeline.models.standin import make_standins
    from pipeline.settings import Settings
    from pipeline.storage import objects
    from workers.embedded import EmbeddedRedis, LocalWorkers, free_port
    from workers.extract import extract_corpus

    counter = _RequestCounter()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(counter)
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    work = Path(tempfile.mkdtemp(prefix="voxmill-bench-storage-"))
    redis_server = EmbeddedRedis()
    workers = None
    try:
        print(f"making {args.clips} clips in {work}", file=sys.stderr)
        entries = _make_corpus(work / "audio", args.clips)
        _tars(entries, work / "tars")
        fs = objects.filesystem("s3")
        fs.mkdir(BUCKET)
        for entry in entries:
            fs.put_file(str(entry["file"]), f"{BUCKET}/audio/{entry['utt']}.wav")
        manifests = {"local": _manifest(work / "local.jsonl", entries, "local")}
        manifests["s3"] = _manifest(work / "s3.jsonl", entries, "s3")
        models = work / "models"
        make_standins(models, profile="tiny", seed=0)
        redis_server.start()
        settings = Settings(
            broker_url=redis_server.url,
            model_dir=models,
            allowed_roots=(work, f"s3://{BUCKET}"),
            provider="cpu",
            speech_check=False,
            run_state_dir=work / "state",
        )
        workers = LocalWorkers(settings, 2, ["extract"], log_path=work / "workers.log").start()
        workers.wait_ready(180)
        audio_s = 0.0
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else reversed(VARIANTS):
                source: Path | str = {
                    "local": manifests["local"],
                    "tar-local": work / "tars",
                    "s3-in": manifests["s3"],
                    "s3": manifests["s3"],
                }[variant]
                out = RunFolder.of(
                    f"s3://{BUCKET}/out-{repeat}/" if variant == "s3" else work / f"out-{variant}-{repeat}"
                )
                counter.counts.clear()
                started, cpu_before = time.monotonic(), _self_cpu_s()
                report = extract_corpus(
                    settings, source, out, ["extract"], 2, PER_SHARD, quiet=True
                ).to_dict()
                wall = time.monotonic() - started
                # This process holds the driver and the S3 server's threads: with S3, most of it is
                # the server answering requests, on the same two cores as the workers.
                cpu = _self_cpu_s() - cpu_before
                audio_s = report["audio_seconds"]
                requests = dict(counter.counts)
                runs[variant].append(
                    {
                        "wall_s": round(wall, 3),
                        "audio_s_per_s": round(audio_s / wall, 2),
                        "requests": requests,
                        "driver_and_s3_server_cpu_s": round(cpu, 3),
                        "failed": report["ops"]["extract"]["failed"],
                    }
                )
                print(
                    f"round {repeat} {variant}: {audio_s / wall:.1f} audio s/s "
                    f"({wall:.2f} s, this process {cpu:.2f} s CPU) {requests}"
                )
                if isinstance(out, Path):
                    shutil.rmtree(out, ignore_errors=True)
        base = statistics.median(r["audio_s_per_s"] for r in runs["local"])
        table = {}
        for variant, found in runs.items():
            rate = statistics.median(r["audio_s_per_s"] for r in found)
            table[variant] = {
                "audio_s_per_s_median": round(rate, 2),
                "ratio_to_local": round(rate / base, 4),
                "runs": found,
            }
        result = {
            "benchmark": "storage",
            "clips": args.clips,
            "audio_seconds": round(audio_s, 1),
            "per_shard": PER_SHARD,
            "workers": 2,
            "models": "tiny stand-ins",
            "variants": table,
            "fetch_costs": _fetch_costs(entries),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(
            json.dumps(
                {v: {k: t[k] for k in ("audio_s_per_s_median", "ratio_to_local")} for v, t in table.items()}
            )
        )
        return 0
    finally:
        if workers is not None:
            workers.stop()
        redis_server.stop()
        server.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
