"""What finally counts: the same tokens and embeddings from our features as from torch's.

The fixtures hold whisper's and torchaudio's features for the same clips; feeding both through
the same stand-in model must give the same tokens and embeddings with cosine >= 0.9999.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.features import mean_normalized, whisper_log_mel
from pipeline.inference import embedder_inputs, open_session, tokenizer_inputs
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.models.standin import make_embedder_model, make_tokenizer_model, write_model

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CLIPS = ["chirp_3s", "noise_1p37s", "speechlike_7p5s", "stereo44k_2s"]


def wave_of(name: str) -> np.ndarray:
    if name == "stereo44k_2s":  # CosyVoice's own resampled wave, so only the features differ
        return np.load(FIXTURES / "stereo44k_2s.resampled16k.npy")
    wave, _ = sf.read(FIXTURES / f"{name}.wav", dtype="float32")
    return wave


@pytest.fixture(scope="module", params=["tiny", "full"])
def sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, ModelSession]:
    folder = tmp_path_factory.mktemp(f"parity-{request.param}")
    options, registry = SessionOptions(provider="cpu"), Registry.load()
    embedder = write_model(make_embedder_model(request.param), folder / "campplus.onnx")
    found = {"embedder": open_session(embedder, "embedder", options, registry)}
    tokenizer = write_model(make_tokenizer_model("tiny"), folder / "speech_tokenizer_v2.onnx")
    found["tokenizer"] = open_session(tokenizer, "tokenizer", options, registry)
    return found


@pytest.mark.parametrize("name", CLIPS)
def test_tokens_from_our_log_mel_equal_tokens_from_whispers(
    sessions: dict[str, ModelSession], name: str
) -> None:
    reference = np.load(FIXTURES / f"{name}.logmel128.npy")
    ours = whisper_log_mel(wave_of(name), n_mels=128)
    tokenizer = sessions["tokenizer"]
    expected = tokenizer.run(tokenizer_inputs(reference))[0].flatten().tolist()
    got = tokenizer.run(tokenizer_inputs(ours))[0].flatten().tolist()
    assert got == expected


@pytest.mark.parametrize("name", CLIPS)
def test_embedding_from_our_fbank_matches_torchaudios(sessions: dict[str, ModelSession], name: str) -> None:
    reference = mean_normalized(np.load(FIXTURES / f"{name}.fbank80.npy"))[np.newaxis]
    embedder = sessions["embedder"]
    expected = embedder.run([reference])[0].flatten()
    got = embedder.run(embedder_inputs(wave_of(name)))[0].flatten()
    cosine = float(np.dot(got, expected) / (np.linalg.norm(got) * np.linalg.norm(expected)))
    assert cosine >= 0.9999
    assert np.abs(got - expected).max() <= 1e-3 * max(1.0, float(np.abs(expected).max()))
