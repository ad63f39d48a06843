"""Segments and local tar shards through real workers: a Kaldi `segments` corpus and a lhotse
CutSet give each segment the very features of the clip it covers (decoded by seeking, its
`audio_seconds` the segment's length), and a folder of tar shards with a broken member gives
the other samples exactly the outputs of the same files, the broken one an error of its own."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline.outputs.folder import RunFolder
from tests.conftest import make_settings
from tests.helpers import make_audio_folder
from workers.extract import extract_corpus

OPS = ["tokenize", "embed"]


def _rows(out: Path, name: str) -> dict[str, object]:
    return {row["utt"]: row for row in pq.read_table(out / name).to_pylist()}


@pytest.fixture
def worker_settings(redis_url, redis_client, tiny_models, start_worker, tmp_path):  # type: ignore[no-untyped-def]
    settings = make_settings(redis_url, tiny_models, [tmp_path])
    start_worker(settings, concurrency=1, queues=("tokenize", "embed"))
    return settings


def test_segments_and_cuts_give_each_segment_the_features_of_its_clip(worker_settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    clips = make_audio_folder(tmp_path / "clips", count=4, min_s=0.6, max_s=1.4, speakers=2)
    waves = [sf.read(p, dtype="int16")[0] for p in sorted(clips.rglob("*.wav"), key=lambda p: p.name)]
    names = [p.stem for p in sorted(clips.rglob("*.wav"), key=lambda p: p.name)]
    # One stereo recording: the clips one after another on channel 1, noise on channel 0.
    mono = np.concatenate(waves)
    stereo = np.stack([np.random.default_rng(1).integers(-900, 900, len(mono)).astype(np.int16), mono], 1)
    sf.write(tmp_path / "rec.wav", stereo, 16000, subtype="PCM_16")
    bounds, start = [], 0
    for wave in waves:
        bounds.append((start / 16000, (start + len(wave)) / 16000))
        start += len(wave)

    # The reference: the clips as files (mono, channel 1's content).
    manifest = tmp_path / "clips.jsonl"
    manifest.write_text(
        "".join(json.dumps({"utt": n, "path": str(next(clips.rglob(f"{n}.wav")))}) + "\n" for n in names)
    )
    extract_corpus(worker_settings, manifest, RunFolder.of(tmp_path / "ref"), OPS, 1, 2, quiet=True)

    # A lhotse CutSet: one cut of the whole recording, a supervision per clip on channel 1.
    cut = {
        "id": "rec",
        "start": 0.0,
        "duration": len(mono) / 16000,
        "channel": 1,
        "supervisions": [
            {"id": n, "recording_id": "rec", "start": b[0], "duration": b[1] - b[0], "channel": 1}
            for n, b in zip(names, bounds, strict=True)
        ],
        "recording": {
            "id": "rec",
            "sources": [{"type": "file", "channels": [0, 1], "source": "rec.wav"}],
            "sampling_rate": 16000,
            "num_samples": len(mono),
            "duration": len(mono) / 16000,
            "channel_ids": [0, 1],
        },
    }
    with gzip.open(tmp_path / "cuts.jsonl.gz", "wt") as stream:
        stream.write(json.dumps(cut) + "\n")
    report = extract_corpus(
        worker_settings, tmp_path / "cuts.jsonl.gz", RunFolder.of(tmp_path / "cuts-out"), OPS, 1, 2, True
    ).to_dict()
    assert report["utterances"] == 4
    assert report["audio_seconds"] == pytest.approx(len(mono) / 16000, abs=1e-3)
    for name in ("speech_tokens.parquet", "utt_embeddings.parquet"):
        ref, got = _rows(tmp_path / "ref", name), _rows(tmp_path / "cuts-out", name)
        assert set(got) == set(names)
        for utt in names:
            key = "speech_token" if "tokens" in name else "embedding"
            assert got[utt][key] == ref[utt][key]  # type: ignore[index]

    # Kaldi segments over a mono recording of the same clips: the same features again.
    (tmp_path / "kaldi").mkdir()
    sf.write(tmp_path / "kaldi" / "rec1.wav", mono, 16000)
    (tmp_path / "kaldi" / "wav.scp").write_text("rec1 rec1.wav\n")
    (tmp_path / "kaldi" / "segments").write_text(
        "".join(f"{n} rec1 {b[0]:.6f} {b[1]:.6f}\n" for n, b in zip(names, bounds, strict=True))
    )
    out = RunFolder.of(tmp_path / "kaldi-out")
    report = extract_corpus(worker_settings, tmp_path / "kaldi", out, OPS, 1, 2, True).to_dict()
    ref, got = (
        _rows(tmp_path / "ref", "speech_tokens.parquet"),
        _rows(tmp_path / "kaldi-out", "speech_tokens.parquet"),
    )
    assert {u: r["speech_token"] for u, r in got.items()} == {u: r["speech_token"] for u, r in ref.items()}  # type: ignore[index]
    assert report["audio_seconds"] == pytest.approx(len(mono) / 16000, abs=1e-3)


def test_local_tar_shards_match_their_files_and_a_broken_member_fails_alone(
    worker_settings, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    clips = make_audio_folder(tmp_path / "clips", count=6, min_s=0.5, max_s=1.0)
    files = sorted(clips.rglob("*.wav"), key=lambda p: p.name)
    manifest = tmp_path / "clips.jsonl"
    manifest.write_text(
        "".join(json.dumps({"utt": p.stem, "path": str(p), "spk": p.parent.name}) + "\n" for p in files)
    )
    extract_corpus(worker_settings, manifest, RunFolder.of(tmp_path / "ref"), OPS, 1, 3, quiet=True)
    (tmp_path / "tars").mkdir()
    for number in range(2):
        with tarfile.open(tmp_path / "tars" / f"shard-{number}.tar", "w") as tar:
            for path in files[number * 3 : number * 3 + 3]:
                meta = json.dumps({"speaker": path.parent.name}).encode()
                info = tarfile.TarInfo(f"{path.stem}.json")
                info.size = len(meta)
                tar.addfile(info, io.BytesIO(meta))
                tar.add(path, arcname=f"{path.stem}.wav")
            if number == 1:
                junk = b"this is not audio at all\n" * 40
                info = tarfile.TarInfo("broken.flac")
                info.size = len(junk)
                tar.addfile(info, io.BytesIO(junk))
    out = RunFolder.of(tmp_path / "tar-out")
    report = extract_corpus(worker_settings, tmp_path / "tars", out, OPS, 1, 0, quiet=True).to_dict()
    assert report["utterances"] == 7 and report["ops"]["tokenize"] == {"ok": 6, "failed": 1}
    errors = [json.loads(line) for line in (tmp_path / "tar-out" / "errors.jsonl").read_text().splitlines()]
    assert {(e["utt"], e["op"], e["code"]) for e in errors} == {("broken", op, "unreadable") for op in OPS}
    for name in ("speech_tokens.parquet", "utt_embeddings.parquet", "spk_embeddings.parquet"):
        assert (
            pq.read_table(tmp_path / "tar-out" / name).to_pylist()
            == pq.read_table(tmp_path / "ref" / name).to_pylist()
        )
