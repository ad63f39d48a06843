"""`python -m workers.worker`: the Celery worker that local clusters start (`voxmill extract`
without a broker, `voxmill up`). The same worker as `voxmill worker`, without the command line's
own imports (Typer, Rich) or Celery's: every local run waits for this process to start.

    python -m workers.worker -Q tokenize,embed -c 2 [--pool prefork] [-l INFO] [-n NAME]
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("-Q", "--queues", default="tokenize,embed,extract", help="queues, comma-separated")
    parser.add_argument("-c", "--concurrency", type=int, default=1, help="pool processes")
    parser.add_argument("--pool", default="prefork", help="prefork | solo | threads")
    parser.add_argument("-l", "--loglevel", default="INFO")
    parser.add_argument("-n", "--hostname", default="", help="Celery node name (default celery@HOST)")
    args = parser.parse_args(argv)

    # Importing creates many objects and no garbage: no collections until the worker's imports
    # are done (about 5 % of its start); `install_worker_hooks` freezes what they made and turns
    # the collector back on before the pool forks.
    gc.disable()
    from workers.app import app, start_worker

    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    return start_worker(app, queues, args.concurrency, args.pool, args.loglevel, args.hostname)


if __name__ == "__main__":
    sys.exit(main())
