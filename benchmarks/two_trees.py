"""Whole `voxmill extract` runs of two checkouts, alternated in one session: does a change that
should not alter speed (a move of code, say) keep whole-run throughput and start-up?

    git worktree add /tmp/before HEAD~1
    python -m benchmarks.two_trees /tmp/before              # this checkout against /tmp/before
    python -m benchmarks.two_trees /tmp/before --repeats 6 --large 5000

Each checkout runs `python -m workers.cli extract` from its own tree (this environment's
packages and the benchmarks' environment, `benchmarks.common.child_env`; the checkout's code on
the path), embed with the tiny stand-ins, 2 local workers, no broker, on a small corpus (start-up
bound: embedded Redis, worker start, model load, planning, merge) and a large one (throughput
bound), the order of the two swapped every repeat. Prints the median wall time of each and writes
benchmarks/results/two-trees.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, child_env, git_commit, load_average, log
from benchmarks.corpus import WORK_DIR, CorpusRecipe, make_corpus, make_models
from benchmarks.extract_run import extract_command, write_manifest

HERE = Path(__file__).resolve().parent.parent
OPS = ["embed"]


def run_once(tree: Path, manifest: Path, models: Path, out: Path) -> tuple[float, float]:
    """(wall seconds, audio seconds per wall second) of one whole run of `tree`'s code."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**child_env(), "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    subprocess.run(
        extract_command(manifest, out, models, OPS, 2, None),
        env=env,
        cwd=tree,
        check=True,
        capture_output=True,
    )
    wall_s = time.perf_counter() - started
    audio_s = float(json.loads((out / "report.json").read_text())["audio_seconds"])
    shutil.rmtree(out, ignore_errors=True)
    return wall_s, audio_s / wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the other checkout (a git worktree, say)")
    parser.add_argument("--after", type=Path, default=HERE, help="default: this checkout")
    parser.add_argument("--small", type=int, default=60, help="clips of the start-up-bound run")
    parser.add_argument("--large", type=int, default=3000, help="clips of the throughput-bound run")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "two-trees.json")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    models = make_models("tiny")
    work = WORK_DIR / "two-trees"
    manifests = {
        name: write_manifest(
            make_corpus(CorpusRecipe(f"two-trees-{name}", n, 1.0, 5.0)), work / f"{name}.jsonl"
        )
        for name, n in (("small", args.small), ("large", args.large))
    }
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {
        name: {"before": [], "after": []} for name in manifests
    }
    for repeat in range(args.repeats):
        order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
        for corpus, manifest in manifests.items():
            for which in order:
                wall_s, rate = run_once(trees[which], manifest, models, work / f"out-{which}")
                runs[corpus][which].append((wall_s, rate))
                log(f"{corpus} {which} #{repeat}: {wall_s:.3f} s")
    result: dict[str, Any] = {"commits": {k: git_commit(v) for k, v in trees.items()}, "load": load_average()}
    for corpus, by_tree in runs.items():
        medians = {which: statistics.median(w for w, _ in vals) for which, vals in by_tree.items()}
        result[corpus] = {
            "clips": args.small if corpus == "small" else args.large,
            "wall_s": {which: [round(w, 3) for w, _ in vals] for which, vals in by_tree.items()},
            "median_wall_s": {which: round(m, 3) for which, m in medians.items()},
            "after_over_before": round(medians["after"] / medians["before"], 3),
        }
        print(
            f"{corpus:5s} ({result[corpus]['clips']} clips): median wall before {medians['before']:.3f} s, "
            f"after {medians['after']:.3f} s (after/before {result[corpus]['after_over_before']})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
