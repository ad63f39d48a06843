"""Metrics: pool processes' samples reach the shared folder whatever the import order (Celery
imports its CLI plugins, e.g. Flower's, at start-up), and the watcher exports only its own series."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, prometheus_client
from pathlib import Path
from workers.metrics import prepare_multiprocess
folder = prepare_multiprocess()
prometheus_client.Counter("voxmill_probe", "probe").inc()
print(sorted(p.name for p in Path(folder).iterdir()))
"""


def test_samples_land_in_the_multiprocess_folder_whatever_the_import_order() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "counter_" in done.stdout


WATCHER_CHILD = """
import prometheus_client
from workers.metrics import WatcherMetrics
metrics = WatcherMetrics()
metrics.publication("embedder")
metrics.rejection("tokenizer")
print(prometheus_client.generate_latest().decode())
"""


def test_the_watcher_exports_only_what_it_measures() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", WATCHER_CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert 'voxmill_model_publications_total{role="embedder"} 1.0' in done.stdout
    assert 'voxmill_model_rejections_total{role="tokenizer"} 1.0' in done.stdout
    assert "voxmill_worker_rss_bytes" not in done.stdout and "voxmill_task_seconds" not in done.stdout
