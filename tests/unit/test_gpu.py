"""GPU workers never fork after CUDA is initialised: `check_pool_for_provider` and `voxmill worker`."""

from __future__ import annotations

import os

import onnxruntime as ort
import pytest
from typer.testing import CliRunner

import workers.worker as worker
from pipeline.models.providers import CPU, CUDA, TENSORRT
from pipeline.settings import Settings
from workers.cli import app
from workers.worker import check_pool_for_provider, serving_provider


@pytest.mark.parametrize("serving", [CUDA, TENSORRT])
def test_prefork_is_refused_on_a_gpu_with_what_to_use_instead(serving: str) -> None:
    problem = check_pool_for_provider(Settings(provider="cuda"), "prefork", serving=serving)
    assert problem is not None
    assert f"provider {serving}" in problem and "unsafe once CUDA is initialised" in problem
    assert "--pool solo" in problem and "--pool threads" in problem


@pytest.mark.parametrize("pool", ["solo", "threads"])
@pytest.mark.parametrize("serving", [CPU, CUDA, TENSORRT])
def test_solo_and_threads_are_always_allowed(pool: str, serving: str) -> None:
    assert check_pool_for_provider(Settings(provider="cuda"), pool, serving=serving) is None


def test_prefork_is_allowed_on_cpu() -> None:
    assert check_pool_for_provider(Settings(provider="cpu"), "prefork", serving=CPU) is None


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="this machine's onnxruntime has CUDA")
def test_cuda_requested_without_cuda_serves_on_cpu_so_prefork_is_allowed() -> None:
    settings = Settings(provider="cuda")
    assert serving_provider(settings) == CPU
    assert check_pool_for_provider(settings, "prefork") is None


def test_voxmill_worker_refuses_prefork_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("VOXMILL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VOXMILL_PROVIDER", "cuda")
    monkeypatch.setenv("VOXMILL_BROKER_URL", "redis://127.0.0.1:1/0")  # never reached
    monkeypatch.setattr(worker, "serving_provider", lambda settings: CUDA)
    result = CliRunner().invoke(app, ["worker", "-Q", "tokenize", "--pool", "prefork"])
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "unsafe once CUDA is initialised" in output and "--pool solo" in output
