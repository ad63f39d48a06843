"""A real Prometheus (Debian's `prometheus` binary) scrapes a real worker and a corpus driver's
endpoint with the project's config/prometheus.yml, its targets rewritten to this test's ports;
the task-latency histogram by op counts the jobs the worker ran, and every query of the Grafana
dashboard evaluates. Everything listens on 127.0.0.1 and is stopped by the test."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests.conftest import make_settings, wait_for
from tests.integration.services import running_http_service
from tests.unit.test_grafana import DASHBOARD, expressions
from workers.embedded import free_port
from workers.observe.run_metrics import RunMetrics
from workers.queue.client import Client

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = "the prometheus binary is not installed (apt-get install prometheus; .ci/run installs it)"
# Grafana's variables, as the dashboard would fill them in for all hosts.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


def render_scrape_config(source: Path, targets: dict[str, list[str]], scrape_interval: str = "1s") -> str:
    """`source` with each named job's targets replaced and the other jobs left out, scraping fast."""
    config: dict[str, Any] = yaml.safe_load(source.read_text())
    config["global"].update(scrape_interval=scrape_interval, evaluation_interval=scrape_interval)
    jobs = [job for job in config["scrape_configs"] if job["job_name"] in targets]
    assert {job["job_name"] for job in jobs} == set(targets), f"{source} lacks a job of {sorted(targets)}"
    for job in jobs:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    config["scrape_configs"] = jobs
    return yaml.safe_dump(config, sort_keys=False)


@contextlib.contextmanager
def running_prometheus(config: Path, folder: Path) -> Iterator[str]:
    """A Prometheus on a free loopback port with its data in `folder`; its base URL."""
    assert PROMETHEUS is not None
    url = f"http://127.0.0.1:{free_port()}"
    argv = [
        PROMETHEUS,
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address={url.removeprefix('http://')}",
        "--log.level=warn",
    ]
    with running_http_service(argv, folder / "prometheus.log", f"{url}/-/ready", timeout_s=30):
        yield url


def api(url: str, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def by_label(url: str, expr: str, label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in api(url, "query", query=expr)["result"]}


def targets_up(url: str) -> dict[str, str]:
    return {t["labels"]["job"]: t["health"] for t in api(url, "targets")["activeTargets"]}


@pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)
def test_a_real_prometheus_scrapes_a_worker_and_a_corpus_driver(
    start_worker,
    redis_url: str,
    redis_client: redis.Redis,
    tiny_models: Path,
    audio_dir: Path,
    tmp_path: Path,
) -> None:
    worker_port, run_port = free_port(), free_port()
    settings = make_settings(redis_url, tiny_models, [audio_dir, tmp_path], metrics_port=worker_port)
    start_worker(settings, concurrency=1, queues=("embed",))
    results = Client(settings).run(
        "embed", [audio_dir / "chirp_3s.wav"] * 3 + [tmp_path / "missing.wav"], timeout_s=60
    )
    assert [r.error.code if r.error else "ok" for r in results] == ["ok", "ok", "ok", "not_found"]
    run = RunMetrics()
    run.identify("run-1", str(audio_dir))
    run.planned("embed", shards=2, utterances=8, audio_s=24.0)
    run.shard_done("embed", ok=3, failed=1, audio_s=12.0, failed_by_code={"not_found": 1})
    run.serve(run_port, addr="127.0.0.1")
    config = tmp_path / "prometheus.yml"
    targets = {"voxmill-workers": [f"127.0.0.1:{worker_port}"], "voxmill-extract": [f"127.0.0.1:{run_port}"]}
    config.write_text(render_scrape_config(CONFIG, targets))
    try:
        with running_prometheus(config, tmp_path) as url:
            wait_for(
                lambda: targets_up(url) == {"voxmill-workers": "up", "voxmill-extract": "up"}, timeout_s=30
            )
            query = "sum by (op) (voxmill_task_seconds_count)"
            wait_for(lambda: by_label(url, query, "op") == {"embed": 4.0}, timeout_s=30)
            failures = by_label(url, 'sum by (code) (voxmill_task_failures_total{op="embed"})', "code")
            assert failures == {"not_found": 1.0}
            assert by_label(url, "voxmill_run_shards_done_total", "resumed") == {"false": 1.0}
            progress = (
                "sum by (op) (voxmill_run_utterances_done_total) / on (op) voxmill_run_planned_utterances"
            )
            assert by_label(url, progress, "op") == {"embed": 0.5}
            for expr in expressions(json.loads(DASHBOARD.read_text())):
                for name, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(name, value)
                if not expr.startswith("label_values("):  # Grafana's own function, not PromQL
                    api(url, "query", query=expr)  # a query Prometheus cannot parse fails here
    finally:
        run.close()


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (it comes with apt-get install prometheus)"
)
def test_the_shipped_scrape_config_is_valid() -> None:
    done = subprocess.run(
        [str(PROMTOOL), "check", "config", str(CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = [job["job_name"] for job in yaml.safe_load(CONFIG.read_text())["scrape_configs"]]
    assert jobs == ["voxmill-workers", "voxmill-watcher", "voxmill-extract"]
