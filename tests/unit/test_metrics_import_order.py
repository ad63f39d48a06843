"""Pool processes' metrics reach the shared folder even when prometheus-client was imported before
the folder was set (Celery imports its CLI plugins, e.g. Flower's, at start-up)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, prometheus_client
from pathlib import Path
from workers.observe.metrics import prepare_multiprocess
folder = prepare_multiprocess()
prometheus_client.Counter("voxmill_probe", "probe").inc()
print(sorted(p.name for p in Path(folder).iterdir()))
"""


def test_samples_land_in_the_multiprocess_folder_whatever_the_import_order() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "counter_" in done.stdout
