"""A shard's clips through `run_clips`: every result what `run_clip` gives, tokens from batches.

Real stand-ins (tiny profile, batch twin) in real ONNX Runtime sessions, real WAV files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from pipeline.batching import BatchRule, TokenBatches, attach_twin, run_clips
from pipeline.errors import VoxmillError
from pipeline.inference import open_session, run_clip
from pipeline.models.options import SessionOptions
from pipeline.models.registry import Registry
from pipeline.models.sessions import ModelSession
from pipeline.models.standin import TOKENIZER_BATCH_FILE, TOKENIZER_FILE
from pipeline.settings import AudioLimits, Settings
from tests.helpers import reexported
from tests.unit.test_batching import speechlike

REGISTRY = Registry.load()
OPTIONS = SessionOptions(provider="cpu")
LIMITS = AudioLimits()


@pytest.fixture(scope="module")
def sessions(tiny_models: Path) -> dict[str, ModelSession]:
    tokenizer = attach_twin(
        open_session(tiny_models / TOKENIZER_FILE, "tokenizer", OPTIONS, REGISTRY), OPTIONS, REGISTRY
    )
    embedder = open_session(tiny_models / "campplus.onnx", "embedder", OPTIONS, REGISTRY)
    return {"tokenizer": tokenizer, "embedder": embedder}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Clips of 0.3-6 s, one of 65 s (three windows), and bad ones in between."""
    folder = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(5)
    paths = []
    for index, seconds in enumerate([*rng.uniform(0.3, 6.0, size=20), 65.0]):
        path = folder / f"clip{index:02d}.wav"
        sf.write(path, speechlike(float(seconds), index), 16000)
        paths.append(path)
    (folder / "garbage.wav").write_bytes(b"not audio at all" * 100)
    sf.write(folder / "short.wav", speechlike(0.05, 99), 16000)  # too_short
    silent = np.zeros(16000, dtype=np.float32)
    silent[100] = np.nan
    sf.write(folder / "nan.wav", silent, 16000, subtype="FLOAT")
    bad = [folder / "garbage.wav", folder / "short.wav", folder / "nan.wav", folder / "missing.wav"]
    return paths[:7] + bad[:2] + paths[7:15] + bad[2:] + paths[15:]


def comparable(result: Any) -> dict[str, Any]:
    """A result without its timings and models (what batching may change)."""
    data = result.to_dict()
    data.pop("timings_ms", None)
    data.pop("models", None)
    return data


@pytest.mark.parametrize("op", ["tokenize", "extract"])
def test_every_result_is_run_clips_and_batched_tokens_name_the_batch_file(
    sessions: dict[str, ModelSession], corpus: list[Path], op: str
) -> None:
    expected = [run_clip(p.name, p, op, sessions, LIMITS) for p in corpus]
    rule = BatchRule(max_batch=4, frame_budget=1600, max_clip_frames=300)
    got = run_clips(((p.name, p, None) for p in corpus), op, sessions, LIMITS, None, rule)
    assert [comparable(r) for r in got] == [comparable(r) for r in expected]
    codes = {r.input: r.error.code for r in got if r.error is not None}
    assert codes == {
        "garbage.wav": "unreadable",
        "short.wav": "too_short",
        "nan.wav": codes["nan.wav"],
        "missing.wav": "not_found",
    }
    tokenizer = sessions["tokenizer"]
    assert tokenizer.twin is not None
    for result in got:
        if result.error is not None:
            continue
        ref = result.models["tokenizer"]
        if result.audio_seconds <= 3.0:  # the rule's clips: the twin made them, and says so
            assert (ref.file, ref.sha256, ref.twin_sha256) == (
                TOKENIZER_BATCH_FILE,
                tokenizer.twin.sha256,
                tokenizer.sha256,
            )
            assert ref.model_sha256 == tokenizer.sha256
        else:
            assert (ref.file, ref.sha256, ref.twin_sha256) == (TOKENIZER_FILE, tokenizer.sha256, "")
        if op == "extract":
            assert result.models["embedder"].file == "campplus.onnx"
        assert result.timings_ms["tokenize"] > 0


def test_the_long_clips_windows_join_batches_when_the_rule_takes_every_clip(
    sessions: dict[str, ModelSession], corpus: list[Path]
) -> None:
    expected = [run_clip(p.name, p, "tokenize", sessions, LIMITS) for p in corpus]
    for rule in (BatchRule(8, 4 * 3000, None), BatchRule(1, 1, None)):  # GPU-like; every row alone
        got = run_clips(((p.name, p, None) for p in corpus), "tokenize", sessions, LIMITS, None, rule)
        assert [r.speech_token for r in got] == [r.speech_token for r in expected]
        long_one = next(r for r in got if r.audio_seconds and r.audio_seconds > 60)
        assert long_one.models["tokenizer"].file == TOKENIZER_BATCH_FILE


def test_a_failed_batch_runs_its_rows_alone(
    sessions: dict[str, ModelSession], corpus: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    twin = sessions["tokenizer"].twin
    assert twin is not None
    real_run = twin.run
    sizes = []

    def run(inputs: Any) -> Any:
        sizes.append(len(inputs[1]))
        if len(inputs[1]) > 1:
            raise VoxmillError("model_error", "a batch that fails")
        return real_run(inputs)

    monkeypatch.setattr(twin, "run", run)
    expected = [run_clip(p.name, p, "tokenize", sessions, LIMITS) for p in corpus]
    got = run_clips(((p.name, p, None) for p in corpus), "tokenize", sessions, LIMITS, None, BatchRule())
    assert [comparable(r) for r in got] == [comparable(r) for r in expected]
    assert max(sizes) > 1  # batches were tried, failed, and their rows ran alone


def test_a_source_refused_before_reading_keeps_its_place(
    sessions: dict[str, ModelSession], corpus: list[Path]
) -> None:
    refused = VoxmillError("forbidden_path", "outside the roots")
    clips = [(corpus[0].name, corpus[0], None), ("x", refused, None), (corpus[1].name, corpus[1], None)]
    got = run_clips(iter(clips), "tokenize", sessions, LIMITS, None, BatchRule())
    assert [r.error.code if r.error else "ok" for r in got] == ["ok", "forbidden_path", "ok"]


def test_the_rule_by_provider_and_settings() -> None:
    assert BatchRule.from_settings(Settings(batch_tokenize="off"), "CPUExecutionProvider") is None
    # The CPU batches nothing by default (it did not pay on every CPU); clips up to 3 s when asked.
    assert BatchRule.from_settings(Settings(), "CPUExecutionProvider") is None
    assert not BatchRule.loads_twin(Settings(), "CPUExecutionProvider")
    short = Settings(batch_max_clip_s=3.0)
    assert BatchRule.from_settings(short, "CPUExecutionProvider") == BatchRule(8, 1600, 300)
    assert BatchRule.loads_twin(short, "CPUExecutionProvider")
    assert BatchRule.from_settings(Settings(), "CUDAExecutionProvider") == BatchRule(32, 96000, None)
    assert BatchRule.loads_twin(Settings(), "CUDAExecutionProvider")
    assert BatchRule.from_settings(Settings(batch_tokenize="on"), "CPUExecutionProvider") == BatchRule(
        8, 1600, None
    )
    custom = Settings(batch_max_clips=4, batch_frame_budget=900, batch_max_clip_s=1.5)
    assert BatchRule.from_settings(custom, "CPUExecutionProvider") == BatchRule(4, 900, 150)
    assert BatchRule(8, 1600, 300).takes(300) and not BatchRule(8, 1600, 300).takes(301)


def test_a_twin_is_loaded_only_when_the_folder_has_a_working_one(
    tiny_models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copy(tiny_models / TOKENIZER_FILE, tmp_path / TOKENIZER_FILE)
    alone = attach_twin(
        open_session(tmp_path / TOKENIZER_FILE, "tokenizer", OPTIONS, REGISTRY), OPTIONS, REGISTRY
    )
    assert alone.twin is None
    shutil.copy(tiny_models / TOKENIZER_FILE, tmp_path / TOKENIZER_BATCH_FILE)  # no batch axis
    refused = attach_twin(
        open_session(tmp_path / TOKENIZER_FILE, "tokenizer", OPTIONS, REGISTRY), OPTIONS, REGISTRY
    )
    assert refused.twin is None and "dynamic batch axis" in caplog.text
    embedder = open_session(tiny_models / "campplus.onnx", "embedder", OPTIONS, REGISTRY)
    assert attach_twin(embedder, OPTIONS, REGISTRY).twin is None


def test_a_holder_loads_the_twin_only_when_batching_is_on(tiny_models: Path) -> None:
    from workers.reload.holder import ModelHolder

    for batching in (True, False):
        holder = ModelHolder(["tokenizer"], OPTIONS, REGISTRY, batch_twins=batching)
        session = holder.load("tokenizer", tiny_models / TOKENIZER_FILE)
        holder.swap("tokenizer", session, 1)
        described = holder.describe()["models"]["tokenizer"]
        if batching:
            assert session.twin is not None and described["batch_file"]["file"] == TOKENIZER_BATCH_FILE
        else:
            assert session.twin is None and "batch_file" not in described
        holder.close()


def test_the_batch_file_gets_a_tensorrt_profile_of_gpu_batches(tiny_models: Path) -> None:
    from pipeline.models.planning import _shape_profile

    spec = REGISTRY.role("tokenizer")
    assert spec.for_file(TOKENIZER_FILE) is spec
    batch_spec = spec.for_file(TOKENIZER_BATCH_FILE)
    assert batch_spec.profiles["max"] == (32, 128, 3000) and batch_spec.inputs == spec.inputs
    profile = _shape_profile(batch_spec, (tiny_models / TOKENIZER_BATCH_FILE).read_bytes())
    assert list(profile.max.values()) == [(32, 128, 3000), (32,)]
    assert list(profile.opt.values()) == [(8, 128, 1000), (8,)]
    single = _shape_profile(spec, (tiny_models / TOKENIZER_FILE).read_bytes())
    assert list(single.max.values()) == [(1, 128, 3000), (1,)]


def gathered(sessions: dict[str, ModelSession], paths: list[Path], gathering: Any) -> list[Any]:
    """Each path as its own single job, all at once on threads, sharing `gathering`."""
    import threading

    results: list[Any] = [None] * len(paths)

    def job(index: int) -> None:
        clips = [(paths[index].name, paths[index], None)]
        results[index] = run_clips(
            clips, "tokenize", sessions, LIMITS, None, BatchRule(8, 1600, 300), gathering
        )[0]

    threads = [threading.Thread(target=job, args=(i,)) for i in range(len(paths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_concurrent_single_jobs_share_one_batch(
    sessions: dict[str, ModelSession], corpus: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.batching import JobGathering

    twin = sessions["tokenizer"].twin
    assert twin is not None
    sizes: list[int] = []
    real_run = twin.run
    monkeypatch.setattr(twin, "run", lambda inputs: sizes.append(len(inputs[1])) or real_run(inputs))
    short = [p for p in corpus if p.name.startswith("clip") and sf.info(p).duration <= 3.0][:4]
    assert len(short) == 4
    # Four jobs run: the first to arrive waits (at most 30 s) until all four have, then one batch.
    results = gathered(sessions, short, JobGathering(30.0, lambda: 4))
    assert sizes == [4]
    expected = [run_clip(p.name, p, "tokenize", sessions, LIMITS) for p in short]
    assert [r.speech_token for r in results] == [r.speech_token for r in expected]
    assert all(r.models["tokenizer"].file == TOKENIZER_BATCH_FILE for r in results)


def test_a_job_running_alone_never_waits(sessions: dict[str, ModelSession], corpus: list[Path]) -> None:
    import time

    from pipeline.batching import JobGathering

    started = time.monotonic()
    results = gathered(sessions, corpus[:1], JobGathering(600.0, lambda: 1))  # would wait 10 minutes
    assert results[0].speech_token and time.monotonic() - started < 60


def test_a_changed_batch_file_is_reloaded_once_it_held_still() -> None:
    from pipeline.models.identity import FileIdentity
    from workers.reload.policy import twin_step

    def at(mtime: int) -> FileIdentity:
        return FileIdentity("m/speech_tokenizer_v2.batch.onnx", 1, 2, 3, mtime, mtime)

    assert twin_step(at(1), None, at(1)) == "keep"
    assert twin_step(at(1), at(1), at(2)) == "wait"  # changing
    assert twin_step(at(1), at(2), at(3)) == "wait"  # still changing
    assert twin_step(at(1), at(3), at(3)) == "reload"  # held still a round
    assert twin_step(at(1), at(1), None) == "wait" and twin_step(at(1), None, None) == "reload"  # removed
    assert twin_step(None, None, at(4)) == "wait" and twin_step(None, at(4), at(4)) == "reload"  # added


def test_a_holder_reloads_the_twin_of_the_session_it_serves(tiny_models: Path, tmp_path: Path) -> None:
    from pipeline.batching import file_now
    from pipeline.models.standin import make_standins
    from workers.reload.holder import ModelHolder

    folder, other = tmp_path / "models", tmp_path / "seed1"
    folder.mkdir()
    for name in (TOKENIZER_FILE, TOKENIZER_BATCH_FILE):
        shutil.copy(tiny_models / name, folder / name)
    make_standins(other, seed=1)
    holder = ModelHolder(["tokenizer"], OPTIONS, REGISTRY, batch_twins=True)
    session = holder.load("tokenizer", folder / TOKENIZER_FILE)
    holder.swap("tokenizer", session, 1)
    first = session.twin
    assert first is not None and session.twin_file == file_now(folder / TOKENIZER_BATCH_FILE)

    reexported(tiny_models / TOKENIZER_BATCH_FILE, folder / TOKENIZER_BATCH_FILE)  # new bytes, same weights
    assert holder.reload_twin("tokenizer", session)
    assert session.twin is not None and session.twin.sha256 != first.sha256
    assert session.twin.ref.twin_sha256 == session.sha256

    shutil.copy(other / TOKENIZER_BATCH_FILE, folder / TOKENIZER_BATCH_FILE)  # other weights: refused
    kept = session.twin
    assert not holder.reload_twin("tokenizer", session) and session.twin is kept
    assert session.twin_file == file_now(folder / TOKENIZER_BATCH_FILE)  # not tried again until it changes

    (folder / TOKENIZER_BATCH_FILE).unlink()
    assert holder.reload_twin("tokenizer", session) and session.twin is None


def test_a_batch_file_with_other_tokens_is_not_used(
    tiny_models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeline.models.standin import make_standins
    from workers.models import describe_folder

    folder, other = tmp_path / "models", tmp_path / "seed1"
    folder.mkdir()
    make_standins(other, seed=1)
    shutil.copy(tiny_models / TOKENIZER_FILE, folder / TOKENIZER_FILE)
    shutil.copy(other / TOKENIZER_BATCH_FILE, folder / TOKENIZER_BATCH_FILE)  # a batch axis, other weights
    session = attach_twin(
        open_session(folder / TOKENIZER_FILE, "tokenizer", OPTIONS, REGISTRY), OPTIONS, REGISTRY
    )
    assert session.twin is None and "gives other tokens than speech_tokenizer_v2.onnx" in caplog.text
    rows = describe_folder(folder, load=True)
    assert rows[0]["ok"] and not rows[1]["ok"] and "other tokens" in rows[1]["error"]["message"]
    good = describe_folder(tiny_models, load=True)
    assert good[1]["ok"] and good[1]["same_tokens_as"] == TOKENIZER_FILE


def test_a_shards_short_clips_are_sorted_together_so_no_batch_straddles_another(
    sessions: dict[str, ModelSession], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 60 clips of 0.3-2.9 s, more rows than 4 batches of 8: sorted in one gathering, each batch's
    # rows lie between the last batch's longest and the next one's shortest (less padding).
    rng = np.random.default_rng(11)
    paths = []
    for index, seconds in enumerate(rng.uniform(0.3, 2.9, size=60)):
        paths.append(tmp_path / f"c{index:02d}.wav")
        sf.write(paths[-1], speechlike(float(seconds), index), 16000)
    twin = sessions["tokenizer"].twin
    assert twin is not None
    real_run, batches = twin.run, []

    def run(inputs: Any) -> Any:
        batches.append(sorted(int(n) for n in inputs[1]))  # the rows' frame counts
        return real_run(inputs)

    monkeypatch.setattr(twin, "run", run)
    expected = [run_clip(p.name, p, "tokenize", sessions, LIMITS) for p in paths]
    got = run_clips(((p.name, p, None) for p in paths), "tokenize", sessions, LIMITS, None, BatchRule())
    assert [r.speech_token for r in got] == [r.speech_token for r in expected]
    assert sum(len(b) for b in batches) == 60 and len(batches) >= 8
    assert all(earlier[-1] <= later[0] for earlier, later in zip(batches, batches[1:], strict=False))


def test_what_a_shard_gathers_before_its_batches_run_is_bounded_in_rows_and_frames(
    sessions: dict[str, ModelSession],
) -> None:
    def gathered(rule: BatchRule, frames: int) -> int:
        """Rows of `frames` log-mel frames gathered when the batches would run."""
        twin = sessions["tokenizer"].twin
        assert twin is not None
        waiting = TokenBatches(sessions["tokenizer"], twin, rule)
        while not waiting.full:
            waiting.add(object(), [np.zeros((128, frames), dtype=np.float32)])  # type: ignore[arg-type]
        return len(waiting.clips)

    cpu, gpu = BatchRule(8, 1600, 300), BatchRule(32, 96000, None)
    assert gathered(cpu, 200) == 128  # short clips: many rows to sort
    assert gathered(BatchRule(8, 1600, None), 3000) == 13  # `on` the CPU: 30 s windows, 20 MB at most
    assert gathered(gpu, 3000) == 128 and gathered(gpu, 100) == 128  # 4 batches' worth of a GPU's
    assert gathered(BatchRule(64, 1600, None), 20) == 256
