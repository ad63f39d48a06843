"""Hot reload under load: how long a swap takes, and what it costs in throughput.

    python -m benchmarks.reload --profile tiny      # seconds
    python -m benchmarks.reload --profile full      # about two minutes, ~3 GB of memory

It starts a private Redis, `--workers` worker processes (`-Q tokenize,embed`) and a watcher
(`python -m workers.cli watch`) on a folder of stand-ins, then, for each role, keeps
`--inflight` jobs of that role's op in flight from one client thread (a closed loop) and lands
a stand-in of another seed with an atomic rename. Measured per role:

- `landed_to_all_s`: the file lands -> every worker reports the new sha256 (heartbeats);
- `settled_to_all_s`: the same from the moment the watcher may consider the file settled
  (landing + `watch_quiet_s`): validation in a separate process, publishing, and the workers'
  loads beside their sessions. The target: < 5 s for the full stand-ins;
- `validate_s`: the validator process alone (from the generation record);
- throughput (jobs/s) `before` (`--phase-s` before the landing), `during` (settled -> all
  workers swapped, so the validator's and the loads' CPU time counts) and `after` (`--phase-s`
  after); the target: during >= 50 % of before;
- `failed`: jobs that came back with an error (the target: 0), and the results per sha256.

It prints a table and writes `benchmarks/results/reload-<profile>.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from pipeline.models.standin import (
    EMBEDDER_FILE,
    TOKENIZER_FILE,
    make_embedder_model,
    make_standins,
    make_tokenizer_model,
)
from pipeline.settings import PROJECT_ROOT, Settings
from workers.embedded import EmbeddedRedis, LocalWorkers
from workers.observe.status import collect_status
from workers.queue.client import Client, Job

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CLIP = PROJECT_ROOT / "tests" / "fixtures" / "chirp_3s.wav"
SCENARIOS = {"embedder": ("embed", EMBEDDER_FILE), "tokenizer": ("tokenize", TOKENIZER_FILE)}


@dataclass
class Completion:
    """One finished job: when it was submitted and finished (monotonic s), its sha256 or error."""

    submitted: float
    finished: float
    sha256: str
    error: str | None


class Load:
    """A closed loop: `inflight` threads, each with its own client, submit a job and wait for it."""

    def __init__(self, settings: Settings, op: str, role: str, inflight: int) -> None:
        self.op = op
        self.role = role
        self.clients = [Client(settings) for _ in range(inflight)]
        self.done: list[Completion] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(c,), daemon=True) for c in self.clients]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join()

    def _loop(self, client: Client) -> None:
        while not self.stop.is_set():
            submitted = time.monotonic()
            completion = self._completion(client, submitted, client.submit(self.op, CLIP))
            with self._lock:
                self.done.append(completion)

    def _completion(self, client: Client, submitted: float, job: Job) -> Completion:
        """Wait for `job` (woken by its result); a task that raised or timed out is a failed job."""
        _, result = next(client.completed([job], timeout_s=60))
        finished = time.monotonic()
        error = None if result.error is None else f"{result.error.code}: {result.error.message}"
        ref = result.models.get(self.role)
        return Completion(submitted, finished, ref.sha256 if ref else "", error)

    def rate(self, start: float, end: float) -> float:
        """Jobs per second finished in [start, end)."""
        count = sum(1 for c in self.done if start <= c.finished < end)
        return count / max(end - start, 1e-9)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def land(path: Path, data: bytes) -> None:
    """An atomic rename into place, as a deploy tool does."""
    tmp = path.with_name(f".{path.name}.landing")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def all_serving(client: redis.Redis, role: str, sha256: str, workers: int) -> bool:
    """`sha256` is published and every worker process reports it (and no other)."""
    info = collect_status(client)["models"][role]
    serving = info["serving"]
    published = (info["published"] or {}).get("sha256")
    return published == sha256 and list(serving) == [sha256] and len(serving[sha256]) == workers


def wait(check: Any, timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Poll until `check()` is true; the monotonic time it became true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(interval_s)
    raise TimeoutError(f"{what} within {timeout_s:g} s")


def swap_under_load(
    role: str, replacement: bytes, settings: Settings, rclient: redis.Redis, args: argparse.Namespace
) -> dict[str, Any]:
    """Keep jobs flowing, land `replacement` for `role`, and measure the swap."""
    op, file_name = SCENARIOS[role]
    path = Path(settings.model_dir) / file_name
    old, new = sha256_of(path.read_bytes()), sha256_of(replacement)
    load = Load(settings, op, role, args.inflight)
    started = time.monotonic()
    load.start()
    time.sleep(args.warm_s + args.phase_s)
    land(path, replacement)
    landed = time.monotonic()
    settled = landed + settings.watch_quiet_s
    all_on_new = wait(lambda: all_serving(rclient, role, new, args.workers), 300, f"{role}: all on new")
    time.sleep(args.phase_s)
    load.join()
    record = collect_status(rclient)["models"][role]["published"] or {}
    before = load.rate(started + args.warm_s, landed)
    during = load.rate(settled, all_on_new)
    after = load.rate(all_on_new, all_on_new + args.phase_s)
    by_sha: dict[str, int] = {}
    for c in load.done:
        by_sha[c.sha256[:12] or "-"] = by_sha.get(c.sha256[:12] or "-", 0) + 1
    late_old = sum(1 for c in load.done if c.submitted >= all_on_new and c.sha256 != new)
    return {
        "role": role,
        "op": op,
        "old_sha256": old,
        "new_sha256": new,
        "file_bytes": len(replacement),
        "landed_to_all_s": round(all_on_new - landed, 3),
        "settled_to_all_s": round(all_on_new - settled, 3),
        "validate_s": float(record.get("validate_s") or 0.0),
        "generation": int(record.get("generation") or 0),
        "throughput": {"before": round(before, 2), "during": round(during, 2), "after": round(after, 2)},
        "during_window_s": round(all_on_new - settled, 3),
        "during_vs_before": round(during / before, 3) if before else None,
        "jobs": len(load.done),
        "failed": sum(1 for c in load.done if c.error),
        "errors": sorted({c.error for c in load.done if c.error})[:5],
        "results_by_sha256": by_sha,
        "old_after_swap": late_old,
    }


def start_watcher(settings: Settings, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **settings.to_env()}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "watch"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def replacements(profile: str, roles: list[str]) -> dict[str, bytes]:
    """Stand-ins of seed 1, serialized, for each role to swap."""
    makers = {"embedder": make_embedder_model, "tokenizer": make_tokenizer_model}
    return {role: makers[role](profile, 1).SerializeToString() for role in roles}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Set up Redis, workers and the watcher; swap every role in turn; tear everything down."""
    models = work / "models"
    started = time.perf_counter()
    make_standins(models, profile=args.profile, seed=0)
    new_files = replacements(args.profile, args.roles)
    print(f"stand-ins ({args.profile}) written in {time.perf_counter() - started:.1f} s", flush=True)
    server = EmbeddedRedis().start()
    settings = Settings(
        broker_url=server.url,
        model_dir=models,
        speech_check=False,  # generated clips are not speech
        allowed_roots=(CLIP.parent,),
        provider="cpu",
        watch_quiet_s=args.quiet_s,
        reload_slots=args.reload_slots,
        **({} if args.aside_min_mb is None else {"reload_aside_min_mb": args.aside_min_mb}),
        model_cache_dir=work / "ort-cache",  # empty at start; shared by the watcher and the workers
    )
    rclient = redis.Redis.from_url(server.url)
    workers = LocalWorkers(settings, args.workers, ["tokenize", "embed"], log_path=work / "workers.log")
    watcher = None
    try:
        workers.start().wait_ready(600)
        watcher = start_watcher(settings, work / "watcher.log")
        for role in args.roles:
            sha = sha256_of((models / SCENARIOS[role][1]).read_bytes())
            wait(lambda r=role, s=sha: all_serving(rclient, r, s, args.workers), 300, "first generation")
        scenarios = []
        for role in args.roles:
            print(f"swapping the {role} under {SCENARIOS[role][0]} load ...", flush=True)
            scenarios.append(swap_under_load(role, new_files[role], settings, rclient, args))
        return {"scenarios": scenarios, "settings": {"watch_quiet_s": args.quiet_s, **vars_of(args)}}
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait(timeout=30)
        workers.stop()
        rclient.close()
        server.stop()


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("out", "keep")}


def render(report: dict[str, Any]) -> str:
    """One row per swapped role."""
    head = ("role", "MB", "landed->all s", "settled->all s", "validate s")
    head += ("before/s", "during/s", "after/s", "during %", "failed", "jobs")
    rows = [head]
    for s in report["scenarios"]:
        t = s["throughput"]
        ratio = "-" if s["during_vs_before"] is None else f"{100 * s['during_vs_before']:.0f}"
        cells = (s["role"], f"{s['file_bytes'] / 1e6:.1f}", f"{s['landed_to_all_s']:.2f}")
        cells += (f"{s['settled_to_all_s']:.2f}", f"{s['validate_s']:.2f}", f"{t['before']:.1f}")
        cells += (f"{t['during']:.1f}", f"{t['after']:.1f}", ratio, str(s["failed"]), str(s["jobs"]))
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reload", description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--roles", default="embedder,tokenizer", help="roles to swap, in order")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--inflight", type=int, default=0, help="jobs in flight (default: 2 per worker)")
    parser.add_argument("--phase-s", type=float, default=5.0, help="seconds measured before and after")
    parser.add_argument("--warm-s", type=float, default=1.0, help="seconds of load before measuring")
    parser.add_argument("--quiet-s", type=float, default=1.0, help="the watcher's watch_quiet_s")
    parser.add_argument("--reload-slots", type=int, default=0, help="reload_slots (0: half the workers)")
    parser.add_argument(
        "--aside-min-mb", type=float, default=None, help="reload_aside_min_mb (a huge value: never aside)"
    )
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default results/reload-PROFILE)")
    parser.add_argument("--keep", type=Path, default=None, help="work folder to keep (models, logs)")
    args = parser.parse_args(argv)
    args.roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    args.inflight = args.inflight or 2 * args.workers
    if args.keep is not None:
        report = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="voxmill-reload-") as tmp:
            report = run(args, Path(tmp))
    report.update(
        {
            "profile": args.profile,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": sys.version.split()[0],
            },
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    )
    out = args.out or RESULTS_DIR / f"reload-{args.profile}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
