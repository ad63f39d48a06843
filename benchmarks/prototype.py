"""A drop-in variant of `voxmill extract` (embedded mode) that tries changes to
`workers/extract.py` and `workers/driver.py`, so that their gain is measured rather than guessed:

    python -m benchmarks.prototype MANIFEST --out DIR --ops tokenize --models M --workers 2
        [--order longest-first|plan] [--warm-stop] [--late-start] [--combine]

Adopted in `voxmill extract` (the options restore what it did before):
- longest-first submission (`--order plan`: the plan groups clips by length, so the run ended
  with one worker busy on the largest shard while the others waited);
- a fast stop once every shard file exists (`--warm-stop`: Celery's warm shutdown, about 3 s
  of waiting with nothing in flight);
- the workers started first (`--late-start`: plan, then start Redis and the workers, wait until
  they are ready, then submit; now the workers are spawned right after the corpus is read, the
  driver's imports and the probing overlap their start, and the shards wait in the queue).

Still a proposal:
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
    parser.add_argument("--late-start", action="store_true")
    parser.add_argument("--warm-stop", action="store_true")
    parser.add_argument("--combine", action="store_true")
    args = parser.parse_args()

    from pipeline.settings import Settings
    from workers.corpus.plan import lock_output, make_plan, read_utterances, reusable_plan
    from workers.corpus.run import EmbeddedRun, check_models

    marks: dict[str, float] = {"imported": time.time()}
    ops = args.ops.split(",")
    if args.combine and sorted(ops) == ["embed", "tokenize"]:
        ops = ["extract"]
    settings = Settings.load().model_copy(update={"model_dir": args.models})
    lock = lock_output(args.out)
    utts = read_utterances(args.source)
    resumed = reusable_plan(utts, args.out, ops, args.shard_size, settings)
    check_models(settings, ops)
    if args.order == "plan":
        import workers.corpus.driver

        workers.corpus.driver.longest_first = list  # type: ignore[assignment]  # the driver's old order
    n = args.workers
    local = EmbeddedRun(settings, utts, args.out, ops, n)
    try:
        if args.late_start:
            plan = resumed or make_plan(utts, args.source, args.out, ops, args.shard_size, settings, n)
            marks["planned"] = time.time()
            local.start(quiet=True)
            marks["cluster_started"] = time.time()
            local.workers.wait_ready()
            marks["ready"] = time.time()
        else:
            local.start(quiet=True)
            marks["cluster_started"] = time.time()
            plan = resumed or make_plan(utts, args.source, args.out, ops, args.shard_size, settings, n)
            marks["planned"] = time.time()
        if args.warm_stop:
            local.stop = lambda completed=False: EmbeddedRun.stop(local, completed=False)  # type: ignore[method-assign]
        report = local.run(plan, args.source, True, time.monotonic() - (time.time() - STARTED))
        marks["merged"] = time.time()
    finally:
        local.stop()
        marks["stopped"] = time.time()
        lock.close()
    timeline = {k: round(v - STARTED, 3) for k, v in marks.items()}
    print(json.dumps({"timeline_s": timeline, "utterances": report["utterances"]}))


if __name__ == "__main__":
    main()
