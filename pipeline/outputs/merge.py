"""Merging a run's shard files into the outputs of `voxmill extract` (DESIGN.md, "Output of
extract"): `speech_tokens.parquet`, `utt_embeddings.parquet`, `spk_embeddings.parquet`,
`errors.jsonl` and `report.json`, each written under a temporary name and renamed.

The merge streams: it takes the plan's shards in order (every op's file of shard k, then k + 1),
writes the feature files row group by row group (`buffer_rows` rows at a time) and the errors
line by line, and keeps per speaker a running sum of its embeddings, so its memory depends on
`buffer_rows` and the number of speakers, not on the size of the corpus. Rows follow the plan,
which is the listing's order; a plan puts each utterance in one shard, so each (utt, op) is
counted once. `report.json` is written last: once it exists, the outputs are whole. From an
object store, the shard files are read ahead, a bounded number at once, and taken in plan order
(`_read_shards`): the same bytes and errors as reading them one after another, without a round
trip per file in series.

The output folder may be a local folder or a prefix in an object store
(`pipeline.storage.locations.OutputLocation`): each output is written whole to a temporary name (or
spooled locally and PUT as one object), so it is complete or absent either way. A tar shard's
utterances are the rows of its file (what the tar held, in the tar's order); each op's file of
one tar must list the same rows.

A shard the driver gave up on has a given-up file (`pipeline.outputs.folder.RunFolder.given_up_file`) whose
every row failed: it stands for the shard (even beside a shard file a late attempt wrote after),
so its utterances are counted failed and listed in errors.jsonl. A given-up tar shard, whose
utterances no file named, is the tar's one row, or the rows another op's file of it holds.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import tempfile
from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.audio.quality import STAT_FIELDS, QualityFilter
from pipeline.errors import FILTERED, OUTPUT_ERROR, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.report import RunReport
from pipeline.outputs.tally import SpeakerSums, Tally
from pipeline.outputs.writers import (
    EMBEDDING_OPS,
    PROVENANCE_METADATA_KEY,
    SHA256_COLUMNS,
    SPEECH_TOKENS_SCHEMA,
    TOKEN_OPS,
    UTT_EMBEDDINGS_SCHEMA,
    UTT_STATS_SCHEMA,
    dictionary_columns,
    failed_shard_table,
    read_shard,
    write_table_at,
    write_text_at,
)
from pipeline.records import OPS, ROLE_EMBEDDER, ROLE_TOKENIZER, ShardSpec, Utterance
from pipeline.storage.locations import LocalFolder, ObjectFolder, OutputLocation
from pipeline.storage.objects import Reserve
from pipeline.storage.prefetch import ReadAhead, prefetch

DEFAULT_BUFFER_ROWS = 65536
# Shard files read ahead together at most: the reads drain between two windows (one round trip
# lost per window), and the plan's specs of a window are held meanwhile.
WINDOW_FILES = 256
ARROW_SCHEMA_KEY = "ARROW:schema"  # where Arrow keeps a Parquet file's Arrow schema


class _TableSink:
    """One output parquet file, written row group by row group into its temporary file."""

    def __init__(
        self, stack: contextlib.ExitStack, out: OutputLocation, name: str, schema: pa.Schema, buffer_rows: int
    ) -> None:
        self.schema = schema
        self.buffer_rows = buffer_rows
        stream = stack.enter_context(out.writer(name))
        self._writer = pq.ParquetWriter(stream, schema, use_dictionary=dictionary_columns(schema))
        self._pending: list[pa.Table] = []
        self._rows = 0
        self._closed = False
        stack.callback(self._close_writer)  # runs before the temporary file is kept or removed

    def add(self, table: pa.Table) -> None:
        if table.num_rows:
            self._pending.append(table.cast(self.schema))
            self._rows += table.num_rows
        if self._rows >= self.buffer_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_table(pa.concat_tables(self._pending))
        self._pending, self._rows = [], 0

    def close(self, metadata: dict[str, str] | None = None) -> None:
        """Write what is left, `metadata` and the footer; the rename follows when the whole merge
        succeeds.

        `metadata` goes into the file's Parquet key-value metadata and into its Arrow schema's
        metadata, which is what `pq.read_table` and the tools built on Arrow show. The schema was fixed
        when the writer opened, before the shards named the models; Arrow keeps a file's schema as
        `ARROW:schema` (the IPC-serialized schema, base64), so the footer gets the bytes a writer
        opened with the schema and its metadata would have written.
        """
        self._flush()
        if metadata:
            schema = self.schema.with_metadata({**(self.schema.metadata or {}), **metadata})
            arrow_schema = base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")
            self._writer.add_key_value_metadata({**metadata, ARROW_SCHEMA_KEY: arrow_schema})
        self._close_writer()

    def _close_writer(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()


class _Outputs:
    """The files one merge writes, opened once the first shard says which ops ran."""

    def __init__(self, out: OutputLocation, stack: contextlib.ExitStack, buffer_rows: int) -> None:
        self.out = out
        self.stack = stack
        self.buffer_rows = buffer_rows
        self.errors = io.TextIOWrapper(stack.enter_context(out.writer(RunFolder.ERRORS)), encoding="utf-8")
        self.tokens: _TableSink | None = None
        self.embeddings: _TableSink | None = None
        self.stats = _TableSink(stack, out, RunFolder.UTT_STATS, UTT_STATS_SCHEMA, buffer_rows)
        self.token_op = self.embed_op = ""
        self.speakers = SpeakerSums()

    def open_for(self, ops: Sequence[str]) -> None:
        """The first op (in canonical order) that makes tokens writes the token file; likewise embeddings."""
        if self.token_op or self.embed_op:
            return
        self.token_op = next((op for op in ops if op in TOKEN_OPS), "")
        self.embed_op = next((op for op in ops if op in EMBEDDING_OPS), "")
        if self.token_op:
            self.tokens = _TableSink(
                self.stack, self.out, RunFolder.SPEECH_TOKENS, SPEECH_TOKENS_SCHEMA, self.buffer_rows
            )
        if self.embed_op:
            self.embeddings = _TableSink(
                self.stack, self.out, RunFolder.UTT_EMBEDDINGS, UTT_EMBEDDINGS_SCHEMA, self.buffer_rows
            )

    def add(self, op: str, ok: pa.Table) -> None:
        """The rows of one op's shard file that go into the outputs, each with its model's sha256."""
        if op == self.token_op and self.tokens is not None:
            rows = ok.select(["utt", "speech_token", SHA256_COLUMNS[ROLE_TOKENIZER]])
            self.tokens.add(rows.rename_columns(SPEECH_TOKENS_SCHEMA.names))
        if op == self.embed_op and self.embeddings is not None:
            rows = ok.select(["utt", "spk", "embedding", SHA256_COLUMNS[ROLE_EMBEDDER]])
            self.embeddings.add(rows.rename_columns(UTT_EMBEDDINGS_SCHEMA.names))
            self.speakers.add(rows.column("spk").to_pylist(), _matrix(rows.column("embedding")))

    def close(self, provenance: dict[str, Any]) -> None:
        metadata = {PROVENANCE_METADATA_KEY: json.dumps(provenance, sort_keys=True)}
        for sink in (self.tokens, self.embeddings, self.stats):
            if sink is not None:
                sink.close(metadata)
        self.errors.flush()
        self.errors.detach()  # the binary stream is committed by the stack


def merge_outputs(
    out_dir: RunFolder,
    specs: Iterable[ShardSpec],
    report: RunReport,
    buffer_rows: int = DEFAULT_BUFFER_ROWS,
    quality: QualityFilter | None = None,
    ops: Sequence[str] | None = None,
    read_ahead: ReadAhead | None = None,
    given_up: set[str] | None = None,
    kept: dict[str, bytes] | None = None,
) -> RunReport:
    """Merge the shard files of `specs` (the plan's, in shard order) into the outputs; `report`
    (the run's own numbers set by the caller) filled in and written as `report.json`.

    `ops`: what the run was asked for, when its tasks ran them together: an `extract` shard file
    then counts, and lists its failures, for each of them (`tokenize` and `embed`).

    Writes `speech_tokens.parquet` (ops tokenize/extract), `utt_embeddings.parquet` and
    `spk_embeddings.parquet` (ops embed/extract), `utt_stats.parquet`, `errors.jsonl` and, last,
    `report.json`. Utterances `quality` filters out are left out of the features and listed in
    `errors.jsonl` with code `filtered`. Every parquet output's key-value metadata and the report
    hold the run's provenance. A missing shard file, or one whose rows are not its shard's
    utterances, is `VoxmillError("output_error")` and leaves the outputs as they were.

    `read_ahead`: in an object store, the shard files are read `read_ahead.in_flight` at once
    ahead of the merge (`_read_shards`), in plan order, so the outputs and errors are what reading
    them one after another gives; None (or 1 in flight), and a local folder: one after another.
    The outputs go to a store the same way: written locally, then uploaded `in_flight` at once
    (the report alone, after them).

    `given_up`: the names of the given-up files, when the caller knows them (the driver); None:
    one listing of `shards/`. `kept`: shard files the caller has read already, by URL (taken out
    as they are merged).
    """
    quality = quality or QualityFilter()
    tally = Tally()
    if given_up is None:
        given_up = {name for name in out_dir.shard_files() if RunFolder.is_given_up(name)}
    store = out_dir.location
    with contextlib.ExitStack() as stack:
        # In a store, the outputs are written to a local folder first and uploaded together at the
        # end: one round trip for all of them, not one per file in turn.
        staged = None
        if isinstance(store, ObjectFolder):
            staged = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="voxmill-merge-")))
        out = store if staged is None else LocalFolder(staged)
        provenance = _merge_into(
            out, out_dir, specs, tally, buffer_rows, quality, ops, given_up, read_ahead, kept or {}
        )
        if isinstance(store, ObjectFolder) and staged is not None:
            uploads = 1 if read_ahead is None else read_ahead.in_flight  # as the shards were read
            store.put_files({file.name: file for file in sorted(staged.iterdir())}, uploads)
    tally.fill(report)
    report.provenance = provenance
    if quality.active:
        report.filters = {**quality.to_dict(), "filtered_utterances": tally.filtered}
    text = json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n"
    write_text_at(store, RunFolder.REPORT, text)  # last: the run is whole once it exists
    return report


def _merge_into(
    out: OutputLocation,
    out_dir: RunFolder,
    specs: Iterable[ShardSpec],
    tally: Tally,
    buffer_rows: int,
    quality: QualityFilter,
    ops: Sequence[str] | None,
    given_up: set[str],
    read_ahead: ReadAhead | None,
    kept: dict[str, bytes],
) -> dict[str, Any]:
    """The merged outputs (all but the report) written to `out`, the shards read from `out_dir`;
    the run's provenance."""
    with contextlib.ExitStack() as stack:
        outputs = _Outputs(out, stack, buffer_rows)
        shards = _read_shards(out_dir, specs, given_up, buffer_rows, read_ahead, kept)
        for shard_specs, tables in stack.enter_context(closing(shards)):  # closed: its reads stop
            outputs.open_for([op for spec in shard_specs for op in _reported(spec.op, ops)])
            _merge_shard(out_dir, shard_specs, tables, tally, outputs, quality, ops, given_up)
        outputs.open_for(tally.ops)
        provenance = tally.provenance()
        outputs.close(provenance)
    if outputs.embeddings is not None:
        spk = outputs.speakers.table()
        spk = spk.replace_schema_metadata({PROVENANCE_METADATA_KEY: json.dumps(provenance, sort_keys=True)})
        write_table_at(out, RunFolder.SPK_EMBEDDINGS, spk)
    return provenance


def _by_shard(specs: Iterable[ShardSpec]) -> Iterator[list[ShardSpec]]:
    """Consecutive specs of one shard together, ops in their canonical order."""
    group: list[ShardSpec] = []
    for spec in specs:
        if group and spec.shard != group[0].shard:
            yield sorted(group, key=_op_rank)
            group = []
        group.append(spec)
    if group:
        yield sorted(group, key=_op_rank)


def reads_ahead(local: bool, read_ahead: ReadAhead | None) -> bool:
    """Whether the merge reads shard files ahead: only from a store (a local read has no round
    trip to hide, and a thread pool would only cost), and only when more than one is allowed."""
    return not local and read_ahead is not None and read_ahead.in_flight > 1


def windows(
    shards: Iterable[list[ShardSpec]], max_rows: int, max_files: int
) -> Iterator[list[list[ShardSpec]]]:
    """Consecutive shards (each its specs) read ahead together: at most `max_files` files and
    `max_rows` planned utterances (the merge's own bound), at least one shard."""
    window: list[list[ShardSpec]] = []
    files = rows = 0
    for shard in shards:
        shard_rows = len(shard[0].utts)  # every op's spec of a shard lists the same utterances
        if window and (files + len(shard) > max_files or rows + shard_rows > max_rows):
            yield window
            window, files, rows = [], 0, 0
        window.append(shard)
        files, rows = files + len(shard), rows + shard_rows
    if window:
        yield window


ShardTables = tuple[list[ShardSpec], list[pa.Table]]


def _read_shards(
    out_dir: RunFolder,
    specs: Iterable[ShardSpec],
    given_up: set[str],
    buffer_rows: int,
    read_ahead: ReadAhead | None,
    kept: dict[str, bytes],
) -> Generator[ShardTables, None, None]:
    """Each shard's specs and its files' tables, in plan order: read one after another, or (see
    `reads_ahead`) window by window, `read_ahead.in_flight` reads at once; a file `kept` is taken
    from it, not read."""
    shards = _by_shard(specs)
    if read_ahead is None or not reads_ahead(out_dir.is_local, read_ahead):
        for shard in shards:
            files = _refs(out_dir, shard, given_up)
            yield shard, [read_shard(ref, data=kept.pop(str(ref), None)) for ref in files]
        return
    for window in windows(shards, buffer_rows, WINDOW_FILES):
        refs = [str(ref) for shard in window for ref in _refs(out_dir, shard, given_up)]
        with closing(prefetch(refs, functools.partial(_read_held, kept), read_ahead)) as tables:
            for shard in window:
                yield shard, [next(tables) for _ in shard]  # an error is raised at its file, in order


def _refs(out_dir: RunFolder, shard: list[ShardSpec], given_up: set[str]) -> list[Path | str]:
    return [out_dir.ref(_file_name(spec, given_up)) for spec in shard]


def _read_held(kept: dict[str, bytes], url: str, reserve: Reserve) -> pa.Table:
    """A shard file read ahead (by `read_shard`, so a failure says what it always said; from its
    bytes where they are `kept`). Its size is known once read: it then waits for room in the byte
    budget, so the tables waiting stay within it, plus one file per read in flight."""
    table = read_shard(url, data=kept.pop(url, None))
    reserve(table.nbytes)
    return table


def _op_rank(spec: ShardSpec) -> int:
    return OPS.index(spec.op) if spec.op in OPS else len(OPS)


def _reported(op: str, asked: Sequence[str] | None) -> list[str]:
    """The ops a shard file of `op` stands for in the report: an `extract` task run for `asked`."""
    return list(asked) if op == "extract" and asked and "extract" not in asked else [op]


def _merge_shard(
    out_dir: RunFolder,
    specs: list[ShardSpec],
    tables: list[pa.Table],
    tally: Tally,
    outputs: _Outputs,
    quality: QualityFilter,
    asked: Sequence[str] | None = None,
    given_up: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Fold one shard (`tables`: every op's file of it, its given-up file if it was given up) into
    the outputs."""
    names = [(spec, _file_name(spec, given_up)) for spec in specs]
    refs = [(spec, out_dir.ref(name), name in given_up) for spec, name in names]
    read = [(spec, ref, table, gave_up) for (spec, ref, gave_up), table in zip(refs, tables, strict=True)]
    # A tar's utterances are what it held: the first op's rows (of a file not given up), the same
    # in every op's file; a given-up file of the tar fails each of them.
    first = next((table for _, _, table, gave_up in read if not gave_up), read[0][2])
    utts = first.column("utt").to_pylist() if specs[0].tar else [u.utt for u in specs[0].utts]
    if specs[0].tar:
        spks = first.column("spk").to_pylist()
        read = [
            (spec, path, _as_rows(spec, table, utts, spks) if gave_up else table, gave_up)
            for spec, path, table, gave_up in read
        ]
    read_tables = [(spec, path, table) for spec, path, table, _ in read]
    _fold_shard(read_tables, utts, tally, outputs, quality, asked)


def _file_name(spec: ShardSpec, given_up: frozenset[str] | set[str]) -> str:
    """The file that stands for a shard: its given-up file when it was given up."""
    name = RunFolder.given_up_file(spec.op, spec.shard)
    return name if name in given_up else RunFolder.shard_file(spec.op, spec.shard)


def _as_rows(spec: ShardSpec, table: pa.Table, utts: list[str], spks: list[str]) -> pa.Table:
    """A given-up tar shard's table as failures of `utts` (what another op's file of the tar held)."""
    if table.column("utt").to_pylist() == utts or not table.num_rows:
        return table
    code, message = table.column("error_code")[0].as_py(), table.column("error_message")[0].as_py()
    rows = [Utterance(utt, spec.tar, spk) for utt, spk in zip(utts, spks, strict=True)]
    return failed_shard_table(spec, rows, code or OUTPUT_ERROR, message or "")


def _fold_shard(
    read: list[tuple[ShardSpec, Any, pa.Table]],
    utts: list[str],
    tally: Tally,
    outputs: _Outputs,
    quality: QualityFilter,
    asked: Sequence[str] | None,
) -> None:
    """Fold the tables of one shard's files (their rows `utts`) into the outputs."""
    for spec, path, table in read:
        _check_rows(path, spec, table, utts)
    stats = _shard_stats([table for _, _, table in read])
    outputs.stats.add(stats)
    tally.histograms.add(stats)
    reasons = [quality.reason(row) for row in stats.to_pylist()] if quality.active else [None] * len(utts)
    kept = pa.array([reason is None for reason in reasons], type=pa.bool_())
    failures: list[list[dict[str, str]]] = [[] for _ in utts]
    for spec, _, table in read:
        tally.vote(table)
        codes = table.column("error_code")
        messages = table.column("error_message").to_pylist() if codes.null_count < len(codes) else []
        ok = table.filter(pc.and_(pc.is_null(codes), kept))
        for op in _reported(spec.op, asked):
            if op not in tally.ops:
                tally.ops.append(op)
            for index, code in enumerate(codes.to_pylist()):
                if code is not None:
                    failures[index].append(_failure(utts[index], op, code, messages[index] or ""))
                elif reasons[index] is not None:
                    failures[index].append(_failure(utts[index], op, FILTERED, str(reasons[index])))
            tally.add(op, table.num_rows, ok.num_rows)
            outputs.add(op, ok)
    tally.utterances += len(utts)
    tally.filtered += sum(any(f["code"] == FILTERED for f in found) for found in failures)
    audio = _first_seconds([table for _, _, table in read])
    tally.audio_seconds += sum(s for s in audio if s is not None)
    for found in failures:  # by utterance, then op: what a sort of the errors by corpus order gives
        for failure in found:
            outputs.errors.write(json.dumps(failure, ensure_ascii=False) + "\n")


def _failure(utt: str, op: str, code: str, message: str) -> dict[str, str]:
    return {"utt": utt, "op": op, "code": code, "message": message}


def _first_seconds(tables: list[pa.Table]) -> list[float | None]:
    """Each utterance's audio seconds: from the first op's file that has them (a failed op has
    none)."""
    columns = [table.column("audio_seconds").to_pylist() for table in tables]
    return [next((float(v) for v in values if v is not None), None) for values in zip(*columns, strict=True)]


def _shard_stats(tables: list[pa.Table]) -> pa.Table:
    """One row of quality statistics per utterance of the shard: the first op's file that has them
    (every op decodes the clip the same way; a failed decode has none)."""
    first = tables[0]
    columns: dict[str, pa.ChunkedArray] = {"utt": first.column("utt"), "spk": first.column("spk")}
    for name in STAT_FIELDS:
        column = first.column(name)
        for other in tables[1:]:
            if column.null_count == 0:
                break
            column = pc.coalesce(column, other.column(name))
        columns[name] = column
    return pa.table(columns).cast(UTT_STATS_SCHEMA)


def _check_rows(path: Path | str, spec: ShardSpec, table: pa.Table, wanted: list[str]) -> None:
    """A shard file holds its shard's utterances, in order (a file of another plan does not)."""
    listed = table.column("utt").to_pylist()
    if listed != wanted:
        present = set(listed)
        missing = next((utt for utt in wanted if utt not in present), None)
        what = f"no row for utt {missing!r}" if missing else "its rows in another order"
        if spec.tar:
            what += f" than the other ops' files of tar {spec.tar} (did the tar change?)"
        raise VoxmillError(OUTPUT_ERROR, f"shard file {path} has {what} (written by another plan?)")


def _matrix(column: pa.ChunkedArray) -> npt.NDArray[np.float32]:
    """A list<float32> column of equal-length rows as a float32 matrix [rows, dim]."""
    if len(column) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    flat = np.asarray(pc.list_flatten(column), dtype=np.float32)
    return flat.reshape(len(column), -1)
