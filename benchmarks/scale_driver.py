"""One `voxmill extract` run in this process, with the coordinator's costs recorded.

    python -m benchmarks.scale_driver SOURCE --out DIR --models M --ops embed,tokenize --workers 2

Prints one JSON line: seconds from the start of this process to the first shard submitted and to
the end of planning, the driver's peak RSS before the merge, the merge's seconds and peak RSS
(the peak is reset before it: /proc/self/clear_refs), the whole run's seconds, and the report.
The run itself is `workers.extract.extract_corpus`, unchanged: the wrappers only take times.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM becomes the current RSS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--ops", default="embed")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    import pipeline.run.driver as driver
    import workers.extract as run
    from pipeline.outputs.folder import RunFolder
    from pipeline.settings import Settings

    marks: dict[str, Any] = {}
    submit = driver.CorpusDriver._submit

    def timed_submit(self: Any, spec: Any, *args: Any, **kwargs: Any) -> None:
        marks.setdefault("first_shard_submitted_s", round(time.time() - STARTED, 3))
        submit(self, spec, *args, **kwargs)

    from pipeline.outputs import merge as merge_module

    original_merge = merge_module.merge_outputs

    def timed_merge(*merge_args: Any, **kwargs: Any) -> Any:
        marks["driver_peak_rss_mb"] = round(peak_rss_mb(), 1)
        reset_peak_rss()
        started = time.perf_counter()
        report = original_merge(*merge_args, **kwargs)
        marks["merge_s"] = round(time.perf_counter() - started, 3)
        marks["merge_peak_rss_mb"] = round(peak_rss_mb(), 1)
        return report

    driver.CorpusDriver._submit = timed_submit  # type: ignore[method-assign]
    merge_module.merge_outputs = timed_merge  # run_corpus imports it when it merges
    settings = Settings.load().model_copy(update={"model_dir": args.models, "broker_url": None})
    report = run.extract_corpus(
        settings, args.source, RunFolder.of(args.out), args.ops.split(","), args.workers, 0, quiet=True
    ).to_dict()
    marks.setdefault("driver_peak_rss_mb", round(peak_rss_mb(), 1))  # a resume that did not merge
    marks["wall_s"] = round(time.time() - STARTED, 3)
    print(json.dumps({**marks, "report": {k: report.get(k) for k in ("utterances", "audio_seconds", "ops")}}))


if __name__ == "__main__":
    main()
