"""A reader's CPU per S3 GET: voxmill's signed GETs against the SDK paths, the same objects.

    python -m benchmarks.get_cpu                     # 300 objects of 40 KB, 3 repeats
    python -m benchmarks.get_cpu --objects 200 --kb 200

moto's S3 server runs in a process of its own (its CPU is not counted), on loopback, behind
`benchmarks.delay_proxy` (+0 ms; in a process of its own too), which keeps connections open for
the next request as a store does (moto's server closes each one). This process reads every
object and counts its own CPU (user + system, all threads) per GET, for: `voxmill`
(`pipeline.storage.objects.read_url`, one after another: `pipeline.storage.s3_get`'s signed
GETs), `voxmill, read ahead` (as a shard task reads: shards of 32 objects, each read ahead by
`pipeline.audio.sources.prefetch_clips`, 8 in flight), `s3fs` (the SDK path voxmill falls back
to: s3fs's `get_object` on fsspec's loop) and `botocore` (botocore's own synchronous client).
Rounds alternate the order. Writes benchmarks/results/get-cpu.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, load_average, log, s3_server, write_result
from benchmarks.delay_proxy import ProxyProcess

BUCKET = "get-cpu"
SHARD = 32  # objects per shard task, as a corpus of short clips without durations is cut at first


def _cpu_per_get_ms(read: Callable[[list[str]], None], keys: list[str]) -> float:
    read(keys[:SHARD])  # connections, threads and a client made before counting
    started = time.process_time()
    read(keys)
    return (time.process_time() - started) / len(keys) * 1000


def _one_by_one(read: Callable[[str], Any]) -> Callable[[list[str]], None]:
    def read_all(keys: list[str]) -> None:
        for key in keys:
            read(key)

    return read_all


def _read_ahead(keys: list[str]) -> None:
    """As a shard task reads its clips: shards of SHARD objects, each read ahead of its consumer."""
    from pipeline.audio.sources import prefetch_clips
    from pipeline.settings import AudioLimits
    from pipeline.storage.prefetch import ReadAhead

    for first in range(0, len(keys), SHARD):
        urls: list[str | None] = [f"s3://{BUCKET}/{key}" for key in keys[first : first + SHARD]]
        for fetched in prefetch_clips(urls, AudioLimits(), ReadAhead()):
            assert fetched is not None
            fetched.open()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=300)
    parser.add_argument("--kb", type=int, default=40, help="size of each object")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "get-cpu.json")
    args = parser.parse_args(argv)

    from workers.embedded import free_port

    port = free_port()
    server = s3_server(port)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    proxy: ProxyProcess | None = None
    try:
        import botocore.session

        from pipeline.storage import objects, urls

        client = botocore.session.get_session().create_client("s3")
        client.create_bucket(Bucket=BUCKET)  # the server accepts connections (`s3_server`)
        keys = [f"o{n:05d}" for n in range(args.objects)]
        for key in keys:
            client.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(args.kb * 1024))
        proxy = ProxyProcess(port)
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        client = botocore.session.get_session().create_client("s3")
        readers: dict[str, Callable[[list[str]], None]] = {
            "voxmill": _one_by_one(lambda key: objects.read_url(f"s3://{BUCKET}/{key}")),
            "voxmill, read ahead": _read_ahead,
            "s3fs": _one_by_one(
                lambda key: objects._s3_sdk_get(urls.parse_url(f"s3://{BUCKET}/{key}"), None, None)
            ),
            "botocore": _one_by_one(lambda key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read()),
        }
        runs: dict[str, list[float]] = {name: [] for name in readers}
        for repeat in range(args.repeats):
            order = list(readers) if repeat % 2 == 0 else list(reversed(readers))
            for name in order:
                runs[name].append(round(_cpu_per_get_ms(readers[name], keys), 4))
                log(f"get cpu: {name}: {runs[name][-1]:.3f} ms per GET")
        direct = objects._direct_s3()
        assert direct is not None and direct.usable(BUCKET), "voxmill's reads went to the SDK"
    finally:
        if proxy is not None:
            proxy.stop()
        server.terminate()
        server.wait(timeout=10)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {
        "benchmark": "get-cpu",
        "objects": args.objects,
        "object_kb": args.kb,
        "repeats": args.repeats,
        "cpu_ms_per_get": {name: {"median": medians[name], "runs": runs[name]} for name in runs},
        "load_average": load_average(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out.parent, args.out.stem, result)
    print({name: round(value, 3) for name, value in medians.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
