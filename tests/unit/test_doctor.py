"""`voxmill doctor`'s checks on real files and this machine's ONNX Runtime (no broker: see
tests/integration/test_doctor.py): a healthy folder, and each broken one giving its error line."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from rich.console import Console

from pipeline.models.standin import make_embedder_model, write_model
from pipeline.settings import Settings
from tests.unit.test_sessions import wrong_rank_embedder
from workers.observe.doctor import (
    Check,
    checks_json,
    exit_code,
    find_shared_library,
    library_report,
    memory_check,
    package_checks,
    render,
    run_checks,
)

LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:d43342aa12163a80bf07bffb94c9de2e120a8df2f9917cd2f642e7f4219c6f71\n"
    "size 522625011\n"
)


@pytest.fixture
def models(tiny_models: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    shutil.copytree(tiny_models, folder)
    return folder


def settings_for(tmp_path: Path, models: Path, **overrides: object) -> Settings:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700, exist_ok=True)
    values: dict[str, object] = {
        "model_dir": models,
        "allowed_roots": (tmp_path,),
        "model_cache_dir": cache,
        "provider": "cpu",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def errors_of(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks if c.status == "error"}


def test_a_healthy_folder_has_no_error(tmp_path: Path, models: Path) -> None:
    checks = run_checks(settings_for(tmp_path, models))
    found = by_name(checks)
    assert not errors_of(checks), errors_of(checks)
    assert exit_code(checks) == 0
    for name in ("python", "packages", "provider", "tokenizer signature", "embedder onnx", "model cache"):
        assert found[name].status == "ok", found[name]
    assert "IR 8, opset ai.onnx 17" in found["tokenizer onnx"].detail
    assert found["provider"].detail.startswith("cpu: CPUExecutionProvider serves")
    # a stand-in is no known release: the tokenizer's token rate is only the name's guess
    assert (
        found["tokenizer variant"].status == "warning"
        and "taken by its name as v2" in found["tokenizer variant"].detail
    )
    assert found["broker"].status == "warning" and "VOXMILL_BROKER_URL" in found["broker"].fix


def test_a_git_lfs_pointer_is_an_error_naming_git_lfs(tmp_path: Path, models: Path) -> None:
    (models / "speech_tokenizer_v2.onnx").write_text(LFS_POINTER)
    checks = run_checks(settings_for(tmp_path, models))
    failed = errors_of(checks)
    assert set(failed) == {"tokenizer file"}
    assert (
        "git-lfs pointer" in failed["tokenizer file"].detail
        and "git lfs pull" in failed["tokenizer file"].fix
    )
    assert "tokenizer signature" not in by_name(checks)  # nothing more to say about a pointer
    assert exit_code(checks) == 1


def test_a_wrong_rank_model_is_a_signature_error(tmp_path: Path, models: Path) -> None:
    wrong_rank_embedder(models / "campplus.onnx")
    failed = errors_of(run_checks(settings_for(tmp_path, models)))
    assert set(failed) == {"embedder signature"}
    assert (
        "rank 2" in failed["embedder signature"].detail
        and "expected rank 3" in failed["embedder signature"].detail
    )


def test_a_model_too_new_for_this_onnxruntime_is_an_error(tmp_path: Path, models: Path) -> None:
    model = make_embedder_model("tiny")
    model.ir_version = 99
    write_model(model, models / "campplus.onnx")
    failed = errors_of(run_checks(settings_for(tmp_path, models)))
    assert set(failed) == {"embedder onnx"}
    assert "needs a newer onnxruntime" in failed["embedder onnx"].detail
    assert "IR version: 99" in failed["embedder onnx"].detail  # ONNX Runtime's own reason
    assert "pip install -U onnxruntime" in failed["embedder onnx"].fix


def test_a_file_that_is_no_onnx_and_missing_external_data_are_errors(tmp_path: Path, models: Path) -> None:
    (models / "speech_tokenizer_v2.onnx").write_bytes(b"\x08\x07garbage, not protobuf" * 50)
    model = make_embedder_model("tiny")
    onnx.save(
        model,
        models / "campplus.onnx",
        save_as_external_data=True,
        location="campplus.data",
        size_threshold=0,
    )
    (models / "campplus.data").unlink()
    failed = errors_of(run_checks(settings_for(tmp_path, models)))
    assert set(failed) == {"tokenizer onnx", "embedder onnx"}
    assert "is not an ONNX model" in failed["tokenizer onnx"].detail
    assert "campplus.data" in failed["embedder onnx"].detail


def test_a_world_writable_cache_folder_is_an_error(tmp_path: Path, models: Path) -> None:
    settings = settings_for(tmp_path, models)
    settings.model_cache_dir.chmod(0o777)
    failed = errors_of(run_checks(settings))
    assert set(failed) == {"model cache"}
    assert "writable by its group or others" in failed["model cache"].detail
    assert "chmod 700" in failed["model cache"].fix


def test_the_batch_tokenizer_is_checked_apart_and_not_sized(tmp_path: Path, models: Path) -> None:
    found = by_name(run_checks(settings_for(tmp_path, models)))
    assert "speech_tokenizer_v2.batch.onnx" in found["tokenizer batch file"].detail
    assert "dynamic batch axis" in found["tokenizer batch signature"].detail
    assert found["tokenizer batch variant"].status == "ok" and "v2" in found["tokenizer batch variant"].detail
    assert "speech_tokenizer_v2.onnx" in found["tokenizer file"].detail  # the file that serves, as before
    # The single-clip file under the batch name: no batch axis, an error; the served file is fine.
    shutil.copy(models / "speech_tokenizer_v2.onnx", models / "speech_tokenizer_v2.batch.onnx")
    failed = errors_of(run_checks(settings_for(tmp_path, models)))
    assert set(failed) == {"tokenizer batch signature"}
    assert "dynamic batch axis" in failed["tokenizer batch signature"].detail


def test_missing_models_and_roots(tmp_path: Path, models: Path) -> None:
    (models / "campplus.onnx").unlink()
    settings = settings_for(tmp_path, models, allowed_roots=(tmp_path, tmp_path / "absent"))
    checks = run_checks(settings)
    assert by_name(checks)["embedder file"].status == "warning"  # a tokenize-only machine is fine
    roots = [c for c in checks if c.name == "allowed root"]
    assert [c.status for c in roots] == ["ok", "error"] and "absent" in roots[1].detail
    nothing = run_checks(settings_for(tmp_path, tmp_path / "no-such-folder"))
    assert errors_of(nothing)["models"].detail.endswith("does not exist")


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="this onnxruntime has CUDA"
)
@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_a_gpu_provider_this_onnxruntime_lacks_is_an_error(
    tmp_path: Path, models: Path, provider: str
) -> None:
    failed = errors_of(run_checks(settings_for(tmp_path, models, provider=provider)))
    assert set(failed) == {"provider"}
    assert "would serve" in failed["provider"].detail and "onnxruntime-gpu" in failed["provider"].fix


def test_libraries_are_named_found_or_missing() -> None:
    assert find_shared_library("c") is not None  # libc: the search itself works
    assert find_shared_library("voxmill-no-such-library") is None
    report, missing = library_report("TensorrtExecutionProvider", find=lambda name: None)
    assert missing == ["libcudart", "libcublas", "libcudnn", "libnvinfer"]
    assert report.startswith("libcudart missing")


def test_two_onnxruntime_flavours_are_an_error() -> None:
    versions = {"onnxruntime": "1.20.1", "onnxruntime-gpu": "1.20.1"}

    def version_of(name: str) -> str:
        import importlib.metadata

        return versions.get(name) or importlib.metadata.version(name)

    failed = {c.name: c for c in package_checks(version_of) if c.status == "error"}
    assert "both onnxruntime" in failed["onnxruntime"].detail and "pip uninstall" in failed["onnxruntime"].fix


def test_memory_against_the_models_load_size() -> None:
    gib = 2**30
    assert memory_check(16 * gib, 500_000_000, 8).status == "ok"
    tight = memory_check(3 * gib, 500_000_000, 8)
    assert tight.status == "warning" and "-c 3" in tight.fix
    assert memory_check(gib // 2, 500_000_000, 8).status == "error"


def test_render_one_line_per_check_and_json() -> None:
    checks = [
        Check("python", "ok", "3.11"),
        Check("broker", "error", "cannot reach redis://127.0.0.1:1/0", "start Redis"),
    ]
    console = Console(record=True, width=200)
    render(checks, console)
    lines = console.export_text().splitlines()
    assert lines[0].split() == ["ok", "python", "3.11"]
    assert lines[1].startswith("error") and lines[1].endswith("-> start Redis")
    assert lines[-1] == "1 ok, 0 warning(s), 1 error(s)"
    report = checks_json(checks)
    assert report["status"] == "error" and report["counts"] == {"ok": 1, "warning": 0, "error": 1}
    assert report["checks"][1] == {
        "name": "broker",
        "status": "error",
        "detail": "cannot reach redis://127.0.0.1:1/0",
        "fix": "start Redis",
    }
    assert exit_code(checks) == 1 and exit_code(checks[:1]) == 0
