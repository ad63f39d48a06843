"""Validation of candidate models in child processes (no Redis; real tiny stand-ins)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.settings import Settings
from workers.reload.validation import Validator, start_method, verdict_from


def test_a_verdict_is_taken_as_sent() -> None:
    verdict = verdict_from({"ok": True, "sha256": "ab", "details": {"variant": "campplus"}}, 0)
    assert verdict.ok and verdict.sha256 == "ab" and verdict.details == {"variant": "campplus"}


def test_a_refusal_carries_its_reason() -> None:
    verdict = verdict_from({"ok": False, "reason": "campplus.onnx input 0 has rank 2"}, 0)
    assert not verdict.ok and "rank 2" in verdict.reason


def test_a_validator_that_died_is_a_rejection() -> None:
    verdict = verdict_from(None, -11)
    assert not verdict.ok and "killed by signal 11" in verdict.reason
    assert "code 1" in verdict_from(None, 1).reason


def test_validator_accepts_a_stand_in_and_rejects_a_truncated_copy(tiny_models: Path, tmp_path: Path) -> None:
    validator = Validator(Settings(provider="cpu"))
    good = validator.validate(tiny_models / "campplus.onnx", "embedder")
    assert good.ok, good.reason
    assert good.sha256 == hashlib.sha256((tiny_models / "campplus.onnx").read_bytes()).hexdigest()
    truncated = tmp_path / "campplus.onnx"
    truncated.write_bytes((tiny_models / "campplus.onnx").read_bytes()[:1000])
    bad = validator.validate(truncated, "embedder")
    assert not bad.ok and "not a loadable ONNX model" in bad.reason


def test_validator_rejects_a_candidate_that_takes_too_long(tiny_models: Path) -> None:
    validator = Validator(Settings(provider="cpu", watch_validate_timeout_s=0.001))
    verdict = validator.validate(tiny_models / "speech_tokenizer_v2.onnx", "tokenizer")
    assert not verdict.ok and "did not finish within" in verdict.reason


def test_a_deep_temporary_folder_validates_by_spawning(
    tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forkserver's Unix socket lives in TMPDIR; under a deep one (a private folder in a test's
    temporary tree, say) it cannot be made, and every validation failed and was tried again forever."""
    import tempfile

    assert start_method("/tmp") == "forkserver"
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    assert start_method(str(deep)) == "spawn"
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    verdict = Validator(Settings(provider="cpu")).validate(tiny_models / "campplus.onnx", "embedder")
    assert verdict.ok, verdict.reason
