"""TensorRT engine cache wiring and ahead-of-time builds, checked on CPU (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import onnxruntime as ort
import pytest

from pipeline.errors import VoxmillError
from pipeline.models.engines import (
    build_engine,
    build_engines,
    engine_status,
    profile_inputs,
    run_profile_shapes,
    tensorrt_options,
)
from pipeline.models.files import sha256_bytes
from pipeline.models.host import HostInfo
from pipeline.models.options import SessionOptions
from pipeline.models.planning import plan_providers
from pipeline.models.providers import CPU, CUDA, TENSORRT, ProviderOptions, engine_cache_dir
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from tests.conftest import voxmill

HOST = HostInfo("NVIDIA H200", {"onnxruntime": "1.20.1", "tensorrt": "10.4.0", "cuda": "12.4"})
ALL = [TENSORRT, CUDA, CPU]
HAS_TENSORRT = TENSORRT in ort.get_available_providers()


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load()


def trt_options(cache: Path, provider: str = "tensorrt", fp16: bool = False) -> SessionOptions:
    return SessionOptions(
        provider=provider, provider_options=ProviderOptions(engine_cache_dir=cache, trt_fp16=fp16)
    )


def no_detection(device_id: int) -> HostInfo:
    raise AssertionError("the GPU was probed although TensorRT cannot serve")


# ------------------------------------------------------------------ cache folder wiring
@pytest.mark.parametrize("role", ["tokenizer", "embedder"])
def test_tensorrt_gets_the_keyed_cache_folder_and_the_registry_profile(
    tmp_path: Path, tiny_models: Path, registry: Registry, role: str
) -> None:
    path = registry.find_model(role, tiny_models)
    data = path.read_bytes()
    sha256 = sha256_bytes(data)
    options = trt_options(tmp_path / "engines", fp16=True)
    choice, folder = plan_providers(options, registry.role(role), data, sha256, ALL, HOST)
    assert folder == engine_cache_dir(options.provider_options, sha256, HOST)
    assert folder is not None and folder.parent == tmp_path / "engines"
    trt = dict(choice.providers)[TENSORRT]
    assert trt["trt_engine_cache_path"] == trt["trt_timing_cache_path"] == str(folder)
    assert trt["trt_fp16_enable"] == "True"
    spec = registry.role(role)
    dims = "x".join(str(d) for d in spec.profiles["max"])
    assert trt["trt_profile_max_shapes"].split(",")[0].endswith(f":{dims}")
    if role == "tokenizer":  # feats and feats_length, named as the file names them
        assert trt["trt_profile_min_shapes"] == "feats:1x128x4,feats_length:1"


@pytest.mark.parametrize(
    ("provider", "available"), [("auto", [CUDA, CPU]), ("auto", [CPU]), ("cuda", ALL), ("cpu", ALL)]
)
def test_no_tensorrt_means_no_gpu_probe_and_no_cache_folder(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_models: Path,
    registry: Registry,
    provider: str,
    available: list[str],
) -> None:
    import pipeline.models.planning as planning

    monkeypatch.setattr(planning, "detect_host", no_detection)
    data = (tiny_models / "campplus.onnx").read_bytes()
    choice, folder = plan_providers(
        trt_options(tmp_path, provider), registry.role("embedder"), data, "e" * 64, available
    )
    assert folder is None and TENSORRT not in choice.names


@pytest.mark.filterwarnings("ignore:Specified provider:UserWarning")
def test_load_wires_the_cache_folder_and_warns_once_when_tensorrt_cannot_start(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_models: Path,
    registry: Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # ONNX Runtime is told TensorRT and CUDA exist; this CPU build then starts neither, as on a
    # machine whose CUDA/cuDNN/TensorRT libraries are missing.
    monkeypatch.setattr(ort, "get_available_providers", lambda: ALL)
    path = tiny_models / "speech_tokenizer_v2.onnx"
    options = trt_options(tmp_path / "engines")
    with caplog.at_level(logging.WARNING, logger="voxmill.sessions"):
        session = ModelSession.load(path, "tokenizer", options, registry, host=HOST)
    expected = engine_cache_dir(options.provider_options, sha256_bytes(path.read_bytes()), HOST)
    assert session.engine_dir == expected and expected.is_dir()
    assert session.describe()["engine_dir"] == str(expected)
    assert session.active_providers == [CPU]
    warnings = [r.getMessage() for r in caplog.records if r.name == "voxmill.sessions"]
    assert len(warnings) == 1
    assert "TensorrtExecutionProvider could not start" in warnings[0]
    assert warnings[0].endswith("running on CPUExecutionProvider instead")


@pytest.mark.filterwarnings("ignore:Specified provider:UserWarning")
def test_an_unwritable_cache_folder_is_a_model_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_models: Path, registry: Registry
) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: ALL)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(VoxmillError, match="VOXMILL_ENGINE_CACHE_DIR") as caught:
        ModelSession.load(
            tiny_models / "campplus.onnx", "embedder", trt_options(blocker), registry, host=HOST
        )
    assert caught.value.code == "model_error"


def test_cpu_load_has_no_engine_folder(tiny_models: Path, registry: Registry) -> None:
    session = ModelSession.load(tiny_models / "campplus.onnx", "embedder", SessionOptions(), registry)
    assert session.engine_dir is None and session.describe()["engine_dir"] is None


# ------------------------------------------------------------------ engine status
def test_engine_status_ready_missing_and_not_applicable(tmp_path: Path) -> None:
    options = ProviderOptions(engine_cache_dir=tmp_path)
    assert engine_status("a" * 64, options, [CPU], HOST).detail == "n/a (no TensorRT)"
    missing = engine_status("a" * 64, options, ALL, HOST)
    assert missing.state == "missing" and "voxmill models build-engine" in missing.detail
    folder = engine_cache_dir(options, "a" * 64, HOST)
    folder.mkdir(parents=True)
    (folder / "TensorrtExecutionProvider_cache_sm90.timing").write_bytes(b"t")
    assert engine_status("a" * 64, options, ALL, HOST).state == "missing"  # a timing cache is no engine
    (folder / "TensorrtExecutionProvider_TRTKernel_graph_main_1_0_0_sm90.engine").write_bytes(b"e")
    ready = engine_status("a" * 64, options, ALL, HOST)
    assert ready.state == "ready" and ready.engine_dir == folder
    assert ready.to_dict()["engine_dir"] == str(folder)
    other_gpu = HostInfo("NVIDIA L4", HOST.versions)
    assert engine_status("a" * 64, options, ALL, other_gpu).state == "missing"
    assert engine_status("b" * 64, options, ALL, HOST).state == "missing"
    fp16 = dataclasses.replace(options, trt_fp16=True)
    assert engine_status("a" * 64, fp16, ALL, HOST).state == "missing"


# ------------------------------------------------------------------ building
@pytest.mark.parametrize("role", ["tokenizer", "embedder"])
def test_the_profile_shapes_run_on_the_stand_ins(tiny_models: Path, registry: Registry, role: str) -> None:
    session = ModelSession.load(registry.find_model(role, tiny_models), role, SessionOptions(), registry)
    timings = run_profile_shapes(session)
    assert list(timings) == ["min", "opt", "max"]
    for level in timings:
        outputs = session.run(profile_inputs(role, registry.role(role).profiles[level]))
        assert outputs[0].size > 0


def test_tensorrt_options_force_the_provider_and_the_precision() -> None:
    base = SessionOptions(provider="cpu", provider_options=ProviderOptions(trt_fp16=True))
    assert tensorrt_options(base, None).provider == "tensorrt"
    assert tensorrt_options(base, None).provider_options.trt_fp16 is True
    assert tensorrt_options(base, False).provider_options.trt_fp16 is False


@pytest.mark.filterwarnings("ignore:Specified provider:UserWarning")
@pytest.mark.skipif(HAS_TENSORRT, reason="checks the refusal on a machine without TensorRT")
def test_build_without_tensorrt_is_refused_with_the_reason(
    tmp_path: Path, tiny_models: Path, registry: Registry
) -> None:
    with pytest.raises(VoxmillError, match="no TensorRT engine built.*voxmill\\[gpu\\]"):
        build_engine(tiny_models / "campplus.onnx", "embedder", trt_options(tmp_path), registry, HOST)


def test_build_in_a_folder_without_models_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(VoxmillError) as caught:
        build_engines(tmp_path, trt_options(tmp_path / "engines"), host=HOST)
    assert caught.value.code == "not_found"


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the refusal on a machine without TensorRT")
def test_build_engine_command_without_tensorrt_exits_2_saying_what_to_install(tiny_models: Path) -> None:
    done = voxmill("models", "build-engine", str(tiny_models), "--fp16")
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "TensorRT is not available" in message
    assert "pip install 'voxmill[gpu]'" in message and "libnvinfer" in message


def test_verify_reports_the_engine_per_model(tiny_models: Path) -> None:
    done = voxmill("models", "verify", str(tiny_models), "--json", env={"VOXMILL_PROVIDER": "cpu"})
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {row["role"] for row in rows} == {"tokenizer", "embedder"}
    for row in rows:
        expected = "n/a" if not HAS_TENSORRT else row["engine"]["state"]
        assert row["engine"]["state"] == expected


def test_list_names_each_model_by_the_sha256_of_its_bytes_and_a_pointer_as_such(
    tiny_models: Path, tmp_path: Path
) -> None:
    done = voxmill("models", "list", str(tiny_models), "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["role"]: row for row in json.loads(done.stdout)}
    for row in rows.values():
        assert row["ok"] and row["sha256"] == sha256_bytes(Path(row["path"]).read_bytes())
    (tmp_path / "campplus.onnx").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    pointer = voxmill("models", "list", str(tmp_path), "--json")
    listed = {row["role"]: row for row in json.loads(pointer.stdout)}
    assert not listed["embedder"]["ok"] and "git-lfs pointer" in listed["embedder"]["error"]["message"]
