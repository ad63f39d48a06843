"""Batch tokenizers: every row of a batch is the single model's tokens, the grouping, the model folder.

Real stand-ins (the tiny profile and its batch twin) in real ONNX Runtime sessions.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from pipeline.batching import open_batch_session, plan_batches, tokenize_batch
from pipeline.errors import VoxmillError
from pipeline.features import WINDOW_FRAMES
from pipeline.inference import log_mel_windows, open_session, tokenize
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.models.standin import TOKENIZER_BATCH_FILE, TOKENIZER_FILE
from workers.models import describe_folder, render_models

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REGISTRY = Registry.load()
OPTIONS = SessionOptions(provider="cpu")  # no optimized-model cache


@pytest.fixture(scope="module")
def single(tiny_models: Path) -> ModelSession:
    return open_session(tiny_models / TOKENIZER_FILE, "tokenizer", OPTIONS, REGISTRY)


@pytest.fixture(scope="module")
def batch(tiny_models: Path) -> ModelSession:
    return open_batch_session(tiny_models / TOKENIZER_BATCH_FILE, OPTIONS, REGISTRY)


def speechlike(seconds: float, seed: int) -> np.ndarray:
    """Harmonics with a wandering pitch, a syllable-rate envelope and noise: tokens that vary."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    f0 = 120 + 60 * rng.random() + 30 * np.sin(2 * np.pi * 0.5 * t + rng.random())
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    return (0.2 * wave + rng.normal(0, 0.02, len(t))).astype(np.float32)


def fixture_waves(extract: Path) -> list[np.ndarray]:
    import soundfile as sf

    waves = []
    for name in ("chirp_3s", "noise_1p37s", "speechlike_7p5s"):
        wave, rate = sf.read(extract / f"{name}.wav", dtype="float32")
        assert rate == 16000
        waves.append(wave if wave.ndim == 1 else wave.mean(axis=1))
    return waves


# ------------------------------------------------------------------------------ grouping
def check_plan(frames: list[int], budget: int, cap: int) -> list[list[int]]:
    batches = plan_batches(frames, budget, cap)
    order = [i for b in batches for i in b]
    assert order == sorted(range(len(frames)), key=lambda i: (frames[i], i))  # every row once, sorted
    for b in batches:
        longest = max(frames[i] for i in b)
        assert len(b) <= cap
        assert len(b) == 1 or len(b) * longest <= budget  # a row over the budget runs alone
    return batches


def test_plan_respects_budget_and_cap_on_random_lengths() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        frames = [int(n) for n in rng.integers(1, 4000, size=int(rng.integers(0, 40)))]
        check_plan(frames, int(rng.integers(1, 30000)), int(rng.integers(1, 12)))


def test_plan_fills_batches_up_to_the_cap_or_the_budget() -> None:
    assert check_plan([200] * 10, 1600, 8) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]]
    assert check_plan([500, 100, 500, 100], 1000, 8) == [[1, 3], [0, 2]]  # 3 x 500 would pass 1000
    assert check_plan([3000, 150], 1600, 8) == [[1], [0]]  # a 30 s window over the budget: alone
    assert check_plan([], 1600, 8) == []
    with pytest.raises(ValueError, match="at least 1"):
        plan_batches([100], 1600, 0)


# ------------------------------------------------------------------------------ exactness
def test_random_compositions_give_every_clip_the_single_models_tokens(
    single: ModelSession, batch: ModelSession
) -> None:
    rng = np.random.default_rng(1)
    pool = [speechlike(float(s), seed) for seed, s in enumerate(rng.uniform(0.3, 6.0, size=14))]
    pool += fixture_waves(FIXTURES)
    expected = [tokenize(single, wave) for wave in pool]
    assert len({len(t) for t in expected}) > 5 and all(len(set(t)) > 1 for t in expected)
    for _ in range(8):
        picked = [int(i) for i in rng.choice(len(pool), size=int(rng.integers(2, 12)), replace=False)]
        budget, cap = int(rng.integers(300, 8000)), int(rng.integers(2, 9))
        got = tokenize_batch(batch, [pool[i] for i in picked], frame_budget=budget, max_batch=cap)
        assert got == [expected[i] for i in picked]


def test_lengths_tenfold_apart_in_one_batch(single: ModelSession, batch: ModelSession) -> None:
    waves = [speechlike(1.0, 11), speechlike(10.0, 12), speechlike(1.3, 13), speechlike(9.1, 14)]
    frames = [w.shape[1] for wave in waves for w in log_mel_windows(wave)]
    assert max(frames) >= 9 * min(frames)
    assert plan_batches(frames, 10 * max(frames), 8) == [[0, 2, 3, 1]]  # one padded run
    assert tokenize_batch(batch, waves, frame_budget=10 * max(frames)) == [tokenize(single, w) for w in waves]


def test_the_windows_of_a_long_clip_join_batches(single: ModelSession, batch: ModelSession) -> None:
    long_clip = speechlike(65.0, 21)  # 6,500 frames: windows at 0, 26 and 52 s
    windows = log_mel_windows(long_clip)
    assert [w.shape[1] for w in windows] == [WINDOW_FRAMES, WINDOW_FRAMES, 1300]
    waves = [speechlike(2.0, 22), long_clip, speechlike(4.0, 23)]
    expected = [tokenize(single, w) for w in waves]
    assert len(expected[1]) == (6500 - 1) // 4 + 1
    # A budget that puts the windows in batches with the short clips and with each other.
    assert tokenize_batch(batch, waves, frame_budget=4 * WINDOW_FRAMES, max_batch=4) == expected
    assert tokenize_batch(batch, waves, frame_budget=1, max_batch=1) == expected  # every row alone


def test_batched_tokens_name_the_batch_file(tiny_models: Path, batch: ModelSession) -> None:
    path = tiny_models / TOKENIZER_BATCH_FILE
    assert batch.ref.file == TOKENIZER_BATCH_FILE
    assert batch.ref.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert batch.identified.variant.name == "v2" and batch.token_rate_hz == 25


def test_a_batch_file_without_a_batch_axis_is_refused(tiny_models: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_models / TOKENIZER_FILE, tmp_path / TOKENIZER_BATCH_FILE)  # feats [1, 128, T]
    with pytest.raises(VoxmillError) as caught:
        open_batch_session(tmp_path / TOKENIZER_BATCH_FILE, OPTIONS, REGISTRY)
    assert caught.value.code == "model_error" and "dynamic batch axis" in caught.value.message


# ------------------------------------------------------------------------------ the model folder
def folder_with(tiny_models: Path, tmp_path: Path, names: dict[str, str]) -> Path:
    """A model folder holding copies of the stand-ins under the given names (name: source)."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name, source in names.items():
        shutil.copy(tiny_models / source, folder / name)
    return folder


def rendered(rows: list[dict[str, object]]) -> str:
    console = Console(width=80, record=True, soft_wrap=False)
    render_models(rows, console)
    return console.export_text()


def test_a_folder_with_the_batch_file_lists_and_verifies_it(tiny_models: Path) -> None:
    assert REGISTRY.find_model("tokenizer", tiny_models).name == TOKENIZER_FILE  # serving as today
    assert REGISTRY.find_batch_model("tokenizer", tiny_models) == tiny_models / TOKENIZER_BATCH_FILE
    assert REGISTRY.role_of_file(TOKENIZER_BATCH_FILE) is None  # the watcher publishes no batch file
    for load in (False, True):
        rows = describe_folder(tiny_models, load=load)
        assert [(r["role"], r["file"], r.get("batch", False)) for r in rows] == [
            ("tokenizer", TOKENIZER_FILE, False),
            ("tokenizer", TOKENIZER_BATCH_FILE, True),
            ("embedder", "campplus.onnx", False),
        ]
        assert all(r["ok"] for r in rows), rows
        assert rows[1]["variant"] == "v2" and rows[1]["sha256"] != rows[0]["sha256"]
        assert f"{TOKENIZER_BATCH_FILE}  0.4 MB  ok  (batch)" in rendered(rows)
    assert rows[1]["warm_latency_ms"] is not None and rows[1]["providers"] == ["CPUExecutionProvider"]


def test_a_folder_with_only_the_single_file_is_as_before(tiny_models: Path, tmp_path: Path) -> None:
    folder = folder_with(
        tiny_models, tmp_path, {TOKENIZER_FILE: TOKENIZER_FILE, "campplus.onnx": "campplus.onnx"}
    )
    assert REGISTRY.find_batch_model("tokenizer", folder) is None
    rows = describe_folder(folder, load=False)
    assert [(r["file"], r.get("batch", False)) for r in rows] == [
        (TOKENIZER_FILE, False),
        ("campplus.onnx", False),
    ]
    assert "(batch)" not in rendered(rows)


def test_only_the_served_files_twin_counts(tiny_models: Path, tmp_path: Path) -> None:
    # v3 serves (the newest version); a v2 batch file beside it is another model: not its twin.
    folder = folder_with(
        tiny_models,
        tmp_path,
        {"speech_tokenizer_v3.onnx": TOKENIZER_FILE, "speech_tokenizer_v2.batch.onnx": TOKENIZER_BATCH_FILE},
    )
    assert REGISTRY.find_model("tokenizer", folder).name == "speech_tokenizer_v3.onnx"
    assert REGISTRY.find_batch_model("tokenizer", folder) is None
    shutil.copy(folder / "speech_tokenizer_v2.batch.onnx", folder / "speech_tokenizer_v3.batch.onnx")
    assert REGISTRY.find_batch_model("tokenizer", folder) == folder / "speech_tokenizer_v3.batch.onnx"
    identified = REGISTRY.identify("tokenizer", "speech_tokenizer_v3.batch.onnx", "0" * 64)
    assert (identified.variant.name, identified.by) == ("v3", "name")


def test_verify_fails_on_a_batch_file_without_a_batch_axis(tiny_models: Path, tmp_path: Path) -> None:
    folder = folder_with(
        tiny_models, tmp_path, {TOKENIZER_FILE: TOKENIZER_FILE, TOKENIZER_BATCH_FILE: TOKENIZER_FILE}
    )
    listed, verified = describe_folder(folder, load=False), describe_folder(folder, load=True)
    assert listed[1]["ok"] and listed[1]["batch"]  # listing reads no signature (no embedder here)
    assert not verified[1]["ok"] and "dynamic batch axis" in verified[1]["error"]["message"]
    assert verified[0]["ok"]  # the file that serves is fine
