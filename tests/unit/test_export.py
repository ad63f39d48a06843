"""CosyVoice training export: the make_parquet_list.py layout, read back row by row."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline.errors import BAD_REQUEST, ErrorRecord, VoxmillError
from pipeline.outputs.export import NothingToExport, export_cosyvoice
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.merge import merge_outputs
from pipeline.outputs.report import RunReport
from pipeline.outputs.writers import write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance

SPEAKERS = {"u1": "alice", "u2": "alice", "u3": "bob", "u4": "bob", "u5": "carol", "u6": "bob"}
FAILED = "u5"  # carol's only clip fails, so carol has no speaker embedding either


def _tokens(utt: str) -> list[int]:
    return [len(utt) * 11 % 4096, 6561 - 1, sum(map(ord, utt)) % 4096]


def _embedding(utt: str) -> list[float]:
    rng = np.random.default_rng(sum(map(ord, utt)))
    return rng.normal(size=192).astype(np.float32).tolist()


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A Kaldi dir of six clips (one path with a space) and an extract output for it."""
    data = tmp_path / "data"
    audio = tmp_path / "audio files"
    audio.mkdir()
    data.mkdir()
    utts = list(SPEAKERS)
    scp, u2s, text = [], [], []
    for i, utt in enumerate(utts):
        sf.write(audio / f"{utt}.wav", np.full(1600 * (i + 1), 0.1, dtype=np.float32), 16000)
        scp.append(f"{utt} ../audio files/{utt}.wav\n")
        u2s.append(f"{utt} {SPEAKERS[utt]}\n")
        text.append(f"{utt} words of {utt}\n")
    (data / "wav.scp").write_text("".join(scp))
    (data / "utt2spk").write_text("".join(u2s))
    (data / "text").write_text("".join(text))
    features = tmp_path / "features"
    corpus_utts = [Utterance(u, str(audio / f"{u}.wav"), SPEAKERS[u]) for u in utts]
    specs = []
    for op in ("tokenize", "embed"):
        spec = ShardSpec(shard=0, op=op, out_dir=str(features), utts=corpus_utts)
        results = [
            TaskResult(input=u.utt, op=op, error=ErrorRecord("unreadable", "bad"))
            if u.utt == FAILED
            else TaskResult(
                input=u.utt,
                op=op,
                speech_token=_tokens(u.utt) if op == "tokenize" else None,
                embedding=_embedding(u.utt) if op == "embed" else None,
                audio_seconds=1.0,
            )
            for u in corpus_utts
        ]
        write_shard(RunFolder.of(features), spec, results)
        specs.append(spec)
    merge_outputs(RunFolder.of(features), specs, RunReport())
    return data, features


def test_export_round_trip(
    corpus: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, features = corpus
    out = tmp_path / "parquet"
    with caplog.at_level(logging.WARNING, logger="pipeline.outputs.export"):
        parquets = export_cosyvoice(data, features, out, utts_per_parquet=2)
    assert "skipped 1 of 6" in caplog.text and FAILED in caplog.text
    assert parquets == [out / f"parquet_{i:09d}.tar" for i in range(3)]
    assert (out / "data.list").read_text().splitlines() == [str(p) for p in parquets]
    assert (out / "utt2data.list").read_text().splitlines() == [
        str(out / f"utt2parquet_{i:09d}.json") for i in range(3)
    ]
    assert (out / "spk2data.list").read_text().splitlines() == [
        str(out / f"spk2parquet_{i:09d}.json") for i in range(3)
    ]

    spk_table = pq.read_table(features / "spk_embeddings.parquet").to_pylist()
    spk_mean = {r["spk"]: r["embedding"] for r in spk_table}
    seen: list[str] = []
    for number, parquet in enumerate(parquets):
        table = pq.read_table(parquet)
        assert table.schema.names == [
            "utt",
            "wav",
            "audio_data",
            "text",
            "spk",
            "utt_embedding",
            "spk_embedding",
            "speech_token",
        ]
        assert table.schema.field("audio_data").type == pa.binary()
        assert table.schema.field("utt_embedding").type == pa.list_(pa.float64())
        assert table.schema.field("spk_embedding").type == pa.list_(pa.float64())
        assert table.schema.field("speech_token").type == pa.list_(pa.int64())
        rows = table.to_pylist()
        for row in rows:
            utt = row["utt"]
            seen.append(utt)
            assert row["audio_data"] == Path(row["wav"]).read_bytes()
            assert Path(row["wav"]).name == f"{utt}.wav" and Path(row["wav"]).is_absolute()
            assert row["text"] == f"words of {utt}"
            assert row["spk"] == SPEAKERS[utt]
            assert row["speech_token"] == _tokens(utt)
            np.testing.assert_array_equal(np.float32(row["utt_embedding"]), np.float32(_embedding(utt)))
            assert row["spk_embedding"] == pytest.approx(spk_mean[row["spk"]])
        utt_map = json.loads((out / f"utt2parquet_{number:09d}.json").read_text())
        spk_map = json.loads((out / f"spk2parquet_{number:09d}.json").read_text())
        assert utt_map == {r["utt"]: str(parquet) for r in rows}
        assert spk_map == {r["spk"]: str(parquet) for r in rows}
    assert seen == ["u1", "u2", "u3", "u4", "u6"]
    alice = np.mean([_embedding("u1"), _embedding("u2")], axis=0)
    np.testing.assert_allclose(spk_mean["alice"], alice, rtol=1e-5, atol=1e-7)


def test_export_skips_clips_whose_audio_vanished(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    data, features = corpus
    (tmp_path / "audio files" / "u2.wav").unlink()
    parquets = export_cosyvoice(data, features, tmp_path / "out", utts_per_parquet=1000)
    assert len(parquets) == 1
    assert pq.read_table(parquets[0]).column("utt").to_pylist() == ["u1", "u3", "u4", "u6"]


def test_export_needs_the_feature_files(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    data, features = corpus
    (features / "spk_embeddings.parquet").unlink()
    with pytest.raises(VoxmillError) as caught:
        export_cosyvoice(data, features, tmp_path / "out")
    assert caught.value.code == BAD_REQUEST and "spk_embeddings.parquet" in caught.value.message


def test_export_needs_a_kaldi_dir_and_a_positive_chunk(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    data, features = corpus
    with pytest.raises(VoxmillError):
        export_cosyvoice(tmp_path / "audio files", features, tmp_path / "out")
    with pytest.raises(VoxmillError):
        export_cosyvoice(data, features, tmp_path / "out", utts_per_parquet=0)


def test_export_refuses_features_whose_ids_do_not_match_and_says_how(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    data, features = corpus
    renamed = tmp_path / "renamed"  # what a folder-mode run calls the same clips: spk/utt
    renamed.mkdir()
    for name in ("speech_tokens.parquet", "utt_embeddings.parquet", "spk_embeddings.parquet"):
        table = pq.read_table(features / name)
        if "utt" in table.column_names:
            utts = [f"{SPEAKERS[u]}/{u}" for u in table.column("utt").to_pylist()]
            table = table.set_column(table.column_names.index("utt"), "utt", pa.array(utts, pa.string()))
        pq.write_table(table, renamed / name)
    with pytest.raises(NothingToExport) as caught:
        export_cosyvoice(data, renamed, tmp_path / "out")
    message = caught.value.message
    assert "only 0 of the 6 utterances" in message and "'u1'" in message and "'alice/u1'" in message
    assert "folder of audio" in message
    assert not (tmp_path / "out").exists()  # nothing written
