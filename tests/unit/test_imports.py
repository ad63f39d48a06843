"""Nothing is built at import: a producer never loads the inference stack, a module builds no app.

Each check runs in a fresh interpreter, so what the test runner imported does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import gc, json, sys
WATCHED = ("onnxruntime", "numpy", "scipy", "workers")
{code}
import celery
apps = [o for o in gc.get_objects() if isinstance(o, celery.Celery) and o.main == "voxmill"]
holders = 0
if "workers.reload.holder" in sys.modules:
    holders = sum(isinstance(o, sys.modules["workers.reload.holder"].ModelHolder) for o in gc.get_objects())
print(json.dumps({{
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in WATCHED),
    "apps": len(apps),
    "holders": holders,
}}))
"""


def probe(code: str) -> dict[str, object]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "VOXMILL_CONFIG": "/nonexistent.yaml"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(code=code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_producer_client_imports_no_inference_and_builds_one_app_and_no_holder() -> None:
    found = probe(
        "from pipeline.settings import Settings\n"
        "from workers.queue.client import Client\n"
        "client = Client(Settings(broker_url='redis://127.0.0.1:1/0'))\n"
    )
    modules = found["modules"]
    assert isinstance(modules, list)
    assert not [m for m in modules if m.startswith(("onnxruntime", "numpy", "scipy"))]
    assert "workers.reload.holder" not in modules and "workers.queue.tasks" not in modules
    # Issue 32: a producer loads the queue's glue and the records it sends, not the library.
    faces = {"pipeline", "pipeline.storage", "workers", "workers.queue"}
    assert len([m for m in modules if m.split(".")[0] in ("pipeline", "workers") and m not in faces]) <= 14
    assert found["apps"] == 1 and found["holders"] == 0


def test_importing_the_modules_builds_no_app() -> None:
    found = probe(
        "import workers.queue.app, workers.queue.client, workers.worker, workers.extract, workers.cli\n"
    )
    assert found["apps"] == 0 and found["holders"] == 0
    assert not [m for m in found["modules"] if m.startswith("onnxruntime")]  # type: ignore[union-attr]


def test_the_worker_app_builds_its_holder_only_in_a_worker_process() -> None:
    found = probe("import workers.app\n")  # what `celery -A workers.app worker` imports
    assert found["apps"] == 1 and found["holders"] == 0


# `voxmill extract` without a broker: the first process it starts is the embedded Redis, and the
# heavy imports come after the local workers are spawned (they load their models meanwhile).
SPAWN_PROBE = """
import json, os, subprocess, sys
HEAVY = ("numpy", "pyarrow", "redis", "celery", "kombu", "scipy", "onnxruntime")
def first_spawn(self, *args, **kwargs):
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)), flush=True)
    os._exit(0)
subprocess.Popen.__init__ = first_spawn
sys.argv = ["voxmill", "extract", {manifest!r}, "--out", {out!r}, "--models", {models!r}, "--quiet"]
from workers.cli import main
main()
"""


def test_extract_spawns_its_local_workers_before_the_heavy_imports(
    tmp_path: Path, tiny_models: Path, audio_dir: Path
) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"utt": "a", "path": str(audio_dir / "chirp_3s.wav")}) + "\n")
    code = SPAWN_PROBE.format(manifest=str(manifest), out=str(tmp_path / "out"), models=str(tiny_models))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "VOXMILL_CONFIG": "/nonexistent.yaml"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines, f"extract never spawned a process: {done.stderr}"
    assert json.loads(lines[-1]) == []
