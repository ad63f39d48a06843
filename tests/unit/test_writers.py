"""Shard files (atomic, typed) and the merged outputs of `extract`."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import OUTPUT_ERROR, ErrorRecord, VoxmillError
from pipeline.outputs import writers
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.merge import merge_outputs
from pipeline.outputs.report import RunReport
from pipeline.outputs.tally import speaker_means
from pipeline.outputs.writers import read_shard, shard_counts, write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance, models_from_dict
from pipeline.storage import locations

TOK = {"tokenizer": {"file": "speech_tokenizer_v2.onnx", "sha256": "a" * 64}}
EMB = {"embedder": {"file": "campplus.onnx", "sha256": "b" * 64}}


def _utt(name: str, spk: str) -> Utterance:
    return Utterance(utt=name, path=f"/d/{name}.wav", spk=spk)


def _ok(op: str, utt: str, seconds: float = 1.5) -> TaskResult:
    seed = sum(map(ord, utt))
    tokens = [seed % 4096, (seed * 7) % 4096, 6560] if op in ("tokenize", "extract") else None
    embedding = [float(seed % 10) / 8, -0.25, 1e-3] if op in ("embed", "extract") else None
    models = models_from_dict({**(TOK if tokens else {}), **(EMB if embedding else {})})
    return TaskResult(
        input=utt, op=op, speech_token=tokens, embedding=embedding, audio_seconds=seconds, models=models
    )


def _failed(op: str, utt: str, code: str = "unreadable") -> TaskResult:
    return TaskResult(input=utt, op=op, error=ErrorRecord(code, f"{utt} is broken"))


def _temp_files(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob(".*tmp*")] if folder.exists() else []


# --------------------------------------------------------------------------- shards


def test_write_shard_types_rows_and_metadata(tmp_path: Path) -> None:
    utts = [_utt("a", "s1"), _utt("b", "s2"), _utt("c", "s1")]
    spec = ShardSpec(shard=3, op="tokenize", out_dir=str(tmp_path), utts=utts)
    path = write_shard(
        RunFolder.of(tmp_path),
        spec,
        [_ok("tokenize", "a"), _failed("tokenize", "b"), _ok("tokenize", "c", 2.0)],
    )
    assert path == tmp_path / "shards" / "tokenize-000003.parquet"
    assert _temp_files(tmp_path) == []
    table = read_shard(path)
    assert table.schema.field("utt").type == pa.string()
    assert table.schema.field("spk").type == pa.string()
    assert table.schema.field("audio_seconds").type == pa.float64()
    assert table.schema.field("speech_token").type == pa.list_(pa.int32())
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.schema.field("error_code").type == pa.string()
    assert table.schema.field("error_message").type == pa.string()
    rows = table.to_pylist()
    assert [r["utt"] for r in rows] == ["a", "b", "c"]
    assert [r["spk"] for r in rows] == ["s1", "s2", "s1"]
    assert [r["audio_seconds"] for r in rows] == [1.5, None, 2.0]
    assert rows[0]["speech_token"] == _ok("tokenize", "a").speech_token
    assert rows[1]["speech_token"] is None and rows[0]["embedding"] is None
    assert [r["error_code"] for r in rows] == [None, "unreadable", None]
    assert rows[1]["error_message"] == "b is broken" and rows[0]["error_message"] is None
    assert json.loads(table.schema.metadata[b"voxmill.models"]) == TOK
    assert shard_counts(path) == (2, 1)


def test_write_shard_embed_rows_are_float32(tmp_path: Path) -> None:
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=[_utt("a", "s")])
    table = read_shard(write_shard(RunFolder.of(tmp_path), spec, [_ok("embed", "a")]))
    assert table.column("embedding").to_pylist()[0] == pytest.approx(_ok("embed", "a").embedding)
    assert table.column("embedding").type.value_type == pa.float32()
    assert table.column("speech_token").to_pylist() == [None]


def test_write_shard_overwrites_a_redelivered_shard(tmp_path: Path) -> None:
    spec = ShardSpec(shard=0, op="tokenize", out_dir=str(tmp_path), utts=[_utt("a", "s")])
    write_shard(RunFolder.of(tmp_path), spec, [_failed("tokenize", "a")])
    path = write_shard(RunFolder.of(tmp_path), spec, [_ok("tokenize", "a")])
    assert shard_counts(path) == (1, 0)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["tokenize-000000.parquet"]


def test_write_shard_refuses_mismatched_results(tmp_path: Path) -> None:
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=[_utt("a", "s"), _utt("b", "s")])
    with pytest.raises(VoxmillError):
        write_shard(RunFolder.of(tmp_path), spec, [_ok("embed", "a")])


def test_a_row_the_file_cannot_hold_is_that_utterances_output_error(tmp_path: Path) -> None:
    names = ["ok", "nan", "big_token", "float_token", "inf_seconds", "bad_stat", "str_emb", "huge_emb"]
    utts = [_utt(name, "s") for name in names]
    good = _ok("extract", "ok")
    results = [
        good,
        replace(good, input="nan", embedding=[float("nan"), 0.5, 0.1]),
        replace(good, input="big_token", speech_token=[1, -(2**40), 3]),
        replace(good, input="float_token", speech_token=[1, float("nan")]),  # type: ignore[list-item]
        replace(good, input="inf_seconds", audio_seconds=float("inf")),
        replace(good, input="bad_stat", stats={"source_rate_hz": "16k", "rms_dbfs": -20.0}),
        replace(good, input="str_emb", embedding=["0.5", "0.25"]),  # type: ignore[list-item]
        replace(good, input="huge_emb", embedding=[1e39, 0.0]),
    ]
    spec = ShardSpec(shard=0, op="extract", out_dir=str(tmp_path), utts=utts)
    rows = read_shard(write_shard(RunFolder.of(tmp_path), spec, results)).to_pylist()
    assert [r["utt"] for r in rows] == names
    assert rows[0]["error_code"] is None and rows[0]["speech_token"] == good.speech_token
    assert [r["error_code"] for r in rows[1:]] == [OUTPUT_ERROR] * 7
    assert all(r["speech_token"] is None and r["embedding"] is None for r in rows[1:])
    messages = [r["error_message"] for r in rows[1:]]
    assert messages == [
        "its result cannot be stored: the embedding holds a non-finite value (NaN or infinity)",
        "its result cannot be stored: a speech token (-1099511627776) is out of the int32 range",
        "its result cannot be stored: a speech token is not an integer",
        "its result cannot be stored: audio seconds inf is not a finite number >= 0",
        "its result cannot be stored: statistic source_rate_hz is '16k'",
        "its result cannot be stored: an embedding value is not a number",
        "its result cannot be stored: an embedding value is beyond the float32 range",
    ]


def test_a_models_own_float32_embedding_and_integer_statistics_are_checked_too(tmp_path: Path) -> None:
    names = ["ok", "nan32", "inf32", "big_channels", "bool_channels"]
    good = replace(_ok("embed", "ok"), embedding=np.array([0.5, -0.25], dtype=np.float32))
    results = [
        good,
        replace(good, input="nan32", embedding=np.array([0.5, np.nan], dtype=np.float32)),
        replace(good, input="inf32", embedding=np.array([-np.inf, 0.0], dtype=np.float32)),
        replace(good, input="big_channels", stats={"source_channels": 2**40}),
        replace(good, input="bool_channels", stats={"source_channels": True}),
    ]
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=[_utt(name, "s") for name in names])
    rows = read_shard(write_shard(RunFolder.of(tmp_path), spec, results)).to_pylist()
    assert rows[0]["error_code"] is None and rows[0]["embedding"] == [0.5, -0.25]
    assert [r["error_message"] for r in rows[1:]] == [
        "its result cannot be stored: the embedding holds a non-finite value (NaN or infinity)",
        "its result cannot be stored: the embedding holds a non-finite value (NaN or infinity)",
        "its result cannot be stored: statistic source_channels is 1099511627776",
        "its result cannot be stored: statistic source_channels is True",
    ]


def test_rows_that_still_make_no_table_are_stored_every_one_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A check that missed something: the rows go to the table as they are.
    monkeypatch.setattr(writers, "storable_results", lambda op, results, utts: list(results))
    spec = ShardSpec(shard=2, op="tokenize", out_dir=str(tmp_path), utts=[_utt("a", "s"), _utt("b", "s")])
    bad = replace(_ok("tokenize", "b"), speech_token=[2**40])
    rows = read_shard(write_shard(RunFolder.of(tmp_path), spec, [_ok("tokenize", "a"), bad])).to_pylist()
    assert [r["error_code"] for r in rows] == [OUTPUT_ERROR, OUTPUT_ERROR]
    assert rows[0]["error_message"].startswith("the shard's rows cannot be stored (ArrowInvalid: ")


def test_a_tar_sample_whose_name_is_not_utf8_is_stored_escaped_and_failed(tmp_path: Path) -> None:
    name = "clip\udcff"  # a tar member name of invalid UTF-8, as tarfile decodes it
    spec = ShardSpec(shard=0, op="tokenize", out_dir=str(tmp_path), tar="/t/0.tar")
    path = write_shard(RunFolder.of(tmp_path), spec, [_ok("tokenize", name)], [_utt(name, "s")])
    rows = read_shard(path).to_pylist()
    assert rows[0]["utt"] == "clip\\udcff" and rows[0]["error_code"] == OUTPUT_ERROR
    wanted = "its result cannot be stored: its utt is not valid Unicode (stored escaped)"
    assert rows[0]["error_message"] == wanted


def test_write_failure_on_disk_full_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(locations.os, "replace", full)
    spec = ShardSpec(shard=1, op="embed", out_dir=str(tmp_path), utts=[_utt("a", "s")])
    with pytest.raises(VoxmillError) as caught:
        write_shard(RunFolder.of(tmp_path), spec, [_ok("embed", "a")])
    assert caught.value.code == OUTPUT_ERROR
    assert "No space left on device" in caught.value.message
    assert "embed-000001.parquet" in caught.value.message
    assert list((tmp_path / "shards").iterdir()) == []


def test_write_failure_when_the_folder_cannot_exist(tmp_path: Path) -> None:
    blocker = tmp_path / "out"
    blocker.write_text("a file where the output folder should be")
    spec = ShardSpec(shard=0, op="embed", out_dir=str(blocker), utts=[_utt("a", "s")])
    with pytest.raises(VoxmillError) as caught:
        write_shard(RunFolder.of(blocker), spec, [_ok("embed", "a")])
    assert caught.value.code == OUTPUT_ERROR
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_write_failure_mid_write_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(table: Any, where: Any, **kwargs: Any) -> None:
        where.write(b"PAR1 partial")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writers.pq, "write_table", broken)
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=[_utt("a", "s")])
    with pytest.raises(VoxmillError) as caught:
        write_shard(RunFolder.of(tmp_path), spec, [_ok("embed", "a")])
    assert caught.value.code == OUTPUT_ERROR
    assert list((tmp_path / "shards").iterdir()) == []


def test_read_shard_missing_is_output_error(tmp_path: Path) -> None:
    with pytest.raises(VoxmillError) as caught:
        read_shard(tmp_path / "nope.parquet")
    assert caught.value.code == OUTPUT_ERROR and "nope.parquet" in caught.value.message


# --------------------------------------------------------------------------- merge


def _run(tmp_path: Path, ops: tuple[str, ...] = ("tokenize", "embed")) -> list[ShardSpec]:
    """Two shards over five utterances of two speakers; 'c' fails to embed, 'e' fails everything."""
    shards = [[_utt("c", "s2"), _utt("a", "s1")], [_utt("b", "s1"), _utt("e", "s2"), _utt("d", "s2")]]
    specs = []
    for shard, utts in enumerate(shards):
        for op in ops:
            spec = ShardSpec(shard=shard, op=op, out_dir=str(tmp_path), utts=utts)
            results = [
                _failed(op, u.utt) if u.utt == "e" or (u.utt == "c" and op != "tokenize") else _ok(op, u.utt)
                for u in utts
            ]
            write_shard(RunFolder.of(tmp_path), spec, results)
            specs.append(spec)
    return specs


def test_merge_writes_typed_outputs_in_shard_order(tmp_path: Path) -> None:
    specs = _run(tmp_path)
    run = RunReport(wall_seconds=12.5, extra={"fingerprint": "f"})
    report = merge_outputs(RunFolder.of(tmp_path), specs, run).to_dict()
    tokens = pq.read_table(tmp_path / "speech_tokens.parquet")
    assert tokens.schema.names == ["utt", "speech_token", "model_sha256"]
    assert tokens.column("model_sha256").to_pylist() == [TOK["tokenizer"]["sha256"]] * 4
    assert tokens.schema.field("utt").type == pa.string()
    assert tokens.schema.field("speech_token").type == pa.list_(pa.int32())
    assert tokens.column("utt").to_pylist() == ["c", "a", "b", "d"]
    assert tokens.column("speech_token").to_pylist()[1] == _ok("tokenize", "a").speech_token

    utt_emb = pq.read_table(tmp_path / "utt_embeddings.parquet")
    assert utt_emb.schema.names == ["utt", "spk", "embedding", "model_sha256"]
    assert utt_emb.column("model_sha256").to_pylist() == [EMB["embedder"]["sha256"]] * 3
    assert utt_emb.schema.field("embedding").type == pa.list_(pa.float32())
    assert utt_emb.column("utt").to_pylist() == ["a", "b", "d"]
    assert utt_emb.column("spk").to_pylist() == ["s1", "s1", "s2"]

    spk_emb = pq.read_table(tmp_path / "spk_embeddings.parquet")
    assert spk_emb.schema.names == ["spk", "embedding", "num_utts"]
    assert spk_emb.schema.field("spk").type == pa.string()
    assert spk_emb.schema.field("embedding").type == pa.list_(pa.float32())
    assert spk_emb.schema.field("num_utts").type == pa.int64()
    assert spk_emb.column("spk").to_pylist() == ["s1", "s2"]
    assert spk_emb.column("num_utts").to_pylist() == [2, 1]
    rows = {r["utt"]: np.array(r["embedding"], dtype=np.float32) for r in utt_emb.to_pylist()}
    means = spk_emb.column("embedding").to_pylist()
    np.testing.assert_allclose(means[0], (rows["a"] + rows["b"]) / 2, rtol=1e-6)
    np.testing.assert_allclose(means[1], rows["d"], rtol=1e-6)

    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert errors == [
        {"utt": "c", "op": "embed", "code": "unreadable", "message": "c is broken"},
        {"utt": "e", "op": "tokenize", "code": "unreadable", "message": "e is broken"},
        {"utt": "e", "op": "embed", "code": "unreadable", "message": "e is broken"},
    ]

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == report
    provenance, stats = report.pop("provenance"), report.pop("stats")
    assert (
        provenance["models"] == {**TOK, **EMB}
        and provenance["frontend"]["tokenizer_features"]["n_mels"] == 128
    )
    assert stats["duration_s"]["count"] == 0  # these made-up shards hold no statistics
    assert report == {
        "utterances": 5,
        "audio_seconds": 6.0,
        "wall_seconds": 12.5,
        "ops": {"tokenize": {"ok": 4, "failed": 1}, "embed": {"ok": 3, "failed": 2}},
        "models": {**TOK, **EMB},
        "fingerprint": "f",
    }
    assert _temp_files(tmp_path) == []


def test_merge_only_writes_the_outputs_of_the_ops_that_ran(tmp_path: Path) -> None:
    report = merge_outputs(RunFolder.of(tmp_path), _run(tmp_path, ("embed",)), RunReport()).to_dict()
    assert not (tmp_path / "speech_tokens.parquet").exists()
    assert (tmp_path / "utt_embeddings.parquet").exists() and (tmp_path / "spk_embeddings.parquet").exists()
    assert list(report["ops"]) == ["embed"] and report["models"] == EMB
    assert report["wall_seconds"] == 0.0


def test_merge_extract_op_writes_tokens_and_embeddings(tmp_path: Path) -> None:
    report = merge_outputs(RunFolder.of(tmp_path), _run(tmp_path, ("extract",)), RunReport()).to_dict()
    assert pq.read_table(tmp_path / "speech_tokens.parquet").num_rows == 3
    assert pq.read_table(tmp_path / "utt_embeddings.parquet").num_rows == 3
    assert report["ops"] == {"extract": {"ok": 3, "failed": 2}}


def test_merge_streams_in_bounded_row_groups(tmp_path: Path) -> None:
    specs = _run(tmp_path)
    merge_outputs(RunFolder.of(tmp_path), specs, RunReport(), buffer_rows=1)
    tokens = pq.ParquetFile(tmp_path / "speech_tokens.parquet")
    assert tokens.metadata.num_row_groups >= 2  # flushed as it went, not held for one write
    assert tokens.read().column("utt").to_pylist() == ["c", "a", "b", "d"]


def test_merge_missing_shard_is_output_error_naming_it(tmp_path: Path) -> None:
    specs = _run(tmp_path, ("tokenize",))
    (tmp_path / RunFolder.shard_file("tokenize", 1)).unlink()
    with pytest.raises(VoxmillError) as caught:
        merge_outputs(RunFolder.of(tmp_path), specs, RunReport())
    assert caught.value.code == OUTPUT_ERROR
    assert "tokenize-000001.parquet" in caught.value.message
    assert not (tmp_path / "report.json").exists()


def test_merge_refuses_a_shard_file_from_another_plan(tmp_path: Path) -> None:
    specs = _run(tmp_path, ("tokenize",))
    stale = ShardSpec(shard=0, op="tokenize", out_dir=str(tmp_path), utts=[_utt("zz", "s9")])
    with pytest.raises(VoxmillError) as caught:
        merge_outputs(RunFolder.of(tmp_path), [stale, specs[1]], RunReport())
    assert caught.value.code == OUTPUT_ERROR and "'zz'" in caught.value.message


def test_merge_reports_mixed_models_across_shards(tmp_path: Path) -> None:
    utts = [_utt("a", "s"), _utt("b", "s"), _utt("c", "s")]
    new = {"embedder": {"file": "campplus.onnx", "sha256": "c" * 64}}
    specs = [ShardSpec(shard=i, op="embed", out_dir=str(tmp_path), utts=[u]) for i, u in enumerate(utts)]
    write_shard(RunFolder.of(tmp_path), specs[0], [_ok("embed", "a")])
    for spec in specs[1:]:
        result = _ok("embed", spec.utts[0].utt)
        write_shard(RunFolder.of(tmp_path), spec, [TaskResult.from_dict({**result.to_dict(), "models": new})])
    report = merge_outputs(RunFolder.of(tmp_path), specs, RunReport()).to_dict()
    assert report["models"] == new
    assert report["models_mixed"]["embedder"][0] == {**new["embedder"], "shards": 2}


def test_speaker_means_uses_float64_and_stores_float32() -> None:
    table = speaker_means(["s", "t", "s"], np.array([[1.0, 2.0], [0.5, 0.5], [2.0, 5.0]], dtype=np.float32))
    assert table.to_pylist() == [
        {"spk": "s", "embedding": [1.5, 3.5], "num_utts": 2},
        {"spk": "t", "embedding": [0.5, 0.5], "num_utts": 1},
    ]


def _with_stats(result: TaskResult, ratio: float, clipped: float = 0.0) -> TaskResult:
    stats = {"source_rate_hz": 16000, "source_channels": 1, "source_codec": "WAV/PCM_16", "duration_s": 1.5}
    stats |= {"speech_s": 1.5 * ratio, "speech_ratio": ratio, "rms_dbfs": -20.0, "peak_dbfs": -3.0}
    return TaskResult.from_dict({**result.to_dict(), "stats": {**stats, "clipped_fraction": clipped}})


def _stats_run(tmp_path: Path) -> list[ShardSpec]:
    utts = [_utt("a", "s1"), _utt("b", "s1"), _utt("c", "s2")]
    ratios = {"a": 0.9, "b": 0.1, "c": 0.5}
    specs = []
    for op in ("tokenize", "embed"):
        spec = ShardSpec(shard=0, op=op, out_dir=str(tmp_path), utts=utts)
        write_shard(RunFolder.of(tmp_path), spec, [_with_stats(_ok(op, u.utt), ratios[u.utt]) for u in utts])
        specs.append(spec)
    return specs


def test_merge_writes_utt_stats_their_percentiles_and_provenance_in_every_file(tmp_path: Path) -> None:
    report = merge_outputs(RunFolder.of(tmp_path), _stats_run(tmp_path), RunReport()).to_dict()
    stats = pq.read_table(tmp_path / "utt_stats.parquet")
    assert stats.schema.names[:2] == ["utt", "spk"] and "speech_ratio" in stats.schema.names
    assert stats.column("utt").to_pylist() == ["a", "b", "c"]
    assert stats.column("speech_ratio").to_pylist() == [0.9, 0.1, 0.5]
    assert stats.schema.field("source_channels").type == pa.int32()
    assert report["stats"]["speech_ratio"] == {"count": 3, "p5": 0.1, "p50": 0.5, "p95": 0.9}
    for name in (
        "speech_tokens.parquet",
        "utt_embeddings.parquet",
        "spk_embeddings.parquet",
        "utt_stats.parquet",
    ):
        metadata = pq.read_metadata(tmp_path / name).metadata
        provenance = json.loads(metadata[b"voxmill.provenance"])
        assert provenance["models"] == {**TOK, **EMB} and "voxmill" in provenance, name
        # What Arrow readers see: the Arrow schema's metadata, the same provenance.
        table = pq.read_table(tmp_path / name)
        assert json.loads(table.schema.metadata[b"voxmill.provenance"]) == provenance, name
        assert table.num_rows > 0 and table.schema.names == pq.read_schema(tmp_path / name).names


def test_a_quality_filter_leaves_utterances_out_and_lists_them_with_the_reason(tmp_path: Path) -> None:
    from pipeline.audio.quality import QualityFilter

    quality = QualityFilter(min_speech_ratio=0.3)
    folder = RunFolder.of(tmp_path)
    report = merge_outputs(folder, _stats_run(tmp_path), RunReport(), quality=quality).to_dict()
    assert pq.read_table(tmp_path / "speech_tokens.parquet").column("utt").to_pylist() == ["a", "c"]
    assert pq.read_table(tmp_path / "utt_embeddings.parquet").column("utt").to_pylist() == ["a", "c"]
    assert pq.read_table(tmp_path / "spk_embeddings.parquet").column("num_utts").to_pylist() == [1, 1]
    assert pq.read_table(tmp_path / "utt_stats.parquet").num_rows == 3  # every utterance has its statistics
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(e["utt"], e["op"], e["code"]) for e in errors] == [
        ("b", "tokenize", "filtered"),
        ("b", "embed", "filtered"),
    ]
    assert errors[0]["message"] == "speech ratio 0.1 is below --min-speech-ratio 0.3"
    assert report["ops"]["embed"] == {"ok": 2, "failed": 1}
    assert report["filters"]["min_speech_ratio"] == 0.3 and report["filters"]["filtered_utterances"] == 1


def test_a_shard_made_by_another_model_is_told_by_its_rows(tmp_path: Path) -> None:
    spec = ShardSpec(shard=0, op="extract", out_dir=str(tmp_path), utts=[_utt("a", "s"), _utt("b", "s")])
    table = writers.shard_table(spec, [_ok("extract", "a"), _failed("extract", "b")])
    found = writers.shard_sha256s(table)
    assert found == {"tokenizer": {TOK["tokenizer"]["sha256"]}, "embedder": {EMB["embedder"]["sha256"]}}
    current = {role: next(iter(shas)) for role, shas in found.items()}
    assert not writers.made_by_other_models(found, current)
    assert writers.made_by_other_models(found, {**current, "embedder": "f" * 64})
    assert not writers.made_by_other_models(found, {"tokenizer": current["tokenizer"]})  # embed not redone
    only_failures = writers.shard_table(spec, [_failed("extract", "a"), _failed("extract", "b")])
    assert writers.shard_sha256s(only_failures) == {}


def test_merge_of_a_run_whose_every_utterance_failed_writes_empty_outputs(tmp_path: Path) -> None:
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=[_utt("a", "s")])
    write_shard(RunFolder.of(tmp_path), spec, [_failed("embed", "a")])
    report = merge_outputs(RunFolder.of(tmp_path), [spec], RunReport()).to_dict()
    assert report["ops"]["embed"] == {"ok": 0, "failed": 1}
    assert pq.read_table(tmp_path / "spk_embeddings.parquet").num_rows == 0


def test_a_too_short_clips_stats_row_holds_what_is_known(tmp_path: Path) -> None:
    """A clip refused once decoded still has its rate, channels, codec, duration and levels."""
    import soundfile as sf

    from pipeline.inference import run_clip
    from pipeline.settings import AudioLimits

    clip = tmp_path / "short.flac"
    sf.write(clip, 0.5 * np.sin(np.arange(1344) / 10.0), 32000)  # 42 ms
    utt = Utterance(utt="short", path=str(clip), spk="s")
    result = run_clip("short", clip, "embed", {}, AudioLimits())  # refused before any model runs
    assert result.error is not None and result.error.code == "too_short"
    spec = ShardSpec(shard=0, op="embed", out_dir=str(tmp_path), utts=[utt])
    write_shard(RunFolder.of(tmp_path), spec, [result])
    merge_outputs(RunFolder.of(tmp_path), [spec], RunReport())
    (row,) = pq.read_table(tmp_path / "utt_stats.parquet").to_pylist()
    assert row["duration_s"] == 0.042 and row["source_rate_hz"] == 32000 and row["source_channels"] == 1
    assert row["source_codec"] == "FLAC/PCM_16" and row["peak_dbfs"] == pytest.approx(-6.02, abs=0.05)
    assert row["speech_s"] is None and row["speech_ratio"] is None


def test_an_extract_shard_run_for_both_ops_merges_as_the_two_ops_would(tmp_path: Path) -> None:
    """Both ops asked, one `extract` task per shard (each clip decoded once): the same outputs,
    the same per-op counts and failure rows as a tokenize task and an embed task per shard."""
    shards = [[_utt("a", "s1"), _utt("e", "s2")], [_utt("b", "s1"), _utt("d", "s2")]]

    def run(folder: Path, ops: tuple[str, ...]) -> list[ShardSpec]:
        specs = []
        for shard, utts in enumerate(shards):
            for op in ops:
                spec = ShardSpec(shard=shard, op=op, out_dir=str(folder), utts=utts)
                write_shard(
                    RunFolder.of(folder),
                    spec,
                    [_failed(op, u.utt) if u.utt == "e" else _ok(op, u.utt) for u in utts],
                )
                specs.append(spec)
        return specs

    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    apart = merge_outputs(RunFolder.of(two), run(two, ("tokenize", "embed")), RunReport()).to_dict()
    both = ["tokenize", "embed"]
    together = merge_outputs(RunFolder.of(one), run(one, ("extract",)), RunReport(), ops=both).to_dict()
    assert (
        together["ops"]
        == apart["ops"]
        == {"tokenize": {"ok": 3, "failed": 1}, "embed": {"ok": 3, "failed": 1}}
    )
    for name in ("speech_tokens.parquet", "utt_embeddings.parquet", "spk_embeddings.parquet"):
        assert pq.read_table(one / name).equals(pq.read_table(two / name)), name
    assert (one / "errors.jsonl").read_text() == (two / "errors.jsonl").read_text()
    assert together["models"] == apart["models"] and "models_mixed" not in together


def test_a_shard_file_has_no_dictionary_for_embeddings_and_keeps_one_for_names(tmp_path: Path) -> None:
    utts = [_utt(f"u{n}", "s") for n in range(20)]
    spec = ShardSpec(shard=0, op="extract", out_dir=str(tmp_path), utts=utts)
    path = write_shard(RunFolder.of(tmp_path), spec, [_ok("extract", u.utt) for u in utts])
    group = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {group.column(i).path_in_schema: group.column(i).encodings for i in range(group.num_columns)}
    assert not any("DICTIONARY" in e for e in encodings["embedding.list.element"])
    assert any("DICTIONARY" in e for e in encodings["utt"])
    assert any("DICTIONARY" in e for e in encodings["speech_token.list.element"])
    first = read_shard(path).column("embedding").to_pylist()[0]
    assert first == pytest.approx(_ok("extract", "u0").embedding)
