"""The speech check in `run_clip`: real speech passes, hum is `no_speech` with its stats, settings
turn it off; and the shard file carries the stats and each row's model sha256."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline import Extractor
from pipeline.audio.quality import STAT_FIELDS
from pipeline.audio.vad import SpeechCheck
from pipeline.inference import run_clip
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import SHARD_SCHEMA, read_shard, write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance
from pipeline.settings import AudioLimits, Settings
from tests.speech_audio import espeak_wav, hum, needs_espeak


@pytest.fixture(scope="module")
def sessions(tiny_models: Path) -> Iterator[dict]:
    with Extractor.from_model_dir(tiny_models) as extractor:
        yield extractor.sessions


@pytest.fixture
def hum_wav(tmp_path: Path) -> Path:
    sf.write(tmp_path / "hum.wav", hum(), 16000, subtype="PCM_16")
    return tmp_path / "hum.wav"


def test_settings_make_the_check(tmp_path: Path) -> None:
    check = SpeechCheck.from_settings(Settings(speech_check=False, min_speech_ms=120, speech_threshold=0.6))
    assert (check.enabled, check.min_speech_ms, check.threshold) == (False, 120, 0.6)
    assert SpeechCheck.from_settings(Settings()) == SpeechCheck()
    loaded = Settings.load(
        {"VOXMILL_SPEECH_CHECK": "false", "VOXMILL_MIN_SPEECH_MS": "200"}, tmp_path / "none"
    )
    assert loaded.speech_check is False and loaded.min_speech_ms == 200


def test_hum_is_no_speech_and_keeps_its_stats(sessions: dict, hum_wav: Path) -> None:
    result = run_clip("hum", hum_wav, "extract", sessions, AudioLimits(), SpeechCheck())
    assert result.error is not None and result.error.code == "no_speech"
    assert result.error.message.startswith("detected speech is 0 ms of a 2.00 s clip")
    assert result.speech_token is None and result.embedding is None and result.audio_seconds is None
    assert result.stats is not None and result.stats["speech_s"] == 0.0 and result.stats["duration_s"] == 2.0
    assert result.stats["rms_dbfs"] == pytest.approx(10 * np.log10(0.3**2 / 2 + 0.1**2 / 2), abs=0.01)
    assert "speech" in result.timings_ms and "tokenize" not in result.timings_ms


def test_the_check_off_accepts_hum(sessions: dict, hum_wav: Path) -> None:
    for speech in (None, SpeechCheck(enabled=False)):
        result = run_clip("hum", hum_wav, "extract", sessions, AudioLimits(), speech)
        assert result.error is None and len(result.embedding or []) == 192
        assert result.stats is not None and result.stats["speech_s"] is None
        assert "speech" not in result.timings_ms


@needs_espeak
def test_synthetic_speech_passes_with_its_speech_seconds(sessions: dict, tmp_path: Path) -> None:
    path = espeak_wav("The birch canoe slid on the smooth planks.", tmp_path / "speech.wav")
    result = run_clip("speech", path, "extract", sessions, AudioLimits(), SpeechCheck())
    assert result.error is None, result.error
    stats = result.stats
    assert stats is not None and stats["source_rate_hz"] == 22050 and stats["source_codec"] == "WAV/PCM_16"
    assert 0.5 < stats["speech_ratio"] <= 1.0
    assert stats["speech_s"] == pytest.approx(stats["duration_s"] * stats["speech_ratio"], abs=2e-4)
    strict = run_clip("speech", path, "extract", sessions, AudioLimits(), SpeechCheck(min_speech_ms=60_000))
    assert strict.error is not None and strict.error.code == "no_speech"  # the limit is the setting's


def test_shard_rows_carry_stats_and_model_sha256(sessions: dict, hum_wav: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.wav"
    sf.write(good, (0.2 * np.sin(np.arange(16000) / 3)).astype(np.float32), 16000)
    utts = [
        Utterance("good", str(good), "s1"),
        Utterance("hum", str(hum_wav), "s1"),
        Utterance("gone", "/no/x", "s2"),
    ]
    by_op = {}
    for op in ("tokenize", "embed"):
        # The tokenize shard runs without the check; the embed shard checks the hum only (the
        # sine is no speech either, and should stay a successful row here).
        checks = [None, SpeechCheck() if op == "embed" else None, None]
        spec = ShardSpec(shard=0, op=op, out_dir=str(tmp_path), utts=utts)
        results = [
            run_clip(u.utt, u.path, op, sessions, AudioLimits(), c) for u, c in zip(utts, checks, strict=True)
        ]
        by_op[op] = read_shard(write_shard(RunFolder.of(tmp_path), spec, results)).to_pylist()
    assert pq.read_schema(tmp_path / "shards" / "embed-000000.parquet").names == SHARD_SCHEMA.names
    tok = {row["utt"]: row for row in by_op["tokenize"]}
    emb = {row["utt"]: row for row in by_op["embed"]}
    tokenizer_sha, embedder_sha = sessions["tokenizer"].sha256, sessions["embedder"].sha256
    assert (tok["good"]["tokenizer_sha256"], tok["good"]["embedder_sha256"]) == (tokenizer_sha, None)
    assert (emb["good"]["embedder_sha256"], emb["good"]["tokenizer_sha256"]) == (embedder_sha, None)
    assert tok["hum"]["error_code"] is None and emb["hum"]["error_code"] == "no_speech"
    assert emb["hum"]["embedder_sha256"] is None  # no embedding came from the model
    assert emb["hum"]["duration_s"] == 2.0 and emb["hum"]["speech_ratio"] == 0.0  # stats of a refused clip
    assert tok["hum"]["speech_s"] is None  # the tokenize shard ran without the check
    assert emb["good"]["source_codec"] == "WAV/PCM_16" and emb["good"]["source_rate_hz"] == 16000
    assert all(emb["gone"][name] is None for name in STAT_FIELDS)  # never decoded
    assert emb["gone"]["error_code"] == "not_found"


def test_old_results_without_stats_still_write(tmp_path: Path) -> None:
    spec = ShardSpec(shard=1, op="embed", out_dir=str(tmp_path), utts=[Utterance("a", "/a.wav")])
    result = TaskResult(input="a", op="embed", embedding=[0.0] * 192, audio_seconds=1.0)
    row = read_shard(write_shard(RunFolder.of(tmp_path), spec, [result])).to_pylist()[0]
    assert row["duration_s"] is None and row["embedder_sha256"] is None and row["audio_seconds"] == 1.0
