"""`voxmill extract` end to end: input kinds, broken files, interruption and resume, outputs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from pipeline.outputs.folder import RunFolder
from tests.conftest import VOXMILL, clean_env, make_settings, voxmill, wait_for
from tests.helpers import make_audio_folder, read_outputs, worker_dicts

SLOW_CORPUS_SIZE = 48


@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_audio_folder(tmp_path_factory.mktemp("corpus-slow"), SLOW_CORPUS_SIZE, 8.0, 16.0, seed=3)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, slow_models: Path, slow_corpus: Path) -> Path:
    """An uninterrupted embedded run: what every interrupted-and-resumed run must equal."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = extract(slow_corpus, out, slow_models)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def extract(corpus: Path, out: Path, models: Path, *extra: str, env: dict[str, str] | None = None):
    return voxmill(
        "extract",
        str(corpus),
        "--out",
        str(out),
        "--models",
        str(models),
        "--workers",
        "2",
        "--shard-size",
        "2",
        "--quiet",
        *extra,
        env=env,
        timeout=300,
    )


def start_extract(
    corpus: Path, out: Path, models: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    args = [
        VOXMILL,
        "extract",
        str(corpus),
        "--out",
        str(out),
        "--models",
        str(models),
        "--workers",
        "2",
        "--shard-size",
        "2",
        "--quiet",
    ]
    return subprocess.Popen(
        args, env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def shard_files(out: Path) -> list[Path]:
    folder = out / RunFolder.SHARDS
    return sorted(folder.glob("*.parquet")) if folder.exists() else []


def test_kaldi_dir_with_broken_files(tmp_path: Path) -> None:
    from pipeline.demo import make_demo_corpus
    from pipeline.models.standin import make_standins

    data = make_demo_corpus(tmp_path / "demo")
    make_standins(tmp_path / "models")
    out = tmp_path / "out"
    done = extract(data, out, tmp_path / "models")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["utterances"] == 14
    assert report["ops"] == {"tokenize": {"ok": 13, "failed": 1}, "embed": {"ok": 13, "failed": 1}}
    assert set(report["models"]) == {"tokenizer", "embedder"}
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert sorted((e["utt"], e["op"], e["code"]) for e in errors) == [
        ("spk3_broken", "embed", "unreadable"),
        ("spk3_broken", "tokenize", "unreadable"),
    ]
    tokens = pq.read_table(out / "speech_tokens.parquet")
    assert tokens.schema.field("speech_token").type == pa.list_(pa.int32())
    assert tokens.schema.field("utt").type == pa.string()
    rows = {r["utt"]: r["speech_token"] for r in tokens.to_pylist()}
    assert len(rows) == 13 and len(rows["spk2_long"]) == pytest.approx(
        32 * 25, abs=1
    )  # the 32 s clip, windowed
    utt_emb = pq.read_table(out / "utt_embeddings.parquet")
    assert utt_emb.schema.field("embedding").type == pa.list_(pa.float32())
    spk_emb = pq.read_table(out / "spk_embeddings.parquet")
    assert spk_emb.schema.field("num_utts").type == pa.int64()
    by_spk: dict[str, list[list[float]]] = {}
    for row in utt_emb.to_pylist():
        by_spk.setdefault(row["spk"], []).append(row["embedding"])
    for row in spk_emb.to_pylist():
        assert row["num_utts"] == len(by_spk[row["spk"]])
        np.testing.assert_allclose(
            row["embedding"], np.mean(by_spk[row["spk"]], axis=0), rtol=1e-5, atol=1e-6
        )


def _said_audio(done: subprocess.CompletedProcess[str]) -> tuple[str, str, str]:
    """(audio in the last progress line, audio in the summary line, the progress line's failures)."""
    progress = [line for line in done.stderr.splitlines() if line.startswith("extract: ")][-1]
    summary = next(line for line in done.stdout.splitlines() if " of audio in " in line)
    amount = r"(\d[\d.]* (?:s|min|h))"
    shown = re.search(rf"utterances, {amount} (?:of \S+ \S+ )?audio,", progress)
    total = re.search(rf"utterances, {amount} of audio in", summary)
    assert shown and total, (progress, summary)
    failed = progress.rsplit(", failed: ", 1)[1] if ", failed: " in progress else ""
    return shown.group(1), total.group(1), failed


def test_the_progress_line_and_the_summary_say_the_same_audio_and_failures(tmp_path: Path) -> None:
    """Many one-utterance shards (some files found before their announcement is heard), then a
    resume that redoes a few: the last progress line counts the audio and the failures the summary
    and its table count (the demo's broken clip: one failure per op)."""
    from pipeline.demo import make_demo_corpus
    from pipeline.models.standin import make_standins

    data = make_demo_corpus(tmp_path / "demo")
    make_standins(tmp_path / "models")
    out = tmp_path / "out"
    args = ("extract", str(data), "--out", str(out), "--models", str(tmp_path / "models"), "--workers", "2")
    for attempt in ("fresh", "resumed"):
        if attempt == "resumed":
            for shard in sorted(shard_files(out))[::3]:
                shard.unlink()
        done = voxmill(*args, "--shard-size", "1", env={"COLUMNS": "200"}, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        progress, summary, failed = _said_audio(done)
        assert progress == summary, (attempt, done.stderr, done.stdout)
        assert failed == "1 tokenize, 1 embed", (attempt, done.stderr)


def test_a_filter_re_merge_keeps_the_extractions_wall_time(tmp_path: Path, tiny_models: Path) -> None:
    corpus = make_audio_folder(tmp_path / "corpus", 4, 1.0, 3.0, speakers=2)
    out = tmp_path / "out"
    assert extract(corpus, out, tiny_models).returncode == 0
    extracted = json.loads((out / "report.json").read_text())
    done = extract(corpus, out, tiny_models, "--min-duration", "2.0")
    assert done.returncode == 0, done.stderr
    remerged = json.loads((out / "report.json").read_text())
    assert remerged["filters"]["min_duration_s"] == 2.0  # merged anew, with the filter
    assert remerged["wall_seconds"] == extracted["wall_seconds"]
    assert remerged["resubmitted_shards"] == extracted["resubmitted_shards"]
    assert remerged["remerge_wall_seconds"] > 0 and "remerge_wall_seconds" not in extracted
    assert f"of audio in {extracted['wall_seconds']:.1f} s; filters applied anew in " in done.stdout


def test_jsonl_manifest_and_audio_folder_give_the_same_features(tmp_path: Path, tiny_models: Path) -> None:
    corpus = make_audio_folder(tmp_path / "corpus", 6, 1.0, 3.0, speakers=2)
    manifest = tmp_path / "manifest.jsonl"
    with manifest.open("w") as handle:
        for wav in sorted(corpus.rglob("*.wav")):
            rel = wav.relative_to(corpus)
            entry = {
                "utt": str(rel.with_suffix("")),
                "path": str(Path("corpus") / rel),
                "spk": rel.parent.name,
            }
            handle.write(json.dumps(entry) + "\n")
    from_folder = extract(corpus, tmp_path / "out-folder", tiny_models)
    from_manifest = extract(manifest, tmp_path / "out-manifest", tiny_models)
    assert from_folder.returncode == 0 and from_manifest.returncode == 0, (
        from_folder.stderr + from_manifest.stderr
    )
    a, b = read_outputs(tmp_path / "out-folder"), read_outputs(tmp_path / "out-manifest")
    assert a["speech_tokens.parquet"] == b["speech_tokens.parquet"]
    assert a["spk_embeddings.parquet"] == b["spk_embeddings.parquet"]
    assert [r["utt"] for r in a["speech_tokens.parquet"]] == sorted(
        str(p.relative_to(corpus).with_suffix("")) for p in corpus.rglob("*.wav")
    )


def test_malformed_manifest_lines_are_reported_with_line_numbers(tmp_path: Path, tiny_models: Path) -> None:
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text('{"utt": "a", "path": "a.wav"}\nnot json\n{"utt": 3, "path": "b.wav"}\n')
    done = extract(manifest, tmp_path / "out", tiny_models)
    assert done.returncode == 2
    assert "line 2" in done.stderr and "line 3" in done.stderr
    # said before anything started: no output folder, so no local worker and no workers.log
    assert not (tmp_path / "out").exists()


def test_rerun_on_a_finished_folder_skips_every_shard(
    tmp_path: Path, reference_run: Path, slow_corpus: Path, slow_models: Path
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in shard_files(reference_run)}
    done = extract(slow_corpus, reference_run, slow_models)
    assert done.returncode == 0, done.stderr
    assert {p.name: p.stat().st_mtime_ns for p in shard_files(reference_run)} == before


def test_a_different_corpus_in_the_same_folder_is_refused(
    tmp_path: Path, reference_run: Path, tiny_models: Path
) -> None:
    other = make_audio_folder(tmp_path / "other", 2, 1.0, 2.0)
    done = extract(other, reference_run, tiny_models)
    assert done.returncode == 2 and "different corpus" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_driver_then_rerun_equals_an_uninterrupted_run(
    sig: int, tmp_path: Path, reference_run: Path, slow_corpus: Path, slow_models: Path
) -> None:
    out = tmp_path / "out"
    proc = start_extract(slow_corpus, out, slow_models)
    wait_for(lambda: len(shard_files(out)) >= 4 or proc.poll() is not None, timeout_s=120, interval_s=0.02)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    partial = len(shard_files(out))
    assert 0 < partial < 2 * SLOW_CORPUS_SIZE // 2
    time.sleep(1.0)  # anything the dead driver left running would keep writing now
    assert no_process_uses(out), "processes of the interrupted run are still alive"
    done = extract(slow_corpus, out, slow_models)
    assert done.returncode == 0, done.stdout + done.stderr
    assert read_outputs(out) == read_outputs(reference_run)


def no_process_uses(out: Path) -> bool:
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(out) not in listing


@pytest.mark.slow
def test_killing_a_worker_child_mid_shard_loses_nothing(
    tmp_path: Path,
    redis_url: str,
    redis_client: redis.Redis,
    start_worker,
    reference_run: Path,
    slow_corpus: Path,
    slow_models: Path,
) -> None:
    out = tmp_path / "out"
    settings = make_settings(redis_url, slow_models, [slow_corpus, tmp_path])
    workers = start_worker(settings, concurrency=2, queues=("tokenize", "embed"))
    proc = start_extract(slow_corpus, out, slow_models, env=settings.to_env())
    wait_for(lambda: len(shard_files(out)) >= 3, timeout_s=120, interval_s=0.02)
    children = [r["pid"] for r in worker_dicts(redis_client) if r["ppid"] == workers.process.pid]
    os.kill(children[0], signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, proc.stdout.read() if proc.stdout else ""
    assert read_outputs(out) == read_outputs(reference_run)


def test_local_workers_that_exit_end_the_run_with_their_exit_code(
    tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards are submitted while the local workers start; a worker process that exits instead
    (here one that fails at once, as a broken install would) ends the run at once, naming its
    exit code and its log, instead of waiting for shards that nobody will take."""
    import sys

    import workers.embedded
    from pipeline.errors import RunError
    from pipeline.settings import Settings
    from workers.extract import extract_corpus

    corpus = make_audio_folder(tmp_path / "corpus", 4, 1.0, 2.0, seed=5)
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    monkeypatch.setattr(workers.embedded, "worker_command", lambda *args, **kwargs: failing)
    settings = Settings(model_dir=tiny_models, broker_url=None)
    started = time.monotonic()
    with pytest.raises(RunError, match="exited with code 3.*workers.log"):
        extract_corpus(settings, corpus, RunFolder.of(tmp_path / "out"), ["embed"], 2, 0, quiet=True)
    assert time.monotonic() - started < 30


def test_local_workers_that_cannot_load_their_model_end_the_run(
    tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model file that is there but does not load: the workers run without it and never get
    ready; the run ends after the ready timeout, pointing at the workers' log (where the load
    error is), and stops its workers and Redis."""
    import shutil

    import workers.extract
    from pipeline.errors import RunError
    from pipeline.settings import Settings

    models = tmp_path / "models"
    shutil.copytree(tiny_models, models)
    (models / "campplus.onnx").write_bytes(b"not an onnx model")
    corpus = make_audio_folder(tmp_path / "corpus", 4, 1.0, 2.0, seed=5)
    # Long enough for a worker to start and try its load on a busy machine: the log must say why.
    settings = Settings(model_dir=models, broker_url=None, local_ready_timeout_s=8.0)
    out = tmp_path / "out"
    with pytest.raises(RunError, match="did not load their models within 8 s.*workers.log"):
        workers.extract.extract_corpus(settings, corpus, RunFolder.of(out), ["embed"], 1, 0, quiet=True)
    assert "could not load the embedder model" in (out / "workers.log").read_text()


def test_a_shard_whose_file_cannot_be_written_is_given_up_and_the_run_completes(
    tmp_path: Path, tiny_models: Path
) -> None:
    """A folder squats on shard 1's file name, so every attempt's task fails to write it (a real
    failure: the rename meets a folder). The driver sends the shard `shard_max_attempts` times,
    gives it up, lists its utterances in errors.jsonl, and the run completes; a resume finds the
    shard given up and sends nothing again."""
    from pipeline.run.plan import PlanReader

    corpus = make_audio_folder(tmp_path / "corpus", 6, 0.5, 1.0, speakers=2, seed=11)
    out = tmp_path / "out"
    squatter = out / RunFolder.SHARDS / "extract-000001.parquet"
    squatter.mkdir(parents=True)
    (squatter / "not-a-shard").write_text("a folder where shard 1's file would go")
    started = time.monotonic()
    done = extract(corpus, out, tiny_models)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 120
    report = json.loads((out / "report.json").read_text())
    assert report["ops"] == {"tokenize": {"ok": 4, "failed": 2}, "embed": {"ok": 4, "failed": 2}}
    assert report["given_up_shards"] == 1 and report["utterances"] == 6
    shard_1 = next(utts for shard, utts in PlanReader(RunFolder.of(out)).shards() if shard == 1)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert sorted((e["utt"], e["op"], e["code"]) for e in errors) == sorted(
        (u.utt, op, "output_error") for u in shard_1 for op in ("tokenize", "embed")
    )
    for error in errors:
        assert "was given up after 4 attempt(s)" in error["message"], error
        assert "Is a directory" in error["message"], error
    assert (out / RunFolder.SHARDS / "extract-000001.given-up.parquet").is_file()
    again = extract(corpus, out, tiny_models)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((out / "report.json").read_text()) == report


def test_a_corpus_in_a_thousand_folders_under_two_top_level_folders_runs_embedded(
    tmp_path: Path, tiny_models: Path
) -> None:
    """The folders an embedded run lets its workers read are those its corpus names: here ~150 kB
    of them, more than one environment variable may hold (Linux: 128 kB), under two folders whose
    common ancestor (/tmp) is not to be allowed. They reach the workers in a file; the run starts
    and finishes."""
    import shutil
    import tempfile

    import soundfile as sf

    from pipeline.demo import speechlike

    clip = tmp_path / "clip.wav"
    sf.write(clip, speechlike(0.2, 16000, 120.0, seed=1), 16000, subtype="PCM_16")
    tops = [Path(tempfile.mkdtemp(prefix=f"voxmill-roots-{side}-", dir="/tmp")) for side in "ab"]
    try:
        lines = []
        for i in range(1200):
            folder = tops[i % 2] / f"{'speaker-' * 12}{i:05d}"
            folder.mkdir()
            try:
                os.link(clip, folder / "c.wav")
            except OSError:  # /tmp on another file system than the test's folder
                shutil.copy(clip, folder / "c.wav")
            lines.append(json.dumps({"utt": f"u{i:05d}", "path": str(folder / "c.wav")}) + "\n")
        assert sum(len(str(top)) + 110 for top in tops) * 600 > 131072  # the old way would overflow
        manifest = tmp_path / "corpus.jsonl"
        manifest.write_text("".join(lines))
        out = tmp_path / "out"
        done = voxmill(
            "extract",
            str(manifest),
            "--out",
            str(out),
            "--models",
            str(tiny_models),
            "--workers",
            "2",
            "--quiet",
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads((out / "report.json").read_text())
        assert report["ops"] == {"tokenize": {"ok": 1200, "failed": 0}, "embed": {"ok": 1200, "failed": 0}}
    finally:
        for top in tops:
            shutil.rmtree(top, ignore_errors=True)


def test_in_a_shell_with_a_broker_extract_says_whose_workers_run_and_what_they_cannot(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, start_worker, tiny_models: Path
) -> None:
    """A shell where `voxmill up`'s export line was run: `extract` is a broker run. `--workers` is
    said to do nothing; a queue no live worker consumes (only `-Q embed` workers, `--ops
    tokenize`) fails at once, exit 2, naming the command, with nothing sent; an --out the workers
    may not write (outside their roots, as `up`'s workers outside its folder) says why."""
    corpus = make_audio_folder(tmp_path / "corpus", 2, 0.5, 1.0, seed=7)
    settings = make_settings(redis_url, tiny_models, [corpus])  # the workers write below corpus/ only
    start_worker(settings, concurrency=1, queues=("embed",))
    started = time.monotonic()
    done = voxmill(
        "extract", str(corpus), "--out", str(tmp_path / "out"), "--ops", "tokenize", "--workers", "2",
        env=settings.to_env(), timeout=60,
    )  # fmt: skip
    said = " ".join(done.stderr.split())  # as one line, however the terminal wrapped it
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no live worker consumes the tokenize queue: start one with voxmill worker -Q tokenize" in said
    assert "VOXMILL_BROKER_URL is set" in said and "--workers applies to local workers only" in said
    assert time.monotonic() - started < 30 and redis_client.llen("tokenize") == 0  # nothing sent
    done = voxmill(
        "extract", str(corpus), "--out", str(tmp_path / "out2"), "--ops", "embed",
        env=settings.to_env(), timeout=60,
    )  # fmt: skip
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{tmp_path / 'out2'} is outside the allowed roots" in said
    assert "VOXMILL_BROKER_URL is set, so this run's shards go to the workers on that broker" in said


def test_a_broker_run_stops_when_every_worker_of_its_queue_is_gone(
    tmp_path: Path, redis_url: str, start_worker, slow_models: Path
) -> None:
    """Every consumer of the run's queue stops mid-run (a hung machine: its heartbeats end): once
    their records expire and `consumer_grace_s` passes, the run ends with exit 2 naming the
    queue and the command, instead of waiting and resubmitting for ever."""
    corpus = make_audio_folder(tmp_path / "corpus", 24, 1.0, 2.0, seed=9)
    settings = make_settings(
        redis_url, slow_models, [corpus, tmp_path], heartbeat_interval_s=0.5, heartbeat_ttl_s=2,
        consumer_grace_s=3.0,
    )  # fmt: skip
    workers = start_worker(settings, concurrency=1, queues=("tokenize", "embed"))
    assert workers.process is not None
    out = tmp_path / "out"
    args = [VOXMILL, "extract", str(corpus), "--out", str(out), "--shard-size", "2"]
    proc = subprocess.Popen(
        args, env=clean_env(settings.to_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: shard_files(out) or proc.poll() is not None, timeout_s=120, interval_s=0.02)
        os.killpg(workers.process.pid, signal.SIGSTOP)
        assert proc.poll() is None, "the run finished before its worker could be stopped"
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        said = " ".join(stderr.split())
        assert proc.returncode == 2, stderr
        assert "no live worker has consumed the extract queue for 3 s (consumer_grace_s)" in said
        assert "voxmill worker -Q extract" in said and "run the same command again" in said
        assert time.monotonic() - stopped < 30
        assert len(shard_files(out)) < 12  # it ended mid-run
    finally:
        if proc.poll() is None:
            proc.kill()
        workers.stop(timeout_s=0)  # SIGKILL reaches a stopped process


def test_a_rerun_with_other_models_says_the_rows_are_not_theirs(tmp_path: Path, tiny_models: Path) -> None:
    """A finished folder run again with another --models: every shard is an earlier run's, so
    nothing is redone; the run says the rows' models differ and points at --redo-mixed."""
    from pipeline.models.standin import make_standins

    corpus = make_audio_folder(tmp_path / "corpus", 4, 0.5, 1.0, seed=13)
    other = tmp_path / "other-models"
    make_standins(other, profile="tiny", seed=1)

    def run(models: Path) -> subprocess.CompletedProcess[str]:
        return voxmill(
            "extract", str(corpus), "--out", str(tmp_path / "out"), "--models", str(models), "--ops",
            "embed", "--workers", "1", timeout=300,
        )  # fmt: skip

    first = run(tiny_models)
    assert first.returncode == 0 and "--redo-mixed" not in first.stderr, first.stderr
    again = run(other)
    said = " ".join(again.stderr.split())
    assert again.returncode == 0, again.stderr
    assert "all done by an earlier run" in said
    assert f"rows of these outputs were made by other models than those in {other}" in said
    assert "--redo-mixed" in said


def test_a_kaldi_dir_of_short_clips_without_utt2dur_runs_in_shards_sized_from_their_headers(
    tmp_path: Path, tiny_models: Path
) -> None:
    wavs = sorted(make_audio_folder(tmp_path / "clips", 96, 0.5, 0.5).rglob("*.wav"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_text("".join(f"u{i:03d} {wav}\n" for i, wav in enumerate(wavs)))
    out = tmp_path / "out"
    # 4 s of 0.5 s clips a shard: 8, twice the 4 a listing without durations was cut to.
    env = {"VOXMILL_SHARD_SIZE": "4", "VOXMILL_SHARD_SECONDS": "4"}
    args = ("extract", str(data), "--out", str(out), "--models", str(tiny_models), "--ops", "embed")
    done = voxmill(*args, "--workers", "2", "--quiet", env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / RunFolder.PLAN_HEADER).read_text())["shard_size"] == 8
    assert len(shard_files(out)) == 12
    assert json.loads((out / "report.json").read_text())["ops"] == {"embed": {"ok": 96, "failed": 0}}
