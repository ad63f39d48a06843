"""The merge's reads of shard files (`pipeline.outputs.merge`): which ones are read ahead and in
what windows, a local folder merged as always; and the corpus driver's looks at a store's shard
files (`pipeline.run.driver`: a HEAD for the shards that announced, a sweep of the others now
and then). The merge read ahead from a real S3 API: tests/integration/test_object_storage.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.errors import OUTPUT_ERROR, ErrorRecord, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.merge import merge_outputs, reads_ahead, windows
from pipeline.outputs.report import RunReport
from pipeline.outputs.writers import write_given_up_shard, write_shard
from pipeline.records import ShardSpec, TaskResult, Utterance, models_from_dict
from pipeline.run.ledger import shards_to_look_at, sweep_due
from pipeline.storage.prefetch import ReadAhead

OPS = ("tokenize", "embed")
MODELS = {
    "tokenizer": {"file": "speech_tokenizer_v2.onnx", "sha256": "a" * 64},
    "embedder": {"file": "campplus.onnx", "sha256": "b" * 64},
}
OUTPUTS = (
    "speech_tokens.parquet",
    "utt_embeddings.parquet",
    "spk_embeddings.parquet",
    "utt_stats.parquet",
    "errors.jsonl",
    "report.json",
)


def _result(op: str, utt: str) -> TaskResult:
    """Every seventh utterance fails; the others get tokens or an embedding drawn from the name."""
    seed = sum(map(ord, utt))
    if seed % 7 == 0:
        return TaskResult(input=utt, op=op, error=ErrorRecord("unreadable", f"{utt} is broken"))
    tokens = [seed % 4096, (seed * 7) % 4096] if op == "tokenize" else None
    embedding = [float(seed % 10) / 8, -0.25, 1e-3] if op == "embed" else None
    role = "tokenizer" if tokens else "embedder"
    models = models_from_dict({role: MODELS[role]})
    return TaskResult(
        input=utt, op=op, speech_token=tokens, embedding=embedding, audio_seconds=1.25, models=models
    )


def write_run(folder: RunFolder, shards: int, per_shard: int = 5, given_up: int = 2) -> list[ShardSpec]:
    """`shards` shards of `per_shard` utterances of three speakers, each op's file of each, in
    plan order; shard `given_up`'s embed file is a given-up one. The specs, as a plan lists them."""
    specs = []
    for shard in range(shards):
        names = [f"u{shard:03d}-{k}" for k in range(per_shard)]
        utts = [Utterance(name, f"/d/{name}.wav", f"s{k % 3}") for k, name in enumerate(names)]
        for op in OPS:
            spec = ShardSpec(shard=shard, op=op, out_dir=folder.name, utts=utts)
            if shard == given_up and op == "embed":
                write_given_up_shard(folder, spec, OUTPUT_ERROR, "sent 4 times without its file")
            else:
                write_shard(folder, spec, [_result(op, name) for name in names])
            specs.append(spec)
    return specs


def output_bytes(read: Callable[[str], bytes]) -> dict[str, bytes]:
    """The outputs' bytes, by name (`read(name)`: the bytes of the output folder's file)."""
    return {name: read(name) for name in OUTPUTS}


# --------------------------------------------------------------------------- what is read ahead


def test_only_a_store_with_more_than_one_read_in_flight_reads_ahead() -> None:
    assert reads_ahead(local=False, read_ahead=ReadAhead(in_flight=8))
    assert not reads_ahead(local=True, read_ahead=ReadAhead(in_flight=8))  # no pool for a folder
    assert not reads_ahead(local=False, read_ahead=ReadAhead(in_flight=1))
    assert not reads_ahead(local=False, read_ahead=None)


def _shards(sizes: list[int]) -> list[list[ShardSpec]]:
    """A shard per size: its specs for both ops, over `size` utterances."""
    shards = []
    for shard, size in enumerate(sizes):
        utts = [Utterance(f"u{shard}-{k}", f"/d/{shard}-{k}.wav") for k in range(size)]
        shards.append([ShardSpec(shard=shard, op=op, out_dir="o", utts=utts) for op in OPS])
    return shards


def test_windows_keep_plan_order_within_files_and_rows() -> None:
    shards = _shards([3, 3, 3, 3, 3])
    by_files = list(windows(shards, max_rows=100, max_files=4))  # two shards of two files each
    assert [[s[0].shard for s in w] for w in by_files] == [[0, 1], [2, 3], [4]]
    by_rows = list(windows(shards, max_rows=7, max_files=100))
    assert [[s[0].shard for s in w] for w in by_rows] == [[0, 1], [2, 3], [4]]
    assert [s for w in by_rows for s in w] == shards


def test_a_shard_larger_than_a_window_is_a_window_of_its_own() -> None:
    shards = _shards([2, 50, 2])
    assert [[s[0].shard for s in w] for w in windows(shards, max_rows=10, max_files=100)] == [[0], [1], [2]]
    tars = [[ShardSpec(shard=n, op="embed", out_dir="o", tar=f"t{n}.tar")] for n in range(5)]
    assert [len(w) for w in windows(tars, max_rows=1, max_files=2)] == [2, 2, 1]  # no rows planned


# --------------------------------------------------------------------------- a local folder


def test_a_local_folder_merges_the_same_bytes_with_read_ahead_given(tmp_path: Path) -> None:
    folder = RunFolder.of(tmp_path)
    specs = write_run(folder, shards=6)
    merged = []
    for read_ahead in (None, ReadAhead(in_flight=4, budget_bytes=1)):
        merge_outputs(folder, specs, RunReport(), buffer_rows=7, read_ahead=read_ahead)
        merged.append(output_bytes(lambda name: (tmp_path / name).read_bytes()))
    assert merged[0] == merged[1]


def test_a_missing_local_shard_file_says_what_it_always_said(tmp_path: Path) -> None:
    folder = RunFolder.of(tmp_path)
    specs = write_run(folder, shards=4)
    (tmp_path / RunFolder.shard_file("tokenize", 1)).unlink()
    with pytest.raises(VoxmillError) as caught:
        merge_outputs(folder, specs, RunReport(), read_ahead=ReadAhead(in_flight=4))
    missing = tmp_path / RunFolder.shard_file("tokenize", 1)
    assert caught.value.code == OUTPUT_ERROR
    assert caught.value.message == f"shard file {missing} is missing"
    assert not (tmp_path / "report.json").exists()


# --------------------------------------------------------------------------- the driver's looks


def test_a_store_round_looks_only_at_the_announced_shards_until_a_sweep_is_due() -> None:
    names = [f"embed-{n:06d}" for n in range(6)]
    announced = {"embed-000004"}
    looked, cursor = shards_to_look_at(names, announced, False, 3, 2, sweep=False)
    assert (looked, cursor) == (["embed-000004"], 2)  # a HEAD per announced shard, the cursor kept
    assert shards_to_look_at(names, set(), False, 3, 2, sweep=False) == ([], 2)
    swept, cursor = shards_to_look_at(names, announced, False, 3, 2, sweep=True)
    assert swept == ["embed-000004", "embed-000002", "embed-000003", "embed-000005"] and cursor == 0
    assert shards_to_look_at(names, set(), True, 3, 0, sweep=False) == (names, 0)  # a folder: all


def test_a_sweep_is_due_once_per_interval() -> None:
    assert not sweep_due(now=104.9, swept_at=100.0, every_s=5.0)
    assert sweep_due(now=105.0, swept_at=100.0, every_s=5.0)
