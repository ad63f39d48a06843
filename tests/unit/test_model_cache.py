"""The optimized-model cache: built on the first load, reused after, same outputs, never trusted blindly."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from pipeline.demo import speechlike
from pipeline.errors import VoxmillError
from pipeline.features import whisper_log_mel
from pipeline.inference import embedder_inputs, open_session, tokenizer_inputs
from pipeline.models import files
from pipeline.models.cache import ENTRY_FILE, HASHES_DIR, MODEL_FILE, ModelCache, cache_key, cpu_fingerprint
from pipeline.models.files import RACY_MARGIN_NS, PinnedModelFile
from pipeline.models.identity import FileIdentity
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession, _session_options
from pipeline.models.standin import make_standins
from pipeline.settings import Settings

REGISTRY = Registry.load()


def options(cache: Path | None, **kwargs: object) -> SessionOptions:
    return replace(SessionOptions(provider="cpu", warmup_runs=1), model_cache_dir=cache, **kwargs)  # type: ignore[arg-type]


def model_path(models: Path, role: str) -> Path:
    return REGISTRY.find_model(role, models)


def outputs_of(session: ModelSession) -> list[np.ndarray]:
    wave = speechlike(4.0, 16000, 150.0, seed=3)
    inputs = tokenizer_inputs(whisper_log_mel(wave)) if session.role == "tokenizer" else embedder_inputs(wave)
    return session.run(inputs)


def entries(cache: Path) -> list[Path]:
    """Committed entries (none when a refused load never got as far as creating the folder); not
    the known-hashes folder, which a load that hashed a file more than a second old writes."""
    if not cache.exists():
        return []
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".") and p.name != HASHES_DIR)


@pytest.mark.parametrize("role", ["tokenizer", "embedder"])
def test_first_load_builds_the_entry_and_later_loads_use_it_with_identical_outputs(
    models: Path, tmp_path: Path, role: str
) -> None:
    path = model_path(models, role)
    cache = tmp_path / "cache"
    plain = open_session(path, role, options(None), REGISTRY)
    first = open_session(path, role, options(cache), REGISTRY)
    second = open_session(path, role, options(cache), REGISTRY)
    assert (plain.cache_state, first.cache_state, second.cache_state) == ("off", "built", "hit")
    assert plain.sha256 == first.sha256 == second.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    [entry] = entries(cache)
    assert entry.name == cache_key(plain.sha256, ort.__version__)
    assert (entry / MODEL_FILE).exists()
    assert json.loads((entry / ENTRY_FILE).read_text())["sha256"] == plain.sha256
    for a, b, c in zip(outputs_of(plain), outputs_of(first), outputs_of(second), strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert second.describe()["model_cache"] == "hit"


@pytest.mark.parametrize("role", ["tokenizer", "embedder"])
def test_a_session_without_prepacking_writes_the_same_entry_and_gives_the_same_outputs(
    models: Path, tmp_path: Path, role: str
) -> None:
    """The validator builds without pre-packed weights; the entry the workers load must not differ."""
    path = model_path(models, role)
    packed = open_session(path, role, options(tmp_path / "packed"), REGISTRY)
    unpacked = open_session(path, role, options(tmp_path / "unpacked", prepack=False), REGISTRY)
    assert (
        _session_options(ort, options(None, prepack=False)).get_session_config_entry(
            "session.disable_prepacking"
        )
        == "1"
    )
    [a], [b] = entries(tmp_path / "packed"), entries(tmp_path / "unpacked")
    for name in sorted(p.name for p in a.iterdir() if p.name != ENTRY_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for x, y in zip(outputs_of(packed), outputs_of(unpacked), strict=True):
        assert np.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_cache_folder_and_entries_are_private(models: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_session(model_path(models, "embedder"), "embedder", options(cache), REGISTRY)
    assert cache.stat().st_mode & 0o077 == 0
    assert all(entry.stat().st_mode & 0o077 == 0 for entry in entries(cache))


def test_a_folder_others_can_write_is_not_used(
    models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "shared-cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    with caplog.at_level(logging.WARNING, logger="voxmill.model_cache"):
        session = open_session(model_path(models, "embedder"), "embedder", options(cache), REGISTRY)
    assert session.cache_state == "off" and not list(cache.iterdir())
    assert "writable by its group or others" in caplog.text


def test_a_tampered_or_broken_entry_is_rebuilt_not_trusted(models: Path, tmp_path: Path) -> None:
    path = model_path(models, "tokenizer")
    cache = tmp_path / "cache"
    reference = outputs_of(open_session(path, "tokenizer", options(cache), REGISTRY))
    [entry] = entries(cache)
    with open(entry / MODEL_FILE, "r+b") as stream:  # truncated: the size no longer matches
        stream.truncate(100)
    rebuilt = open_session(path, "tokenizer", options(cache), REGISTRY)
    assert rebuilt.cache_state == "built"
    for a, b in zip(reference, outputs_of(rebuilt), strict=True):
        assert np.array_equal(a, b)
    # same size, garbage content: ONNX Runtime refuses it and the entry is rebuilt from the source
    size = (entry / MODEL_FILE).stat().st_size
    (entry / MODEL_FILE).write_bytes(b"\0" * size)
    again = open_session(path, "tokenizer", options(cache), REGISTRY)
    assert again.cache_state == "rebuilt"
    assert open_session(path, "tokenizer", options(cache), REGISTRY).cache_state == "hit"


def test_the_key_changes_with_the_model_onnx_runtime_and_cpu() -> None:
    base = cache_key("a" * 64, "1.20.0", cpu="c1")
    assert cache_key("b" * 64, "1.20.0", cpu="c1") != base
    assert cache_key("a" * 64, "1.21.0", cpu="c1") != base
    assert cache_key("a" * 64, "1.20.0", cpu="c2") != base
    assert cache_key("a" * 64, "1.20.0", provider="cuda", cpu="c1") != base
    assert cache_key("a" * 64, "1.20.0", cpu="c1") == base and base.startswith("a" * 16)
    assert len(cpu_fingerprint()) == 12


def test_a_new_model_gets_its_own_entry_and_old_ones_are_pruned(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for seed in range(3):
        folder = tmp_path / f"models-{seed}"
        make_standins(folder, seed=seed)
        open_session(folder / "campplus.onnx", "embedder", options(cache, model_cache_keep=2), REGISTRY)
    kept = entries(cache)
    assert len(kept) == 2
    newest = hashlib.sha256((tmp_path / "models-2" / "campplus.onnx").read_bytes()).hexdigest()
    assert any(entry.name.startswith(newest[:16]) for entry in kept)
    assert ModelCache(cache, keep=1).prune() and len(entries(cache)) == 1


def test_the_stream_hash_path_keeps_the_refusals(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file just written is never recorded as known; here it is, whatever the test's timing.
    monkeypatch.setattr(files, "RACY_MARGIN_NS", 0)
    cache = tmp_path / "cache"
    with pytest.raises(VoxmillError) as caught:
        ModelSession.load(
            models / "campplus.onnx", "embedder", options(cache), REGISTRY, expected_sha256="0" * 64
        )
    assert caught.value.code == "model_error" and "sha256" in caught.value.message
    pointer = tmp_path / "campplus.onnx"
    pointer.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    with pytest.raises(VoxmillError) as caught:
        ModelSession.load(pointer, "embedder", options(cache), REGISTRY)
    assert "git-lfs pointer" in caught.value.message
    missing = tmp_path / "nothing.onnx"
    with pytest.raises(VoxmillError) as caught:
        ModelSession.load(missing, "embedder", options(cache), REGISTRY)
    assert "does not exist" in caught.value.message
    assert not entries(cache)


def test_a_cpu_session_does_not_keep_a_copy_of_the_model_bytes(models: Path) -> None:
    session = open_session(model_path(models, "tokenizer"), "tokenizer", options(None), REGISTRY)
    assert getattr(session.session, "_model_bytes", None) is None


def test_settings_turn_the_cache_on_by_default_and_off_on_request() -> None:
    assert SessionOptions.from_settings(Settings()).model_cache_dir == Path(".voxmill/ort-cache")
    off = Settings.load(environ={"VOXMILL_MODEL_CACHE": "false"})
    assert SessionOptions.from_settings(off).model_cache_dir is None


def settled_copy(source: Path, target: Path) -> Path:
    """A copy whose last change is older than the racy margin, so a hash of it is remembered."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    time.sleep(RACY_MARGIN_NS / 1e9 + 0.1)
    return target


def test_a_hashed_unchanged_file_is_not_read_again(models: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    assert cache.usable()
    path = settled_copy(model_path(models, "embedder"), tmp_path / "m" / "campplus.onnx")
    truth = hashlib.sha256(path.read_bytes()).hexdigest()
    with PinnedModelFile(path, known=cache) as first:
        assert first.hashed and first.sha256 == truth
    with PinnedModelFile(path, known=cache) as second:
        assert not second.hashed and second.sha256 == truth
    session = ModelSession.load(path, "embedder", options(tmp_path / "cache"), REGISTRY)
    assert session.sha256 == truth and session.cache_state == "built"
    assert ModelSession.load(path, "embedder", options(tmp_path / "cache"), REGISTRY).cache_state == "hit"


def test_a_file_rewritten_in_place_with_its_old_size_and_mtime_is_hashed_again(
    models: Path, tmp_path: Path
) -> None:
    cache = ModelCache(tmp_path / "cache")
    assert cache.usable()
    path = settled_copy(model_path(models, "embedder"), tmp_path / "m" / "campplus.onnx")
    with PinnedModelFile(path, known=cache) as first:
        old = first.sha256
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    with path.open("r+b") as stream:  # in place: same inode
        stream.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the old modification time back
    assert path.stat().st_ino == before.st_ino and path.stat().st_size == before.st_size
    with PinnedModelFile(path, known=cache) as second:
        assert second.hashed and second.sha256 == hashlib.sha256(bytes(data)).hexdigest() != old


def test_a_file_changed_just_before_it_was_hashed_is_not_remembered(models: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    assert cache.usable()
    path = tmp_path / "m" / "campplus.onnx"
    path.parent.mkdir()
    path.write_bytes(model_path(models, "embedder").read_bytes())  # just written: racy
    with PinnedModelFile(path, known=cache):
        pass
    with PinnedModelFile(path, known=cache) as again:
        assert again.hashed
    assert not cache.known_sha256(FileIdentity.of(path))


def test_a_remembered_git_lfs_pointer_is_still_named_as_such(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    assert cache.usable()
    pointer = tmp_path / "m" / "campplus.onnx"
    pointer.parent.mkdir()
    pointer.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n")
    time.sleep(RACY_MARGIN_NS / 1e9 + 0.1)
    with PinnedModelFile(pointer, known=cache, check_head=False) as watched:  # the watcher hashes anything
        assert watched.hashed
    assert cache.known_sha256(FileIdentity.of(pointer)) == watched.sha256
    with pytest.raises(VoxmillError) as caught:
        ModelSession.load(pointer, "embedder", options(tmp_path / "cache"), REGISTRY)
    assert "git-lfs pointer" in caught.value.message
