"""config/grafana/voxmill.json cannot rot: every series its queries name is one voxmill exports, and
every series voxmill exports is on it. The names come from the code that registers them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "voxmill.json"
METRIC_NAME = re.compile(r"\bvoxmill_[a-zA-Z0-9_]+")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Every family the worker, the watcher and the corpus driver register, with the sample names
# Prometheus stores for it (counters get _total, histograms _bucket/_sum/_count).
EXPORTED = """
import json
import prometheus_client as pc
from workers.metrics import Metrics, WatcherMetrics
from workers.observe.run_metrics import RunMetrics

SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
Metrics()
WatcherMetrics()
run = RunMetrics()
names = {}
for registry in (pc.REGISTRY, run.registry):
    for family in registry.collect():
        if family.name.startswith("voxmill_"):
            names[family.name] = [family.name + s for s in SUFFIXES.get(family.type, [""])]
print(json.dumps(names))
"""


def probe_json(code: str) -> Any:
    """What `code`, run in a fresh interpreter (nothing registered or imported yet), prints as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def exported() -> dict[str, list[str]]:
    families: dict[str, list[str]] = probe_json(EXPORTED)
    return families


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def test_every_queried_series_is_exported_and_every_exported_one_is_shown() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    families = exported()
    sample_family = {sample: family for family, samples in families.items() for sample in samples}
    used = {name for expr in expressions(dashboard) for name in METRIC_NAME.findall(expr)}
    unknown = sorted(used - set(sample_family))
    assert not unknown, f"the dashboard queries series voxmill does not export: {unknown}"
    missing = sorted(set(families) - {sample_family[name] for name in used})
    assert not missing, f"exported but on no panel of config/grafana/voxmill.json: {missing}"
    # the families the issue asks for are there (a refactor may not drop one silently)
    for family in ("voxmill_task_seconds", "voxmill_run_eta_seconds", "voxmill_gpu_memory_used_bytes"):
        assert family in families


def test_it_is_a_grafana_dashboard_on_a_prometheus_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert dashboard["uid"] == "voxmill" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert (
            set(panel["gridPos"]) == {"h", "w", "x", "y"}
            and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        )
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel[
            "title"
        ]
        assert panel.get("description"), f"panel {panel['title']!r} says what it shows"
    titles = " | ".join(p["title"] for p in panels(dashboard))
    for topic in (
        "Throughput",
        "p50",
        "p99",
        "code",
        "reloads",
        "rejections",
        "in flight",
        "RSS",
        "GPU",
        "Progress",
    ):
        assert topic in titles, topic
