"""A drop-in variant of `voxmill extract` (embedded mode) that tries changes to
`workers/driver.py`, so that their gain is measured rather than guessed:

    python -m benchmarks.prototype MANIFEST --out DIR --ops tokenize --models M --workers 2
        [--order longest-first|plan] [--warm-stop] [--overlap] [--combine]

Adopted in `voxmill extract` (measured here against what it did before):
- longest-first submission (`--order plan` restores the old order: the plan groups clips by
  length, so the run ended with one worker busy on the largest shard while the others waited);
- a fast stop once every shard is merged (`--warm-stop` restores Celery's warm shutdown, about
  3 s of waiting with nothing in flight).

Still proposals:
- `--overlap`: start the embedded Redis and the workers before probing the corpus, so model
  loading overlaps planning;
- `--combine`: with `--ops tokenize,embed`, plan `extract` shards (on the `extract` queue), so
  each utterance is decoded once and runs through both models in one task (the shard files and
  the merge already handle the `extract` op; `report.json` then counts op `extract`).

Without options it does what `extract_corpus` does, in the same order. It prints a JSON line with
the timeline of its phases (seconds since the interpreter started).
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", default="tokenize,embed")
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--shard-size", type=int, default=0)
    parser.add_argument("--order", choices=("plan", "longest-first"), default="longest-first")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--warm-stop", action="store_true")
    parser.add_argument("--combine", action="store_true")
    args = parser.parse_args()

    from pipeline.corpus import read_corpus
    from pipeline.records import Utterance
    from pipeline.settings import Settings
    from workers.app import create_app
    from workers.driver import Plan, check_models, corpus_roots, load_or_make_plan, lock_output, run_corpus
    from workers.embedded import EmbeddedRedis, LocalWorkers

    marks: dict[str, float] = {"imported": time.time()}
    ops = args.ops.split(",")
    if args.combine and sorted(ops) == ["embed", "tokenize"]:
        ops = ["extract"]
    settings = Settings.load().model_copy(update={"model_dir": args.models})
    shard_size = args.shard_size or settings.shard_size
    lock = lock_output(args.out)
    check_models(settings, ops)

    def start_cluster(utts: list[Utterance]) -> tuple[EmbeddedRedis, LocalWorkers, Settings]:
        stub = Plan("", str(args.source), ops, shard_size, [], [])
        roots = (*settings.allowed_roots, *corpus_roots(stub, args.out))
        folders = sorted({Path(u.path).parent for u in utts})
        roots = (*roots, *folders)
        embedded = EmbeddedRedis().start()
        local = settings.model_copy(update={"broker_url": embedded.url, "allowed_roots": roots})
        cluster = LocalWorkers(local, args.workers, queues=ops, log_path=args.out / "workers.log").start()
        marks["cluster_started"] = time.time()
        return embedded, cluster, local

    cluster_parts = start_cluster(read_corpus(args.source)) if args.overlap else None
    plan = load_or_make_plan(args.source, args.out, ops, shard_size, settings)
    marks["planned"] = time.time()
    if cluster_parts is None:
        cluster_parts = start_cluster(plan.utterances())
    embedded, cluster, local = cluster_parts
    if args.order == "plan":
        import workers.driver

        workers.driver.longest_first = list  # type: ignore[assignment]  # the driver's old order
    try:
        cluster.wait_ready()
        marks["ready"] = time.time()
        report = run_corpus(
            create_app(local), local, plan, args.out, True, {"input": str(args.source)}, STARTED
        )
        marks["merged"] = time.time()
    finally:
        cluster.stop(timeout_s=5.0 if args.warm_stop else 0.0)
        embedded.stop()
        marks["stopped"] = time.time()
        lock.close()
    timeline = {k: round(v - STARTED, 3) for k, v in marks.items()}
    print(json.dumps({"timeline_s": timeline, "utterances": report["utterances"]}))


if __name__ == "__main__":
    main()
