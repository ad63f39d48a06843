"""Batched tokens in whole `voxmill extract` runs (embedded Redis, real workers, the tiny stand-ins
with their batch twin, as a CosyVoice folder holds them): the same tokens as one clip at a time,
each row naming the file that made it, one model in the report, the audit judging both files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.models.standin import TOKENIZER_BATCH_FILE, TOKENIZER_FILE
from pipeline.outputs.audit import AuditThresholds, audit_run, paths_by_utt, read_stored_rows
from pipeline.outputs.folder import RunFolder
from tests.conftest import voxmill
from tests.helpers import make_audio_folder

CLIPS = 14


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extract(corpus: Path, out: Path, models: Path, mode: str, *more: str) -> str:
    done = voxmill(
        "extract", str(corpus), "--out", str(out), "--models", str(models), "--workers", "2",
        "--shard-size", "5", "--quiet", *more, timeout=300,
        env={"VOXMILL_BATCH_TOKENIZE": mode, "VOXMILL_BATCH_MAX_CLIP_S": "3"},  # the CPU's opt-in rule
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def token_rows(out: Path) -> dict[str, tuple[list[int], str]]:
    table = pq.read_table(out / "speech_tokens.parquet").to_pylist()
    return {row["utt"]: (row["speech_token"], row["model_sha256"]) for row in table}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_models: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batched")
    corpus = make_audio_folder(root / "corpus", CLIPS, 0.5, 6.0, speakers=2, seed=11)
    found = {"corpus": corpus}
    for mode in ("off", "auto"):
        found[mode] = root / mode
        extract(corpus, found[mode], tiny_models, mode)
    return found


def durations(out: Path) -> dict[str, float]:
    return {row["utt"]: row["duration_s"] for row in pq.read_table(out / "utt_stats.parquet").to_pylist()}


def test_batched_rows_have_the_single_models_tokens_and_name_the_batch_file(
    runs: dict[str, Path], tiny_models: Path
) -> None:
    single, batch = sha256(tiny_models / TOKENIZER_FILE), sha256(tiny_models / TOKENIZER_BATCH_FILE)
    off, auto = token_rows(runs["off"]), token_rows(runs["auto"])
    assert len(auto) == CLIPS and {u: t for u, (t, _) in auto.items()} == {u: t for u, (t, _) in off.items()}
    assert {sha for _, sha in off.values()} == {single}
    seconds = durations(runs["auto"])
    made = {utt: sha for utt, (_, sha) in auto.items()}
    assert {utt for utt, sha in made.items() if sha == batch} == {u for u, s in seconds.items() if s <= 3.0}
    assert {utt for utt, sha in made.items() if sha == single} == {u for u, s in seconds.items() if s > 3.0}
    assert 0 < sum(1 for s in seconds.values() if s <= 3.0) < CLIPS  # both paths were taken

    report = json.loads((runs["auto"] / "report.json").read_text())
    tokenizer = report["models"]["tokenizer"]
    assert (tokenizer["file"], tokenizer["sha256"], tokenizer["twin_sha256"]) == (
        TOKENIZER_BATCH_FILE,
        batch,
        single,
    )
    assert not report.get("models_mixed")  # one model, two files
    provenance = json.loads(
        pq.read_schema(runs["auto"] / "speech_tokens.parquet").metadata[b"voxmill.provenance"]
    )
    assert provenance["models"]["tokenizer"]["twin_sha256"] == single


def test_the_audit_judges_both_files_of_the_model(runs: dict[str, Path], tiny_models: Path) -> None:
    corpus = runs["corpus"]
    paths = paths_by_utt((str(p.relative_to(corpus).with_suffix("")), str(p)) for p in corpus.rglob("*.wav"))
    rows = read_stored_rows(RunFolder.of(runs["auto"]))
    report = audit_run(rows, paths, tiny_models, sample=CLIPS, seed=1, thresholds=AuditThresholds())
    assert report.ok, report.reasons
    tokenizer = {g.file: g for g in report.models if g.role == "tokenizer"}
    assert set(tokenizer) == {TOKENIZER_FILE, TOKENIZER_BATCH_FILE}
    assert all(g.judged and min(g.values.values()) == 1.0 for g in tokenizer.values())
    assert any(TOKENIZER_BATCH_FILE in line for line in report.lines())


def test_a_run_resumed_with_batching_on_is_not_mixed(
    runs: dict[str, Path], tiny_models: Path, tmp_path: Path
) -> None:
    # Made one clip at a time, half its shards deleted, then finished with batching on.
    out = tmp_path / "out"
    shutil.copytree(runs["off"], out)
    for shard in sorted((out / "shards").glob("*.parquet"))[1:]:
        shard.unlink()
    (out / "report.json").unlink()
    said = extract(runs["corpus"], out, tiny_models, "auto")
    assert "other models" not in said and "--redo-mixed" not in said
    report = json.loads((out / "report.json").read_text())
    assert not report.get("models_mixed") and report["ops"]["tokenize"]["ok"] == CLIPS
    assert {u: t for u, (t, _) in token_rows(out).items()} == {
        u: t for u, (t, _) in token_rows(runs["off"]).items()
    }
