"""A corpus run with the speech check on, quality filters, provenance on every output, and a run
that spanned a model change redone with `--redo-mixed`, all through `voxmill extract`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline.models.standin import make_standins
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import PROVENANCE_METADATA_KEY
from tests.conftest import voxmill
from tests.speech_audio import RATE, espeak_wave, needs_espeak

SPEECH_ON = {"VOXMILL_SPEECH_CHECK": "true"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three clips of espeak-ng speech, one of them padded to mostly silence, a tone and silence."""
    folder = tmp_path_factory.mktemp("quality-corpus")
    speech = espeak_wave()
    quiet = np.zeros(int(RATE * 2.5 * len(speech) / RATE), dtype=np.float32)
    tone = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(2 * RATE) / RATE)
    clips = {
        "a/speech1": speech,
        "a/speech2": speech[::-1].copy() * 0.5 + speech * 0.5,
        "b/speech3": speech * 0.8,
        "b/mostly_silence": np.concatenate([quiet, speech, quiet]),
        "c/tone": tone,
        "c/silence": np.zeros(2 * RATE),
    }
    for name, wave in clips.items():
        path = folder / f"{name}.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, np.asarray(wave, dtype=np.float32), RATE, subtype="PCM_16")
    return folder


def run(corpus: Path, out: Path, models: Path, *extra: str, env: dict[str, str] | None = None):
    done = voxmill(
        "extract", str(corpus), "--out", str(out), "--models", str(models), "--workers", "2",
        "--shard-size", "2", "--quiet", *extra, env={**SPEECH_ON, **(env or {})}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def errors_by_utt(out: Path) -> dict[str, dict[str, str]]:
    lines = (out / "errors.jsonl").read_text().splitlines()
    return {row["utt"]: row for row in map(json.loads, lines)}


@needs_espeak
def test_speech_check_filters_and_provenance(tmp_path: Path, tiny_models: Path, corpus: Path) -> None:
    out = tmp_path / "out"
    run(corpus, out, tiny_models, "--min-speech-ratio", "0.4")
    errors = errors_by_utt(out)
    assert errors["c/tone"]["code"] == "no_speech" and errors["c/silence"]["code"] == "empty"
    assert errors["b/mostly_silence"]["code"] == "filtered"
    assert "below --min-speech-ratio 0.4" in errors["b/mostly_silence"]["message"]

    tokens = pq.read_table(out / "speech_tokens.parquet")
    assert sorted(tokens.column("utt").to_pylist()) == ["a/speech1", "a/speech2", "b/speech3"]
    stats = {row["utt"]: row for row in pq.read_table(out / "utt_stats.parquet").to_pylist()}
    assert stats["a/speech1"]["speech_ratio"] > 0.5 and stats["b/mostly_silence"]["speech_ratio"] < 0.4
    assert stats["a/speech1"]["source_rate_hz"] == RATE and stats["a/speech1"]["source_channels"] == 1

    report = json.loads((out / "report.json").read_text())
    assert report["filters"]["min_speech_ratio"] == 0.4 and report["filters"]["filtered_utterances"] == 1
    assert report["stats"]["speech_ratio"]["p50"] > 0
    provenance = report["provenance"]
    tokenizer = tiny_models / "speech_tokenizer_v2.onnx"  # the file that serves, not its batch twin
    assert provenance["models"]["tokenizer"]["sha256"] == sha256(tokenizer)
    assert provenance["models"]["embedder"]["sha256"] == sha256(tiny_models / "campplus.onnx")
    assert provenance["providers"] == {
        "tokenizer": "CPUExecutionProvider",
        "embedder": "CPUExecutionProvider",
    }
    assert provenance["onnxruntime"] == [ort.__version__]
    assert provenance["frontend"]["sample_rate_hz"] == 16000
    for name in (
        "speech_tokens.parquet",
        "utt_embeddings.parquet",
        "spk_embeddings.parquet",
        "utt_stats.parquet",
    ):
        metadata = pq.read_metadata(out / name).metadata  # the file's key-value metadata
        assert json.loads(metadata[PROVENANCE_METADATA_KEY.encode()]) == provenance, name
    assert set(tokens.column("model_sha256").to_pylist()) == {sha256(tokenizer)}

    # Other filters re-merge what is there: nothing is extracted again.
    shards = {p.name: p.stat().st_mtime_ns for p in (out / RunFolder.SHARDS).iterdir()}
    run(corpus, out, tiny_models, "--min-duration", "100")
    assert {p.name: p.stat().st_mtime_ns for p in (out / RunFolder.SHARDS).iterdir()} == shards
    assert {row["code"] for row in errors_by_utt(out).values()} == {"no_speech", "empty", "filtered"}
    assert (
        not (out / "speech_tokens.parquet").exists()
        or pq.read_table(out / "speech_tokens.parquet").num_rows == 0
    )


@needs_espeak
def test_redo_mixed_redoes_the_shards_another_model_made(
    tmp_path: Path, tiny_models: Path, corpus: Path
) -> None:
    models = tmp_path / "models"
    shutil.copytree(tiny_models, models)
    out = tmp_path / "out"
    run(corpus, out, models, "--ops", "embed")
    old = sha256(models / "campplus.onnx")
    # Half the shards as if a reload had come mid-run: delete them, swap the model, resume.
    shard_files = sorted((out / RunFolder.SHARDS).iterdir())
    for path in shard_files[::2]:
        path.unlink()
    replaced = tmp_path / "replaced"
    make_standins(replaced, profile="tiny", seed=1)
    shutil.copy(replaced / "campplus.onnx", models / "campplus.onnx")
    new = sha256(models / "campplus.onnx")
    assert new != old
    run(corpus, out, models, "--ops", "embed")
    rows = pq.read_table(out / "utt_embeddings.parquet").to_pylist()
    assert {row["model_sha256"] for row in rows} == {old, new}  # split exactly by row

    redone = run(corpus, out, models, "--ops", "embed", "--redo-mixed")
    kept = len(shard_files) - len(shard_files[::2])
    assert f"--redo-mixed: {kept} shard file(s) made by another model deleted" in redone.stderr
    rows = pq.read_table(out / "utt_embeddings.parquet").to_pylist()
    assert {row["model_sha256"] for row in rows} == {new} and len(rows) == 4
    again = run(corpus, out, models, "--ops", "embed", "--redo-mixed")
    assert "--redo-mixed: 0 shard file(s)" in again.stderr
