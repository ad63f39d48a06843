"""Small builders shared by the integration and fault tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import soundfile as sf

from pipeline.demo import speechlike

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def worker_dicts(client: object) -> list[dict]:
    """Every live worker process's heartbeat record, as the JSON `voxmill status --json` shows."""
    from workers.heartbeat import read_worker_records

    return [record.to_dict() for record in read_worker_records(client)]  # type: ignore[arg-type]


def celery_headers(task: object = "voxmill.embed", task_id: object = None, **more: object) -> dict[str, Any]:
    """The headers Celery's `send_task` writes (protocol 2), with a fresh id unless given."""
    fields: dict[str, Any] = {
        "lang": "py",
        "task": task,
        "id": task_id if task_id is not None else str(uuid.uuid4()),
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": None,
        "parent_id": None,
        "argsrepr": "",
        "kwargsrepr": "",
        "origin": "foreign@test",
        "ignore_result": False,
    }
    fields.update(more)
    return fields


OUTPUT_FILES = ("speech_tokens.parquet", "utt_embeddings.parquet", "spk_embeddings.parquet")


def make_audio_folder(
    folder: Path, count: int, min_s: float, max_s: float, speakers: int = 3, seed: int = 0
) -> Path:
    """`count` speech-like 16 kHz WAVs in `folder/spkN/uttNNNN.wav`, lengths uniform in [min_s, max_s]."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        spk = f"spk{index % speakers}"
        seconds = float(rng.uniform(min_s, max_s))
        wave = speechlike(seconds, 16000, 100.0 + 40.0 * (index % speakers), seed=seed * 100_000 + index)
        path = folder / spk / f"utt{index:04d}.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, wave, 16000, subtype="PCM_16")
    return folder


def read_outputs(out_dir: Path) -> dict[str, object]:
    """Everything a run produced that must not depend on how it ran (timings and retries left out)."""
    outputs: dict[str, object] = {}
    for name in OUTPUT_FILES:
        if (out_dir / name).exists():
            outputs[name] = pq.read_table(out_dir / name).to_pylist()
    outputs["errors.jsonl"] = sorted((out_dir / "errors.jsonl").read_text().splitlines())
    report = json.loads((out_dir / "report.json").read_text())
    for volatile in ("wall_seconds", "resubmitted_shards", "plan_fingerprint"):
        report.pop(volatile, None)
    outputs["report.json"] = report
    return outputs


def reexported(source: Path, target: Path) -> None:
    """The same model under other bytes (a new export of the same weights): another sha256."""
    import onnx

    model = onnx.load(str(source))
    model.doc_string = f"re-exported {uuid.uuid4().hex}"
    onnx.save(model, str(target))


def run_benchmark(work_dir: Path, module: str, *args: str) -> None:
    """`python -m module args...` from the project root, its work files in `work_dir`; it must exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXMILL_")}
    env["BENCH_WORK_DIR"] = str(work_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def target_labels(results: dict[str, Any]) -> list[str]:
    """The first cell of each row of BENCHMARKS.md's targets table for `results` (by result name)."""
    from benchmarks.report import targets_section

    return [row.split(" | ")[0] for row in targets_section(results)[4:-1]]
