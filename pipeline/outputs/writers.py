"""Shard files of `voxmill extract` and the schemas of its outputs, every file written atomically.

A shard file (`RunFolder.shard_file`: `shards/{op}-{shard:06d}.parquet`) holds one row per
utterance of its `ShardSpec`, in the spec's order: `utt`, `spk` (string), `audio_seconds` (float64,
null on error), `speech_token` (list<int32>), `embedding` (list<float32>; both null when failed or
when the op has no such output), `error_code`, `error_message` (string, null on success). The
schema metadata key `voxmill.models` holds the models used as JSON `{role: {"file", "sha256"}}`.
Wave 2 columns, all nullable: the clip's quality statistics (`pipeline.audio.quality.STAT_FIELDS`:
`source_rate_hz`, `source_channels` int32, `source_codec` string, `duration_s`, `speech_s`,
`speech_ratio`, `rms_dbfs`, `peak_dbfs`, `clipped_fraction` float64; present for every decoded
clip, `no_speech` ones too), and `tokenizer_sha256`, `embedder_sha256` (string): the sha256 of
the model that produced the row's tokens / embedding (null when the row has none), so a run
spanning a hot reload can be split exactly.

Every file is written to `.{name}.tmp-{pid}-{random}` in its own folder, fsynced and renamed over
the final name (`pipeline.storage.locations.atomic_file`), so a file is complete or absent and a
redelivered shard simply overwrites identical data. An output folder in an object store (`--out
s3://bucket/run`, `pipeline.storage.locations.ObjectFolder`) gets each file as one PUT of the
whole object, which is complete or absent in the same way. A tar shard's file lists what the tar
held, in the tar's order. `pipeline.outputs.merge.merge_outputs` reads the shard files of a plan
and writes the contract's outputs (DESIGN.md, "Output of extract"), each utterance exactly once
per op.

A shard file always holds its rows: a result whose row the file cannot hold (a token outside
int32, a non-finite embedding value, a statistic of the wrong type: `row_problem`) is stored as
an `output_error` of its utterance, and should the rows still not make a table, the file holds
every utterance failed with the reason (`failed_shard_table`). Only writing the file can fail.
A shard the driver gave up on (`pipeline.run.driver`: sent `shard_max_attempts` times without
its file) gets its given-up file (`RunFolder.given_up_file`) instead, every utterance failed with
why: the merge takes it for the shard, and a resume counts the shard done.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.audio.quality import STAT_FIELDS
from pipeline.errors import INTERNAL, NOT_FOUND, OUTPUT_ERROR, ErrorRecord, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.records import ROLE_EMBEDDER, ROLE_TOKENIZER, ShardSpec, TaskResult, Utterance, encodable
from pipeline.storage.locations import OutputLocation, atomic_write
from pipeline.storage.objects import read_url
from pipeline.storage.urls import is_url

MODELS_METADATA_KEY = b"voxmill.models"
TOKEN_OPS = frozenset({"tokenize", "extract"})
EMBEDDING_OPS = frozenset({"embed", "extract"})

SHARD_SCHEMA = pa.schema(
    [
        ("utt", pa.string()),
        ("spk", pa.string()),
        ("audio_seconds", pa.float64()),
        ("speech_token", pa.list_(pa.int32())),
        ("embedding", pa.list_(pa.float32())),
        ("error_code", pa.string()),
        ("error_message", pa.string()),
        ("source_rate_hz", pa.int32()),
        ("source_channels", pa.int32()),
        ("source_codec", pa.string()),
        ("duration_s", pa.float64()),
        ("speech_s", pa.float64()),
        ("speech_ratio", pa.float64()),
        ("rms_dbfs", pa.float64()),
        ("peak_dbfs", pa.float64()),
        ("clipped_fraction", pa.float64()),
        ("tokenizer_sha256", pa.string()),
        ("embedder_sha256", pa.string()),
    ]
)
STAT_COLUMNS: tuple[str, ...] = STAT_FIELDS
INT32_RANGE = (-(2**31), 2**31 - 1)
FLOAT32_MAX = float(np.finfo(np.float32).max)
SHA256_COLUMNS = {ROLE_TOKENIZER: "tokenizer_sha256", ROLE_EMBEDDER: "embedder_sha256"}
# The outputs' row of the model that made it (`model_sha256`): a run spanning a hot reload splits exactly.
SPEECH_TOKENS_SCHEMA = pa.schema(
    [("utt", pa.string()), ("speech_token", pa.list_(pa.int32())), ("model_sha256", pa.string())]
)
UTT_EMBEDDINGS_SCHEMA = pa.schema(
    [
        ("utt", pa.string()),
        ("spk", pa.string()),
        ("embedding", pa.list_(pa.float32())),
        ("model_sha256", pa.string()),
    ]
)
UTT_STATS_SCHEMA = pa.schema(
    [("utt", pa.string()), ("spk", pa.string()), *(SHARD_SCHEMA.field(n) for n in STAT_FIELDS)]
)
# Key of every output file's Parquet key-value metadata: what produced it (`pipeline.outputs.merge`).
PROVENANCE_METADATA_KEY = "voxmill.provenance"
SPK_EMBEDDINGS_SCHEMA = pa.schema(
    [("spk", pa.string()), ("embedding", pa.list_(pa.float32())), ("num_utts", pa.int64())]
)

Models = dict[str, dict[str, str]]


# --------------------------------------------------------------------------- whole files


def write_parquet(path: Path, table: pa.Table) -> None:
    """Write a table as one parquet file, atomically."""
    dictionary = dictionary_columns(table.schema)
    atomic_write(path, lambda stream: pq.write_table(table, stream, use_dictionary=dictionary))


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text, atomically."""
    atomic_write(path, lambda stream: stream.write(text.encode("utf-8")))


def write_table_at(out: OutputLocation, name: str, table: pa.Table) -> None:
    """Write a table as one parquet file `name` of an output location, complete or absent."""
    with out.writer(name) as stream:
        pq.write_table(table, stream, use_dictionary=dictionary_columns(table.schema))


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns worth a dictionary in a parquet file: all but floats and lists of floats, whose
    values hardly repeat (an embedding's dictionary is built, then dropped: more work than
    writing the column plain, BENCHMARKS.md)."""
    columns = []
    for field in schema:
        kind, path = field.type, field.name
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):  # named by its leaf, as Parquet does
            kind, path = kind.value_type, f"{path}.list.element"
        if not pa.types.is_floating(kind):
            columns.append(path)
    return columns


def write_text_at(out: OutputLocation, name: str, text: str) -> None:
    """Write UTF-8 text as `name` of an output location, complete or absent."""
    with out.writer(name) as stream:
        stream.write(text.encode("utf-8"))


# --------------------------------------------------------------------------- shard files


def write_shard(
    out_dir: RunFolder,
    spec: ShardSpec,
    results: list[TaskResult],
    utts: Sequence[Utterance] | None = None,
) -> Path | str:
    """Write the shard file of `spec` (`results[i]` belongs to `spec.utts[i]`, or to `utts[i]`
    for a tar shard, whose utterances are what the tar held); returns its path or URL.

    A result the file cannot hold is stored as an `output_error` of its utterance
    (`storable_results`), and the table made of them (`shard_file_table`).
    `VoxmillError("output_error")` only when the file cannot be written (left to a later attempt).
    """
    stored = storable_results(spec.op, results, spec.utts if utts is None else utts)
    name = out_dir.shard_file(spec.op, spec.shard)
    write_table_at(out_dir.location, name, shard_file_table(spec, stored, utts))
    return out_dir.ref(name)


def shard_file_table(
    spec: ShardSpec, stored: list[TaskResult], utts: Sequence[Utterance] | None = None
) -> pa.Table:
    """The table of `spec`'s shard file from results as `storable_results` gives them; should the
    rows still not make a table, every utterance is stored failed with the reason."""
    rows = spec.utts if utts is None else utts
    try:
        return shard_table(spec, stored, rows)
    except Exception as exc:  # noqa: BLE001 - what `row_problem` missed: the rows fail, not the shard
        reason = f"the shard's rows cannot be stored ({type(exc).__name__}: {_short(str(exc))})"
        return failed_shard_table(spec, rows, OUTPUT_ERROR, reason)


def write_given_up_shard(out_dir: RunFolder, spec: ShardSpec, code: str, message: str) -> Path | str:
    """Write the file of a shard given up on (`RunFolder.given_up_file`): each utterance of `spec`
    failed with `code` and `message` (a tar shard, whose utterances no file names: one row, the
    tar). Returns its path or URL; `VoxmillError("output_error")` when it cannot be written."""
    rows = spec.utts or [Utterance(spec.tar, spec.tar)]
    name = out_dir.given_up_file(spec.op, spec.shard)
    write_table_at(out_dir.location, name, failed_shard_table(spec, rows, code, message))
    return out_dir.ref(name)


def failed_shard_table(spec: ShardSpec, utts: Sequence[Utterance], code: str, message: str) -> pa.Table:
    """A shard table of `utts` whose every row failed with `code` and `message`."""
    results = [TaskResult(input=u.utt, op=spec.op, error=ErrorRecord(code, message)) for u in utts]
    return shard_table(spec, results, utts)


def storable_results(op: str, results: Sequence[TaskResult], utts: Sequence[Utterance]) -> list[TaskResult]:
    """`results`, each one whose row the shard file cannot hold (`row_problem`) made an
    `output_error` of its utterance that says why (and its statistics dropped if they are the
    cause); `internal` when there is not one result per utterance."""
    if len(results) != len(utts):
        raise VoxmillError(INTERNAL, f"{len(results)} results for {len(utts)} utterances")
    stored = []
    for utt, result in zip(utts, results, strict=True):
        wrong = row_problem(op, result, utt)
        if wrong is None:
            stored.append(result)
            continue
        stats = result.stats if result.stats is None or _stats_problem(result.stats) is None else None
        error = ErrorRecord(OUTPUT_ERROR, f"its result cannot be stored: {wrong}")
        failed = replace(result, speech_token=None, embedding=None, audio_seconds=None, stats=stats)
        stored.append(replace(failed, error=error))
    return stored


def row_problem(op: str, result: TaskResult, utt: Utterance) -> str | None:
    """Why the shard file cannot hold `result` as the row of `utt`, or None: names that are not
    valid Unicode, an error that is not two strings, tokens that are not int32 integers, an
    embedding that is not finite float32 numbers, audio seconds or statistics out of their
    columns' range or type."""
    for what, text in (("utt", utt.utt), ("spk", utt.spk)):
        if not encodable(text):
            return f"its {what} is not valid Unicode (stored escaped)"
    error = result.error
    if error is not None:
        if not (isinstance(error.code, str) and isinstance(error.message, str)):
            return "its error is not a code and a message"
        return _stats_problem(result.stats) if result.stats is not None else None
    if op in TOKEN_OPS and (wrong := _tokens_problem(result.speech_token)):
        return wrong
    if op in EMBEDDING_OPS and (wrong := _embedding_problem(result.embedding)):
        return wrong
    seconds = result.audio_seconds
    if seconds is not None and not (_is_number(seconds) and math.isfinite(seconds) and seconds >= 0):
        return f"audio seconds {seconds!r} is not a finite number >= 0"
    for role, ref in result.models.items():
        if not isinstance(ref.sha256, str):
            return f"its {role} model has no sha256"
    return _stats_problem(result.stats) if result.stats is not None else None


def _tokens_problem(tokens: Any) -> str | None:
    if not isinstance(tokens, (list, tuple, np.ndarray)):
        return f"the speech tokens are {type(tokens).__name__}, not a list"
    if len(tokens) == 0:
        return None
    values = np.asarray(tokens)
    if values.ndim != 1 or values.dtype.kind not in "iub":
        return "a speech token is not an integer"
    low, high = int(values.min()), int(values.max())
    if low < INT32_RANGE[0] or high > INT32_RANGE[1]:
        return f"a speech token ({low if low < INT32_RANGE[0] else high}) is out of the int32 range"
    return None


def _embedding_problem(embedding: Any) -> str | None:
    if not isinstance(embedding, (list, tuple, np.ndarray)) or len(embedding) == 0:
        return "the embedding is not a list of numbers"
    found = np.asarray(embedding)
    if found.ndim != 1 or found.dtype.kind not in "iuf":
        return "an embedding value is not a number"
    wide = found.dtype != np.float32  # a model's own float32: finite is within range
    values = found.astype(np.float64) if wide else found
    if not bool(np.isfinite(values).all()):
        return "the embedding holds a non-finite value (NaN or infinity)"
    if wide and float(np.abs(values).max()) > FLOAT32_MAX:
        return "an embedding value is beyond the float32 range"
    return None


def _stats_problem(stats: Any) -> str | None:
    """Why a clip's quality statistics do not fit their columns, or None."""
    if not isinstance(stats, dict):
        return "its statistics are not a mapping"
    for name, kind in _stat_kinds().items():
        value = stats.get(name)
        if value is None:
            continue
        if kind == "text":
            ok = encodable(value)
        elif kind == "integer":
            ok = _is_integer(value) and INT32_RANGE[0] <= value <= INT32_RANGE[1]
        else:
            ok = _is_number(value) and math.isfinite(value)
        if not ok:
            return f"statistic {name} is {_short(repr(value), 40)}"
    return None


@functools.cache
def _stat_kinds() -> dict[str, str]:
    """Each statistic column's kind in the shard file ("text", "integer" or "number"), read from
    the schema once: a shard checks every row's."""
    kinds = {}
    for name in STAT_COLUMNS:
        column = SHARD_SCHEMA.field(name).type
        kind = "integer" if pa.types.is_integer(column) else "number"
        kinds[name] = "text" if pa.types.is_string(column) else kind
    return kinds


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return _is_integer(value) or isinstance(value, (float, np.floating))


def _storable_text(text: str) -> str:
    """`text`, its lone surrogates (a tar member name that was not UTF-8) written as escapes."""
    return text if encodable(text) else str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _short(text: str, width: int = 200) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def shard_table(
    spec: ShardSpec, results: Sequence[TaskResult], utts: Sequence[Utterance] | None = None
) -> pa.Table:
    """The shard's rows as a table of `SHARD_SCHEMA`, the models in the schema metadata."""
    tokens = spec.op in TOKEN_OPS
    embeds = spec.op in EMBEDDING_OPS
    columns: dict[str, list[Any]] = {name: [] for name in SHARD_SCHEMA.names}
    for utt, result in zip(spec.utts if utts is None else utts, results, strict=True):
        error = result.error
        columns["utt"].append(_storable_text(utt.utt))
        columns["spk"].append(_storable_text(utt.spk))
        columns["audio_seconds"].append(None if error else result.audio_seconds)
        columns["speech_token"].append(result.speech_token if tokens and not error else None)
        columns["embedding"].append(result.embedding if embeds and not error else None)
        columns["error_code"].append(_storable_text(error.code) if error else None)
        columns["error_message"].append(_storable_text(error.message) if error else None)
        stats = result.stats or {}
        for name in STAT_COLUMNS:
            columns[name].append(stats.get(name))
        for role, column in SHA256_COLUMNS.items():
            produced = tokens if role == ROLE_TOKENIZER else embeds
            columns[column].append(_sha256_of(result, role) if produced and not error else None)
    metadata = {MODELS_METADATA_KEY: json.dumps(_models_of(results), sort_keys=True).encode()}
    return pa.Table.from_pydict(columns, schema=SHARD_SCHEMA.with_metadata(metadata))


def _sha256_of(result: TaskResult, role: str) -> str | None:
    ref = result.models.get(role)
    return ref.sha256 if ref else None


def _models_of(results: Iterable[TaskResult]) -> Models:
    """{role: {"file", "sha256", "provider", "onnxruntime"}} of the successful results (the first
    model seen per role; what ran it, when the result says). A batch file, when any row came from
    one, is named instead of its single-clip twin: its `twin_sha256` names both."""
    models: Models = {}
    for result in results:
        if result.error is None:
            for role, ref in result.models.items():
                if role not in models or (ref.twin_sha256 and "twin_sha256" not in models[role]):
                    models[role] = ref.to_dict()
    return models


def read_shard(path: Path | str, columns: Sequence[str] | None = None, data: bytes | None = None) -> pa.Table:
    """Read a shard file (a path or URL; `data`: its bytes, already read), all its columns or
    `columns`; a missing or unreadable one is `VoxmillError("output_error")`."""
    try:
        remote = isinstance(path, str) and is_url(path)
        if data is None and remote:
            data = read_url(str(path))
        source = path if data is None else pa.BufferReader(data)
        with pq.ParquetFile(source) as file:  # not read_table: its dataset layer costs as much as the read
            return file.read(columns=None if columns is None else list(columns))
    except VoxmillError as exc:
        what = "is missing" if exc.code == NOT_FOUND else f"cannot be read: {exc.message}"
        raise VoxmillError(OUTPUT_ERROR, f"shard file {path} {what}") from exc
    except FileNotFoundError as exc:
        raise VoxmillError(OUTPUT_ERROR, f"shard file {path} is missing") from exc
    except (OSError, pa.ArrowException) as exc:
        raise VoxmillError(OUTPUT_ERROR, f"shard file {path} cannot be read: {exc}") from exc


def shard_models(table: pa.Table) -> Models:
    """The models recorded in a shard table's schema metadata ({} when none)."""
    raw = (table.schema.metadata or {}).get(MODELS_METADATA_KEY)
    if not raw:
        return {}
    models: Models = json.loads(raw)
    return models


def shard_sha256s(table: pa.Table) -> dict[str, set[str]]:
    """{role: the models its rows name} of a shard table (roles with no row left out), a batch
    file's rows counted as its single-clip twin (the model, whichever of its files ran)."""
    models = shard_models(table).values()
    twins = {ref["sha256"]: ref["twin_sha256"] for ref in models if ref.get("twin_sha256")}
    found = {
        role: {twins.get(sha, sha) for sha in table.column(name).drop_null().to_pylist()}
        for role, name in SHA256_COLUMNS.items()
    }
    return {role: shas for role, shas in found.items() if shas}


def made_by_other_models(found: dict[str, set[str]], current: dict[str, str]) -> bool:
    """A shard some of whose rows another model than the `current` one ({role: sha256}) made."""
    return any(role in current and shas - {current[role]} for role, shas in found.items())


def shard_counts(path: Path | str) -> tuple[int, int]:
    """(ok, failed) row counts of a shard file."""
    ok, failed, _ = shard_tally(path)
    return ok, failed


def shard_tally(path: Path | str) -> tuple[int, int, float]:
    """(ok, failed, audio seconds) of a shard file: what its task announced (the audio of the rows
    that succeeded, as the merge counts it), for a shard whose announcement was not heard."""
    table = read_shard(path, ["error_code", "audio_seconds"])  # not the tokens and embeddings
    codes = table.column("error_code")
    seconds = pc.sum(table.column("audio_seconds")).as_py() or 0.0
    return codes.null_count, len(codes) - codes.null_count, round(float(seconds), 4)
