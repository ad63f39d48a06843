"""The corpus driver's series: what `RunMetrics` serves, failures by code from a real shard file, the
ETA, and nothing imported when the run has no metrics port."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from pipeline.errors import ErrorRecord
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import write_shard
from pipeline.records import ShardResult, ShardSpec, TaskResult, Utterance
from pipeline.run.hooks import Counts, RunRound
from tests.unit.test_grafana import probe_json
from workers.embedded import free_port
from workers.observe.run_metrics import (
    RunMetrics,
    RunMetricsPortError,
    RunObserver,
    eta_seconds,
    failures_by_code,
)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def value(text: str, sample: str) -> float:
    """The value of the one sample line that starts with `sample` (name and labels)."""
    [line] = [line for line in text.splitlines() if line.startswith(sample + " ")]
    return float(line.rsplit(" ", 1)[1])


def plan(header: object = None, planned: int = 1, done: bool = False) -> SimpleNamespace:
    """What the observer reads of a planner: header (run, source), ops, shards planned, done."""
    return SimpleNamespace(header=header, ops=["embed"], planned=planned, done=done)


def test_the_run_series_as_served() -> None:
    metrics = RunMetrics()
    metrics.identify("run1", "/data/corpus")
    metrics.planned("embed", shards=4, utterances=128, audio_s=600.0)
    metrics.plan_complete(True)
    metrics.shard_done("embed", ok=30, failed=2, audio_s=150.0, failed_by_code={"too_short": 2})
    metrics.shard_done("embed", ok=32, failed=0, audio_s=150.0)
    metrics.shard_resumed("embed", utterances=32)
    metrics.in_flight(2)
    metrics.resubmitted()
    metrics.eta(42.0)
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    try:
        text = scrape(port)
    finally:
        metrics.close()
    expected = {
        'voxmill_run_info{input="/data/corpus",run="run1"}': 1,
        "voxmill_run_plan_complete": 1,
        'voxmill_run_planned_utterances{op="embed"}': 128,
        'voxmill_run_shards_done_total{op="embed",resumed="false"}': 2,
        'voxmill_run_shards_done_total{op="embed",resumed="true"}': 1,
        'voxmill_run_utterances_done_total{op="embed",outcome="ok"}': 62,
        'voxmill_run_utterances_done_total{op="embed",outcome="failed"}': 2,
        'voxmill_run_utterances_done_total{op="embed",outcome="resumed"}': 32,
        'voxmill_run_audio_done_seconds_total{op="embed"}': 300,
        'voxmill_run_failures_total{code="too_short",op="embed"}': 2,
        "voxmill_run_shards_in_flight": 2,
        "voxmill_run_shards_resubmitted_total": 1,
        "voxmill_run_eta_seconds": 42,
    }
    assert {sample: value(text, sample) for sample in expected} == expected
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # closed with the run


def test_the_observer_reads_failures_by_code_from_the_shard_file(tmp_path: Path) -> None:
    utts = [Utterance(f"u{i}", f"/d/u{i}.wav", duration_s=1.0) for i in range(4)]
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=utts)
    results = [
        TaskResult(input="u0", op="embed", embedding=[0.0] * 4, audio_seconds=1.0),
        TaskResult(input="u1", op="embed", error=ErrorRecord("too_short", "x")),
        TaskResult(input="u2", op="embed", error=ErrorRecord("not_found", "x")),
        TaskResult(input="u3", op="embed", error=ErrorRecord("too_short", "x")),
    ]
    path = write_shard(RunFolder.of(tmp_path), spec, results)
    assert failures_by_code(path) == {"too_short": 2, "not_found": 1}
    unreachable = redis.Redis(port=free_port())
    port = free_port()
    observer = RunObserver(str(tmp_path), lambda: unreachable, metrics_port=port, metrics_addr="127.0.0.1")
    observer.run_started()
    try:
        observer.shard_done(spec, ShardResult(0, "embed", str(path), 1, 3, 1.0, 0.0), path)
        counts = Counts(n_ops=1, units_total=None, units_done=4)
        observer.round_ended(RunRound(counts, 0, plan(planned=3)))
        text = scrape(observer.metrics_port or 0)
    finally:
        observer.metrics.close()
    assert value(text, 'voxmill_run_failures_total{code="not_found",op="embed"}') == 1
    assert value(text, 'voxmill_run_planned_shards{op="embed"}') == 3
    assert value(text, "voxmill_run_plan_complete") == 0
    assert "voxmill_run_planned_utterances{" not in text  # not known while the listing is read
    assert "voxmill_run_info{" not in text  # nor the run's name before the plan's header


def test_eta_follows_this_runs_pace() -> None:
    counts = Counts(n_ops=2, units_total=None, units_done=100, units_resumed=20)
    counts.started = time.monotonic() - 10.0
    assert eta_seconds(counts) is None  # the listing is still read
    counts.units_total = 200  # 80 units in 10 s: 100 more take 12.5 s
    eta = eta_seconds(counts)
    assert eta is not None and 12.0 < eta < 13.0
    assert eta_seconds(Counts(n_ops=2, units_total=200, units_done=20, units_resumed=20)) is None


def test_without_a_port_nothing_is_imported_or_served() -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "from workers.observe.run_metrics import RunObserver\n"
        "o = RunObserver('out', None)\n"
        "o.run_started(); o.shard_resubmitted(None)\n"
        "import json; print(json.dumps([type(o.metrics).__name__, 'prometheus_client' in sys.modules]))\n"
    )
    assert probe_json(code) == ["NoRunMetrics", False]


def test_a_taken_port_is_a_clear_error_before_the_run() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        observer = RunObserver("out", None, metrics_port=port, metrics_addr="127.0.0.1")
        with pytest.raises(RunMetricsPortError, match=f"cannot serve the run's metrics on port {port}"):
            observer.run_started()
