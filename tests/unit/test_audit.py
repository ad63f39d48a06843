"""`pipeline.outputs.audit`: the comparisons, the sample, the verdict, and reading a run's outputs;
re-extraction runs the tiny stand-ins for real."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline import Extractor
from pipeline.demo import speechlike
from pipeline.errors import VoxmillError
from pipeline.models.standin import make_standins
from pipeline.outputs.audit import (
    AuditThresholds,
    StoredRow,
    audit_run,
    cosine,
    draw_sample,
    paths_by_utt,
    read_stored_rows,
    token_agreement,
)
from pipeline.outputs.folder import RunFolder
from pipeline.settings import Settings

UTTS = [f"u{i}" for i in range(6)]


def test_token_agreement_counts_positions_over_the_longer_sequence() -> None:
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.75
    assert token_agreement([1, 2, 3, 4], [1, 2, 3]) == 0.75  # a missing token counts against it
    assert token_agreement([], []) == 1.0


def test_cosine_in_float64() -> None:
    a = np.random.default_rng(0).normal(size=192)
    assert cosine(a, a) == pytest.approx(1.0, abs=1e-12)
    assert cosine(a, -a) == pytest.approx(-1.0, abs=1e-12)
    assert cosine(a, a[:100]) == 0.0 and cosine(np.zeros(3), np.zeros(3)) == 1.0


def test_the_sample_is_a_seeded_subset() -> None:
    pool = [f"x{i}" for i in range(100)]
    first = draw_sample(pool, 10, seed=3)
    assert (
        first == draw_sample(reversed(pool), 10, seed=3) and len(set(first)) == 10 and set(first) <= set(pool)
    )
    assert first != draw_sample(pool, 10, seed=4)
    assert draw_sample(pool[:5], 10, seed=3) == sorted(pool[:5])


def test_thresholds_from_settings() -> None:
    assert AuditThresholds.from_settings(Settings()) == AuditThresholds(1.0, 0.9999)
    custom = AuditThresholds.from_settings(Settings(audit_min_token_agreement=0.98, audit_min_cosine=0.999))
    assert (custom.min_token_agreement, custom.min_cosine) == (0.98, 0.999)


def test_paths_by_utt_refuses_one_utt_with_two_paths() -> None:
    assert paths_by_utt([("a", "/x.wav"), ("b", "/y.wav"), ("a", "/x.wav")]) == {"a": "/x.wav", "b": "/y.wav"}
    with pytest.raises(VoxmillError) as refused:
        paths_by_utt([("a", "/x.wav"), ("a", "/z.wav")])
    assert refused.value.code == "bad_request"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, StoredRow], dict[str, str]]:
    """Tiny models, six clips, and the rows an honest run over them stores (computed in-process)."""
    folder = tmp_path_factory.mktemp("audit")
    models = folder / "models"
    make_standins(models, profile="tiny")
    paths = {}
    for index, utt in enumerate(UTTS):
        paths[utt] = str(folder / f"{utt}.wav")
        sf.write(paths[utt], speechlike(1.0 + 0.3 * index, 16000, 120.0, index), 16000, subtype="PCM_16")
    with Extractor.from_model_dir(models) as ex:
        tok_sha, emb_sha = ex.sessions["tokenizer"].sha256, ex.sessions["embedder"].sha256
        rows = {
            utt: StoredRow(utt, ex.tokenize(path), ex.embed(path).tolist(), tok_sha, emb_sha)
            for utt, path in paths.items()
        }
    return models, rows, paths


def test_an_honest_run_passes(run) -> None:
    models, rows, paths = run
    report = audit_run(rows, paths, models, sample=4, seed=1, thresholds=AuditThresholds())
    assert report.ok and report.verdict == "pass", report.reasons
    data = report.to_dict()
    assert data["sampled"] == 4 and data["candidates"] == 6 and len(data["utts"]) == 4
    groups = {g["role"]: g for g in data["models"]}
    assert groups["tokenizer"]["min"] == 1.0 and groups["tokenizer"]["identical"] == 4
    assert groups["embedder"]["min"] > 0.9999 and groups["embedder"]["judged"]
    assert data["reference"]["embedder"]["sha256"] == rows["u0"].embedder_sha256
    assert report.lines()[-1] == "verdict: pass"
    json.dumps(data)  # JSON-ready


def test_a_changed_token_or_embedding_fails(run) -> None:
    models, rows, paths = run
    bad = dict(rows)
    tokens = list(rows["u2"].speech_token or [])
    tokens[3] = (tokens[3] + 1) % 4096
    bad["u2"] = StoredRow(
        "u2", tokens, rows["u2"].embedding, rows["u2"].tokenizer_sha256, rows["u2"].embedder_sha256
    )
    emb = np.array(rows["u4"].embedding)
    emb[:20] *= -1  # a different vector, same norm
    bad["u4"] = StoredRow(
        "u4", rows["u4"].speech_token, emb.tolist(), rows["u4"].tokenizer_sha256, rows["u4"].embedder_sha256
    )
    report = audit_run(bad, paths, models, sample=6, seed=0, thresholds=AuditThresholds())
    assert not report.ok
    assert any(r.startswith("tokenizer") and "u2" in r for r in report.reasons), report.reasons
    assert any(r.startswith("embedder") and "u4" in r for r in report.reasons), report.reasons
    loose = audit_run(bad, paths, models, 6, 0, AuditThresholds(min_token_agreement=0.9, min_cosine=0.0))
    assert loose.ok, loose.reasons  # one token in ~25 is within a 0.9 agreement threshold


def test_rows_of_another_model_are_reported_not_judged(run) -> None:
    models, rows, paths = run
    other = "f" * 64
    mixed = {
        utt: StoredRow(
            utt, row.speech_token, row.embedding, other if utt in ("u0", "u1") else row.tokenizer_sha256
        )
        for utt, row in rows.items()
    }
    report = audit_run(mixed, paths, models, sample=6, seed=0, thresholds=AuditThresholds())
    assert report.ok, report.reasons  # u0 and u1 still agree, but would not count if they did not
    shas = {(g.role, g.sha256): g for g in report.models}
    assert not shas[("tokenizer", other)].judged and len(shas[("tokenizer", other)].values) == 2
    assert shas[("embedder", "unknown")].judged  # no sha stored: compared and judged
    only_other = {u: StoredRow(u, r.speech_token, None, other) for u, r in rows.items()}
    report = audit_run(only_other, paths, models, sample=3, seed=0, thresholds=AuditThresholds())
    assert not report.ok and "no sampled tokenizer row was produced by the model" in report.reasons[0]


def test_an_utterance_that_cannot_be_read_again_fails(run, tmp_path: Path) -> None:
    models, rows, paths = run
    moved = dict(paths, u3=str(tmp_path / "gone.wav"))
    report = audit_run(rows, moved, models, sample=6, seed=0, thresholds=AuditThresholds())
    assert not report.ok and report.failures[0]["utt"] == "u3" and report.failures[0]["code"] == "not_found"
    nothing = audit_run(rows, {}, models, sample=6, seed=0, thresholds=AuditThresholds())
    assert not nothing.ok and nothing.sampled == []


def test_read_stored_rows_takes_per_row_sha256_else_the_report(tmp_path: Path) -> None:
    tokens = pa.table({"utt": ["a", "b"], "speech_token": [[1, 2], [3]], "model_sha256": ["t1", "t2"]})
    pq.write_table(tokens, tmp_path / "speech_tokens.parquet")
    embeddings = pa.table({"utt": ["a", "c"], "spk": ["s", "s"], "embedding": [[0.5, 0.5], [1.0, 0.0]]})
    pq.write_table(embeddings, tmp_path / "utt_embeddings.parquet")
    report = {
        "models": {"tokenizer": {"file": "t.onnx", "sha256": "T"}, "embedder": {"file": "c", "sha256": "E"}}
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    rows = read_stored_rows(RunFolder.of(tmp_path))
    assert rows["a"] == StoredRow("a", [1, 2], [0.5, 0.5], "t1", "E")
    assert rows["b"] == StoredRow("b", [3], None, "t2", None)
    assert rows["c"] == StoredRow("c", None, [1.0, 0.0], None, "E")
    report["models_mixed"] = {"embedder": []}  # the embedder changed mid-run: no run-wide sha256
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert read_stored_rows(RunFolder.of(tmp_path))["c"].embedder_sha256 is None
