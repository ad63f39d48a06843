"""Short clips listed without durations: shards sized from a sample of file headers (issue 34, item 3).

    python -m benchmarks.shard_sizing                        # 20,000 utterances
    python -m benchmarks.shard_sizing --utterances 200000    # the issue's size
    python -m benchmarks.shard_sizing --utterances 200000 --repeats 2
    python -m benchmarks.shard_sizing --quick                # 4,000, under benchmarks/work/quick/

A Kaldi dir of N utterances (wav.scp and utt2spk, no utt2dur, as CosyVoice's data preparation
writes it) over `benchmarks.corpus_scale`'s few dozen short clips (0.5-2 s, 1.25 s on average),
the tiny stand-ins, embed, 2 local workers (`benchmarks.extract_run.run_extract`: `voxmill extract`
timed from outside). Measured back to back: the plain loop in 2 processes over the same clips
(`benchmarks.corpus_scale.run_plain_loop`), `voxmill extract` with the shard size chosen by the
planner (the headers of a sample of the first utterances; `--repeats` runs, each between two
plain loops and measured against their mean, the median reported) and `voxmill extract
--shard-size 32` (what a listing without durations got before: 32 utterances a shard; against the
plain loop just before it). Throughput is audio seconds per wall second; the ratios are to the
plain loop (target >= 0.75). Writes
`benchmarks/results/shard-sizing.json`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import load_average, log, results_dir, write_result
from benchmarks.corpus import make_models
from benchmarks.corpus_scale import SCALE_DIR, make_clips, make_corpus, run_plain_loop
from benchmarks.extract_run import run_extract

OPS = ["embed"]
BEFORE_SHARD_SIZE = 32  # the size a listing without durations was cut to before
TARGET_RATIO = 0.75


def planned_shard_size(data: Path) -> int:
    """The shard size the planner chooses for `data` with 2 local workers (a plan only, no run)."""
    from pipeline.outputs.folder import RunFolder
    from pipeline.run.plan import Planner
    from pipeline.settings import Settings

    with tempfile.TemporaryDirectory() as scratch:
        planner = Planner(data, RunFolder.of(Path(scratch) / "out"), OPS, 0, Settings(), 2).start()
        planner.join()
        if planner.error is not None or planner.header is None:
            raise RuntimeError(f"planning {data} failed: {planner.error}")
        return planner.header.shard_size


def voxmill_run(data: Path, models: Path, shard_size: int | None) -> dict[str, Any]:
    result = run_extract(data, models, OPS, workers=2, shard_size=shard_size, timeout_s=4 * 3600)
    return {key: result[key] for key in ("wall_s", "cpu_s", "utterances", "audio_s", "rtf_x", "stages")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="4,000 utterances, results under work/quick")
    parser.add_argument("--repeats", type=int, default=1, help="sized runs, each between two plain loops")
    args = parser.parse_args()
    n = 4_000 if args.quick else args.utterances
    models = make_models("tiny")
    data, manifest, _ = make_corpus(n, make_clips(SCALE_DIR / "clips"), durations=False)
    work = SCALE_DIR / f"sizing-{n}"
    work.mkdir(parents=True, exist_ok=True)
    chosen = planned_shard_size(data)
    load_before = load_average()

    def plain_loop() -> float:
        log(f"{n} utterances: plain loop, 2 processes")
        return float(run_plain_loop(manifest, models, ",".join(OPS), work)["wall_s"])

    # Each sized run sits between two plain loops and is measured against their mean: this VM's
    # speed drifts over minutes (CHANGELOG 34).
    plains = [plain_loop()]
    sized = []
    for repeat in range(args.repeats):
        log(f"{n} utterances: voxmill extract, shard size from the headers ({chosen}), run {repeat + 1}")
        sized.append(voxmill_run(data, models, None))
        plains.append(plain_loop())
    log(f"{n} utterances: voxmill extract --shard-size {BEFORE_SHARD_SIZE} (before)")
    before = voxmill_run(data, models, BEFORE_SHARD_SIZE)
    audio_s = sized[0]["audio_s"]
    ratios = [round((plains[i] + plains[i + 1]) / 2 / run["wall_s"], 3) for i, run in enumerate(sized)]
    after = sized[ratios.index(statistics.median_low(ratios))]  # the median run, whole
    after["ratios_to_plain_loop"] = ratios
    for run, size, plain_s in ((before, BEFORE_SHARD_SIZE, plains[-1]), (after, chosen, None)):
        run["shard_size"] = size
        run["shards"] = -(-n // size)
        run["audio_s_per_s"] = round(audio_s / run["wall_s"], 2)
        if plain_s is not None:  # the plain loop run just before it
            run["ratio_to_plain_loop"] = round(plain_s / run["wall_s"], 3)
    after["ratio_to_plain_loop"] = statistics.median_low(ratios)
    plain_rate = audio_s / statistics.mean(plains)
    data_out = {
        "ops": OPS,
        "workers": 2,
        "utterances": n,
        "audio_s": audio_s,
        "durations_listed": False,
        "plain_loop": {"wall_s": plains, "audio_s_per_s": round(plain_rate, 2)},
        "before": before,
        "after": after,
        "load_average": {"before": load_before, "after": load_average()},
        "target": {
            "ratio_to_plain_loop": TARGET_RATIO,
            "met": after["ratio_to_plain_loop"] >= TARGET_RATIO,
        },
    }
    log(
        f"plain {plain_rate:.0f} audio s/s; before {before['ratio_to_plain_loop']} "
        f"({before['shards']} shards); after {after['ratio_to_plain_loop']} ({after['shards']} shards)"
    )
    print(write_result(results_dir(args.quick), "shard-sizing", data_out), file=sys.stderr)


if __name__ == "__main__":
    main()
