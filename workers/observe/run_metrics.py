"""A corpus run you can watch: the driver's Prometheus series and its progress record on the broker.

`voxmill extract --metrics-port N` (setting `run_metrics_port`) serves `RunMetrics` from the
driver's process; without it `NoRunMetrics` takes the calls and prometheus-client is never
imported. Every round the driver also writes its progress (input, counts, ETA) to
`voxmill:run:{run}:progress` with a short TTL, which `voxmill status` lists (`runs_in_progress`):
a driver that died leaves no record behind for longer than the TTL.

Series (all prefixed `voxmill_run_`, one run per endpoint):
- `info{run, input}` 1 once the plan's header is written; `plan_complete` 0 while the listing is
  still read, then 1; `planned_shards{op}` (growing while planning), `planned_utterances{op}` and
  `planned_audio_seconds{op}` (once the listing is read; the audio only when it lists durations)
- `shards_done_total{op, resumed}`, `utterances_done_total{op, outcome}` (ok | failed | resumed:
  done by an earlier run of the same folder), `audio_done_seconds_total{op}` and
  `failures_total{op, code}` (this run's, as the workers measured them)
- `shards_in_flight`, `shards_resubmitted_total`, `eta_seconds` (NaN while unknown)

`RunObserver` is one of the run's hooks (`pipeline.run.hooks`): it turns what the driver tells
(a shard done or found done, a shard sent again, a round) into both.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RunError
from pipeline.records import ShardResult, ShardSpec
from pipeline.run.hooks import Counts, RunHooks, RunRound
from workers import keys

if TYPE_CHECKING:  # redis-py is imported once a run starts (its local workers are spawned first)
    import redis

# JSON record of one driver's run; expires unless the driver writes it again.
RUN_PROGRESS = keys.RUN_PROGRESS
RUN_PROGRESS_PATTERN = keys.RUN_PROGRESS_PATTERN
RUN_PROGRESS_TTL_S = 15  # like a worker's heartbeat: gone soon after its driver
RUN_PUBLISH_EVERY_S = 1.0  # announcements can wake the driver many times a second; one write is enough


class RunMetricsPortError(RunError):
    """The run's metrics port cannot be served (taken by another process, or not allowed)."""


class NoRunMetrics:
    """Run metrics switched off: every call does nothing."""

    enabled = False

    def identify(self, run: str, source: str) -> None:
        """The run's name on the broker and its input."""

    def planned(
        self, op: str, shards: int, utterances: int | None = None, audio_s: float | None = None
    ) -> None:
        """The plan's size for one op so far (utterances and audio once the listing is read)."""

    def plan_complete(self, complete: bool) -> None:
        """Whether the whole listing is planned."""

    def shard_done(
        self, op: str, ok: int, failed: int, audio_s: float, failed_by_code: Mapping[str, int] | None = None
    ) -> None:
        """A shard of this run has its file."""

    def shard_resumed(self, op: str, utterances: int) -> None:
        """A shard an earlier run of the same folder did."""

    def in_flight(self, n: int) -> None:
        """Shards submitted and not done."""

    def resubmitted(self) -> None:
        """A shard was submitted again (late, or announced without its file)."""

    def eta(self, seconds: float | None) -> None:
        """Seconds to the end at this run's speed; None while unknown."""

    def serve(self, port: int, addr: str) -> None:
        """Serve the series on `addr`:`port`."""

    def close(self) -> None:
        """Stop serving."""


class RunMetrics(NoRunMetrics):
    """The run's series, in a registry of their own (a driver process may also hold others)."""

    enabled = True

    def __init__(self) -> None:
        import prometheus_client as pc

        self.registry = pc.CollectorRegistry()
        self._server: Any = None

        def gauge(name: str, about: str, labels: Sequence[str] = ()) -> Any:
            return pc.Gauge(name, about, list(labels), registry=self.registry)

        def counter(name: str, about: str, labels: Sequence[str] = ()) -> Any:
            return pc.Counter(name, about, list(labels), registry=self.registry)

        self._info = gauge("voxmill_run_info", "The corpus run this driver drives", ["run", "input"])
        self._complete = gauge("voxmill_run_plan_complete", "1 once the whole listing is planned")
        self._planned_shards = gauge("voxmill_run_planned_shards", "Shards planned so far", ["op"])
        self._planned_utts = gauge("voxmill_run_planned_utterances", "Utterances in the listing", ["op"])
        self._planned_audio = gauge("voxmill_run_planned_audio_seconds", "Audio the listing lists", ["op"])
        self._shards = counter("voxmill_run_shards_done", "Shards whose file exists", ["op", "resumed"])
        self._utts = counter("voxmill_run_utterances_done", "Utterances done", ["op", "outcome"])
        self._audio = counter("voxmill_run_audio_done_seconds", "Audio seconds done in this run", ["op"])
        self._failures = counter("voxmill_run_failures", "Failed utterances by error code", ["op", "code"])
        self._in_flight = gauge("voxmill_run_shards_in_flight", "Shards submitted and not done")
        self._resubmitted = counter("voxmill_run_shards_resubmitted", "Shards submitted again")
        self._eta = gauge("voxmill_run_eta_seconds", "Seconds to the end at this run's speed (NaN: unknown)")
        self._eta.set(math.nan)

    def identify(self, run: str, source: str) -> None:
        self._info.clear()
        self._info.labels(run, source).set(1)

    def planned(
        self, op: str, shards: int, utterances: int | None = None, audio_s: float | None = None
    ) -> None:
        self._planned_shards.labels(op).set(shards)
        if utterances is not None:
            self._planned_utts.labels(op).set(utterances)
        if audio_s is not None:
            self._planned_audio.labels(op).set(audio_s)

    def plan_complete(self, complete: bool) -> None:
        self._complete.set(1 if complete else 0)

    def shard_done(
        self, op: str, ok: int, failed: int, audio_s: float, failed_by_code: Mapping[str, int] | None = None
    ) -> None:
        self._shards.labels(op, "false").inc()
        self._utts.labels(op, "ok").inc(ok)
        self._utts.labels(op, "failed").inc(failed)
        self._audio.labels(op).inc(audio_s)
        for code, n in (failed_by_code or {}).items():
            self._failures.labels(op, code).inc(n)

    def shard_resumed(self, op: str, utterances: int) -> None:
        self._shards.labels(op, "true").inc()
        self._utts.labels(op, "resumed").inc(utterances)

    def in_flight(self, n: int) -> None:
        self._in_flight.set(n)

    def resubmitted(self) -> None:
        self._resubmitted.inc()

    def eta(self, seconds: float | None) -> None:
        self._eta.set(math.nan if seconds is None else seconds)

    def serve(self, port: int, addr: str) -> None:
        import prometheus_client as pc

        self._server, _ = pc.start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def failures_by_code(shard_file: Path | str) -> dict[str, int]:
    """How many of a shard file's rows failed with each error code."""
    from pipeline.outputs.writers import read_shard

    codes = read_shard(shard_file).column("error_code").to_pylist()
    return dict(collections.Counter(code for code in codes if code is not None))


def eta_seconds(counts: Counts) -> float | None:
    """Seconds to the end at this run's pace (utterances per wall second, resumed ones left out);
    None while the listing is still read or before this run has done anything."""
    if counts.units_total is None:
        return None
    done_now = counts.units_done - counts.units_resumed
    elapsed = time.monotonic() - counts.started
    if done_now <= 0 or elapsed <= 0:
        return None
    return max(0.0, (counts.units_total - counts.units_done) * elapsed / done_now)


def progress_record(
    header: Any,
    out: str,
    counts: Counts,
    shards: Mapping[str, Any],
    eta_s: float | None,
    started: float,
) -> dict[str, Any]:
    """What `voxmill status` shows of a run: where it reads and writes, how far it is, its ETA.

    `header`: the plan's (`run`, `source`); `shards`: `planned`, `plan_complete`, `done`,
    `done_before` (by an earlier run), `in_flight`, `resubmitted`; `started` is epoch seconds.
    Totals are None while the listing is still read.
    """
    n_ops = max(counts.n_ops, 1)
    return {
        "run": header.run,
        "input": str(header.source),
        "out": out,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "utterances_total": None if counts.units_total is None else counts.units_total // n_ops,
        "utterances_done": counts.units_done // n_ops,
        "audio_total_s": None if counts.audio_total_s is None else round(counts.audio_total_s, 3),
        "audio_done_s": round(counts.audio_done_s / n_ops, 3),
        "failed": dict(counts.failed),
        "shards": dict(shards),
        "rtf": round(counts.rtf(), 3),
        "eta_s": None if eta_s is None else round(eta_s, 1),
        "started": started,
        "time": time.time(),
    }


def publish_run_progress(
    client: redis.Redis, run_id: str, record: Mapping[str, Any], ttl_s: int = RUN_PROGRESS_TTL_S
) -> None:
    """Write a run's progress record; it expires `ttl_s` after the last write."""
    client.set(RUN_PROGRESS.format(run=run_id), json.dumps(record), ex=ttl_s)


def clear_run_progress(client: redis.Redis, run_id: str) -> None:
    """The run is over: its record goes at once."""
    client.delete(RUN_PROGRESS.format(run=run_id))


def runs_in_progress(client: redis.Redis) -> list[dict[str, Any]]:
    """Every run whose driver wrote its record within the TTL, oldest first."""
    runs = []
    for key in client.scan_iter(match=RUN_PROGRESS_PATTERN, count=500):
        raw = client.get(key)
        if raw:
            runs.append(json.loads(raw))
    return sorted(runs, key=lambda r: (r.get("started", 0.0), r.get("run", "")))


class RunObserver(RunHooks):
    """A corpus run as the outside world sees it: `RunMetrics` and its record on the broker, kept
    from the driver's hooks (`pipeline.run.hooks.RunHooks`). The broker record is best effort:
    a broker outage is the driver's business, never the observer's.
    """

    def __init__(
        self,
        out: str,
        broker: Callable[[], redis.Redis | None] | None,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        ttl_s: int = RUN_PROGRESS_TTL_S,
    ) -> None:
        """`out`: the output folder as given (`RunFolder.display`), for the record; `broker`: the
        client the record is written with, asked for when the run starts (None: no record)."""
        self.out = out
        self.broker = broker
        self.client: redis.Redis | None = None
        self.metrics: NoRunMetrics = RunMetrics() if metrics_port else NoRunMetrics()
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.ttl_s = ttl_s
        self.started_at = time.time()
        self.shards_done = 0
        self.shards_resumed = 0
        self.resubmits = 0
        self.run: str | None = None
        self._published_at = -math.inf

    def run_started(self) -> None:
        """Serve the metrics port, if any; `RunMetricsPortError` when it cannot be served."""
        self.client = self.broker() if self.broker else None
        if not self.metrics_port:
            return
        try:
            self.metrics.serve(self.metrics_port, self.metrics_addr)
        except OSError as exc:  # a port taken or not allowed: say so before hours of work
            raise RunMetricsPortError(
                f"cannot serve the run's metrics on port {self.metrics_port}: {exc.strerror or exc}"
            ) from None

    def shard_done(self, spec: ShardSpec, result: ShardResult, shard_file: Path | str) -> None:
        self.shards_done += 1
        failed = result.failed
        codes = failures_by_code(shard_file) if failed and self.metrics.enabled else {}
        self.metrics.shard_done(spec.op, result.ok, failed, result.audio_seconds, codes)

    def shard_resumed(self, spec: ShardSpec) -> None:
        self.shards_resumed += 1
        self.metrics.shard_resumed(spec.op, len(spec.utts))

    def shard_resubmitted(self, spec: ShardSpec) -> None:
        self.resubmits += 1
        self.metrics.resubmitted()

    def round_ended(self, now: RunRound) -> None:
        """The plan's size, shards in flight, the ETA, and (at most once a second) the broker
        record, once the plan has a header (the run's name)."""
        counts, plan = now.counts, now.plan
        eta_s = eta_seconds(counts)
        n_ops = max(len(plan.ops), 1)
        for op in plan.ops:
            utts = None if counts.units_total is None else counts.units_total // n_ops
            self.metrics.planned(op, plan.planned, utts, counts.audio_total_s)
        self.metrics.plan_complete(plan.done)
        self.metrics.in_flight(now.in_flight)
        self.metrics.eta(eta_s)
        header = plan.header
        if header is not None and self.run != header.run:
            self.run = header.run
            self.metrics.identify(header.run, str(header.source))
        moment = time.monotonic()
        if header is None or self.client is None or moment - self._published_at < RUN_PUBLISH_EVERY_S:
            return
        shards = {
            "planned": plan.planned * n_ops,
            "plan_complete": plan.done,
            "done": self.shards_done + self.shards_resumed,
            "done_before": self.shards_resumed,
            "in_flight": now.in_flight,
            "resubmitted": self.resubmits,
        }
        record = progress_record(header, self.out, counts, shards, eta_s, self.started_at)
        import redis

        try:
            publish_run_progress(self.client, header.run, record, self.ttl_s)
            self._published_at = moment
        except redis.RedisError:
            pass  # the next round writes it again; the driver itself reports the outage

    def run_ended(self) -> None:
        """Drop the run's record and stop serving."""
        self.metrics.close()
        if self.run is not None and self.client is not None:
            import redis

            with contextlib.suppress(redis.RedisError):  # else it expires within the TTL
                clear_run_progress(self.client, self.run)
