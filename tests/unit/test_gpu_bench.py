"""`python -m benchmarks.gpu_bench` keeps running: on the tiny stand-ins, CPU columns only here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_runs_on_the_tiny_models_and_skips_what_is_missing(
    tiny_models: Path, tmp_path: Path
) -> None:
    out = tmp_path / "gpu-test.json"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_bench",
            "--models",
            str(tiny_models),
            "--runs",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 20
    report = json.loads(out.read_text())
    assert set(report["configs"]) == {"cpu", "cpu-all", "cuda", "tensorrt-fp32", "tensorrt-fp16"}
    cpu = report["configs"]["cpu"]
    assert cpu["status"] == "ok" and cpu["threads"] == 1
    for role in ("tokenizer", "embedder"):
        assert cpu[role]["latency_ms"]["p50"] > 0 and cpu[role]["throughput_x"] > 0
        assert cpu[role]["load_s"] >= 0 and cpu[role]["first_run_ms"] > 0
    available = ort.get_available_providers()
    for name, provider in (("cuda", "CUDAExecutionProvider"), ("tensorrt-fp16", "TensorrtExecutionProvider")):
        if provider not in available:
            assert report["configs"][name]["status"] == "skipped"
            assert provider in report["configs"][name]["reason"]
    claims = {(c["role"], c["claim"]): c["verdict"] for c in report["claims"]}
    assert len(claims) == 8
    if "CUDAExecutionProvider" not in available:
        assert claims[("tokenizer", "CUDA cuts latency 30-40 % vs CPU")] == "not measured"
    assert "tokenizer" in done.stdout and f"wrote {out}" in done.stdout


def test_gpu_bench_refuses_a_folder_without_models(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_bench",
            "--models",
            str(tmp_path),
            "--out",
            str(tmp_path / "x.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no tokenizer or embedder model" in done.stderr
