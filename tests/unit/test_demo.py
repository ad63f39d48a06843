"""The generated demo corpus: deterministic bytes, the promised formats, lengths and defects."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio.decode import load_audio
from pipeline.audio.header import probe_audio
from pipeline.corpus.listing import read_corpus
from pipeline.demo import make_demo_corpus, set_ogg_serial
from pipeline.errors import UNREADABLE, VoxmillError
from pipeline.settings import AudioLimits


def _digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_corpus(tmp_path_factory.mktemp("demo"))


def test_same_seed_same_bytes(demo: Path, tmp_path: Path) -> None:
    root = demo.parent
    again = make_demo_corpus(tmp_path / "again")
    first, second = _digest(root), _digest(again.parent)
    assert first.keys() == second.keys()
    # wav.scp names absolute paths, so it differs only by the folder it was written into.
    assert (demo / "wav.scp").read_text().replace(str(root), "@") == (again / "wav.scp").read_text().replace(
        str(again.parent), "@"
    )
    assert {k: v for k, v in first.items() if k != "data/wav.scp"} == {
        k: v for k, v in second.items() if k != "data/wav.scp"
    }
    other = make_demo_corpus(tmp_path / "other", seed=1)
    assert _digest(other.parent)["audio/spk1/spk1_000.wav"] != first["audio/spk1/spk1_000.wav"]


def test_layout_and_kaldi_files(demo: Path) -> None:
    assert demo.name == "data"
    assert sorted(p.name for p in demo.iterdir()) == ["text", "utt2spk", "wav.scp"]
    utts = read_corpus(demo)
    assert len(utts) == 14
    assert Counter(u.spk for u in utts).keys() == {"spk1", "spk2", "spk3"}
    for u in utts:
        path = Path(u.path)
        assert path.is_absolute() and path.is_file()
        assert path.parent.name == u.spk and path.stem == u.utt
        assert path.parent.parent == demo.parent / "audio"
        assert u.text
    total = sum(p.stat().st_size for p in demo.parent.rglob("*") if p.is_file())
    assert total < 3_000_000


def test_formats_rates_and_durations(demo: Path) -> None:
    limits = AudioLimits()
    infos = {}
    for u in read_corpus(demo):
        if u.utt.endswith("_broken"):
            continue
        infos[u.utt] = (Path(u.path).suffix, probe_audio(u.path, limits))
        decoded = load_audio(u.path, limits)  # every good clip decodes, whatever its format
        assert decoded.duration_s == pytest.approx(infos[u.utt][1].duration_s, abs=0.06)
    kinds = {(ext, i.sample_rate_hz, i.channels, i.subtype) for ext, i in infos.values()}
    assert kinds == {
        (".wav", 16000, 1, "PCM_16"),
        (".wav", 44100, 2, "PCM_24"),
        (".flac", 22050, 1, "PCM_16"),
        (".ogg", 48000, 1, "VORBIS"),
        (".mp3", 24000, 1, "MPEG_LAYER_III"),
    }
    durations = sorted(i.duration_s for _, i in infos.values())
    assert len(durations) == 13
    assert durations[-1] == pytest.approx(32.0)
    assert all(1.0 <= d <= 6.0 + 0.1 for d in durations[:-1])


def test_clips_sound_like_speech_with_speaker_pitch(demo: Path) -> None:
    limits = AudioLimits()
    pitch = {}
    for u in read_corpus(demo):
        if u.utt.endswith(("_broken", "_long")) or not u.path.endswith(".wav"):
            continue
        samples = load_audio(u.path, limits).samples
        assert 0.05 < float(np.max(np.abs(samples))) <= 0.6
        spectrum = np.abs(np.fft.rfft(samples))
        freqs = np.fft.rfftfreq(len(samples), 1 / 16000)
        band = (freqs > 60) & (freqs < 300)
        pitch.setdefault(u.spk, []).append(freqs[band][np.argmax(spectrum[band])])
    means = {spk: float(np.mean(v)) for spk, v in pitch.items()}
    assert means["spk1"] < means["spk3"] < means["spk2"]
    assert 90 < means["spk1"] < 130 and 190 < means["spk2"] < 250


def test_broken_file_is_text_named_wav(demo: Path) -> None:
    broken = [u for u in read_corpus(demo) if u.utt.endswith("_broken")]
    assert len(broken) == 1 and broken[0].path.endswith(".wav")
    with pytest.raises(VoxmillError) as caught:
        probe_audio(broken[0].path, AudioLimits())
    assert caught.value.code == UNREADABLE


def test_ogg_serial_rewrite_keeps_the_file_valid(tmp_path: Path) -> None:
    path = tmp_path / "a.ogg"
    tone = (0.3 * np.sin(np.arange(48000) / 7)).astype(np.float32)
    sf.write(path, tone, 48000, format="OGG", subtype="VORBIS")
    rewritten = set_ogg_serial(path.read_bytes(), 0x12345678)
    assert rewritten[14:18] == bytes.fromhex("78563412")
    (tmp_path / "b.ogg").write_bytes(rewritten)
    decoded, rate = sf.read(tmp_path / "b.ogg", dtype="float32")
    assert rate == 48000 and len(decoded) == 48000
    with pytest.raises(ValueError):
        set_ogg_serial(b"RIFF" + rewritten[4:], 1)
