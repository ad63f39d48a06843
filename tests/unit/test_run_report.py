"""report.json as one typed record: the JSON the merge writes reads back to the same record,
older files without the optional keys read, and keys a caller added are kept."""

from __future__ import annotations

from pipeline.outputs.report import MixedModel, OpCounts, RunReport
from pipeline.records import ModelRef

OLD, NEW = "a" * 64, "b" * 64


def test_a_report_reads_back_as_written() -> None:
    embedder = ModelRef("embedder", "campplus.onnx", NEW, "CPUExecutionProvider", "1.32.0")
    report = RunReport(
        utterances=3,
        audio_seconds=7.5,
        wall_seconds=1.25,
        ops={"embed": OpCounts(ok=2, failed=1)},
        models={"embedder": embedder},
        models_mixed={
            "embedder": [MixedModel(embedder, 3), MixedModel(ModelRef("embedder", "c.onnx", OLD), 1)]
        },
        filters={"min_speech_ratio": 0.5, "filtered_utterances": 1},
        resubmitted_shards=0,
        plan_fingerprint="f",
        extra={"input": "corpus/wav.scp"},
    )
    written = report.to_dict()
    assert written["ops"] == {"embed": {"ok": 2, "failed": 1}}
    assert written["models"]["embedder"]["provider"] == "CPUExecutionProvider"
    assert written["models_mixed"]["embedder"][1] == {"file": "c.onnx", "sha256": OLD, "shards": 1}
    assert "given_up_shards" not in written and written["input"] == "corpus/wav.scp"
    assert RunReport.from_dict(written) == report
    assert report.sha256s() == {"embedder": {NEW, OLD}} and report.filtered_utterances == 1


def test_an_older_report_without_the_optional_keys_reads() -> None:
    older = {"utterances": 2, "audio_seconds": 3.0, "wall_seconds": 0.5, "ops": {"tokenize": {"ok": 2}}}
    report = RunReport.from_dict({**older, "models": {}, "workers": 2})
    assert report.ops == {"tokenize": OpCounts(ok=2, failed=0)} and report.filters is None
    assert report.models_mixed == {} and report.remerge_wall_seconds is None
    assert report.extra == {"workers": 2} and report.to_dict()["workers"] == 2
