"""Export an `extract` run as CosyVoice training data, without PyTorch.

Writes the layout of CosyVoice's `tools/make_parquet_list.py` into `out`:

- `parquet_%09d.tar`: parquet files despite the name, `utts_per_parquet` rows each, columns
  `utt`, `wav` (path), `audio_data` (the file's bytes), `text`, `spk`, `utt_embedding`,
  `spk_embedding` (list<double>) and `speech_token` (list<int64>), the types pandas gives the
  Python lists that make_parquet_list.py stores;
- `utt2parquet_%09d.json` / `spk2parquet_%09d.json`: `{utt: parquet path}` / `{spk: parquet path}`
  for each parquet file;
- `data.list`, `utt2data.list`, `spk2data.list`: the paths of the parquet files, of the utt2parquet
  maps and of the spk2parquet maps, one per line (`data.list` is what CosyVoice's training reads).

Paths are written absolute. Utterances without a speech token, an utterance embedding or a speaker
embedding (extraction failed), or whose audio can no longer be read, are skipped and logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.corpus.kaldi import KALDI_WAV_SCP
from pipeline.corpus.listing import read_corpus
from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import write_parquet, write_text
from pipeline.records import Utterance

log = logging.getLogger(__name__)

COSYVOICE_SCHEMA = pa.schema(
    [
        ("utt", pa.string()),
        ("wav", pa.string()),
        ("audio_data", pa.binary()),
        ("text", pa.string()),
        ("spk", pa.string()),
        ("utt_embedding", pa.list_(pa.float64())),
        ("spk_embedding", pa.list_(pa.float64())),
        ("speech_token", pa.list_(pa.int64())),
    ]
)
_SKIPPED_SHOWN = 10
_IDS_SHOWN = 3


class NothingToExport(VoxmillError):
    """Most of the data dir's utterances have no features in the `extract` folder: their ids differ."""

    def __init__(self, message: str) -> None:
        super().__init__(BAD_REQUEST, message)


@dataclass
class _Features:
    """The three feature tables of an `extract` output and, per key, the row holding it."""

    tokens: pa.Table
    utt_embeddings: pa.Table
    spk_embeddings: pa.Table
    token_row: dict[str, int] = field(default_factory=dict)
    utt_row: dict[str, int] = field(default_factory=dict)
    spk_row: dict[str, int] = field(default_factory=dict)


@dataclass
class _Chunk:
    """The rows of one parquet file being gathered: utterances, their audio bytes and feature rows."""

    utts: list[Utterance] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    token_rows: list[int] = field(default_factory=list)
    utt_rows: list[int] = field(default_factory=list)
    spk_rows: list[int] = field(default_factory=list)


def export_cosyvoice(
    data_dir: Path, features_dir: Path, out: Path, utts_per_parquet: int = 1000
) -> list[Path]:
    """Write CosyVoice's parquet training layout for `data_dir` (Kaldi) and `features_dir` (extract).

    Returns the parquet files written, in `data.list` order.
    """
    if utts_per_parquet < 1:
        raise VoxmillError(BAD_REQUEST, f"utts_per_parquet must be at least 1, got {utts_per_parquet}")
    if not (Path(data_dir) / KALDI_WAV_SCP).is_file():
        raise VoxmillError(BAD_REQUEST, f"{data_dir} is not a Kaldi data dir (no {KALDI_WAV_SCP})")
    utts = read_corpus(Path(data_dir))
    features = _load_features(Path(features_dir))
    _check_ids_match(utts, features, Path(data_dir), Path(features_dir))
    out = Path(out).absolute()
    skipped: list[str] = []
    parquets: list[Path] = []
    for chunk in _chunks(utts, features, utts_per_parquet, skipped):
        parquets.append(_write_chunk(out, len(parquets), chunk, features))
    _write_lists(out, parquets)
    if skipped:
        shown = ", ".join(skipped[:_SKIPPED_SHOWN]) + (" ..." if len(skipped) > _SKIPPED_SHOWN else "")
        log.warning(
            "export skipped %d of %d utterances (no features or unreadable audio): %s",
            len(skipped),
            len(utts),
            shown,
        )
    log.info(
        "exported %d utterances into %d parquet files in %s", len(utts) - len(skipped), len(parquets), out
    )
    return parquets


def _check_ids_match(utts: list[Utterance], features: _Features, data_dir: Path, features_dir: Path) -> None:
    """`NothingToExport` when fewer than half of the utterances have features, with how the ids differ."""
    matched = sum(1 for u in utts if u.utt in features.token_row or u.utt in features.utt_row)
    if matched * 2 >= len(utts):
        return
    theirs = list(dict.fromkeys([*features.token_row, *features.utt_row]))[:_IDS_SHOWN]
    ours = [u.utt for u in utts[:_IDS_SHOWN]]
    hint = ""
    if any("/" in utt for utt in theirs) and not any("/" in utt for utt in ours):
        hint = (
            "; the features come from a run on a folder of audio, whose utterance ids are paths relative "
            "to the folder without extension: run `voxmill extract` on the Kaldi data dir itself"
        )
    raise NothingToExport(
        f"only {matched} of the {len(utts)} utterances of {data_dir} have features in {features_dir}: "
        f"the data dir's ids look like {', '.join(map(repr, ours))}, the features' like "
        f"{', '.join(map(repr, theirs)) or '(none)'}{hint}"
    )


def _load_features(folder: Path) -> _Features:
    """Read speech_tokens, utt_embeddings and spk_embeddings parquet files and index them."""
    tables = [
        _read_table(folder / name)
        for name in (RunFolder.SPEECH_TOKENS, RunFolder.UTT_EMBEDDINGS, RunFolder.SPK_EMBEDDINGS)
    ]
    features = _Features(*tables)
    features.token_row = _index(features.tokens, "utt")
    features.utt_row = _index(features.utt_embeddings, "utt")
    features.spk_row = _index(features.spk_embeddings, "spk")
    return features


def _read_table(path: Path) -> pa.Table:
    """A feature file of an extract output; a missing one is a `bad_request` that says so."""
    if not path.is_file():
        raise VoxmillError(
            BAD_REQUEST, f"{path} is missing; run `voxmill extract --ops tokenize,embed` first"
        )
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise VoxmillError(BAD_REQUEST, f"{path} cannot be read: {exc}") from exc


def _index(table: pa.Table, key: str) -> dict[str, int]:
    """{key value: first row holding it}."""
    index: dict[str, int] = {}
    for row, value in enumerate(table.column(key).to_pylist()):
        index.setdefault(value, row)
    return index


def _chunks(utts: list[Utterance], features: _Features, size: int, skipped: list[str]) -> Iterator[_Chunk]:
    """Complete rows, `size` at a time; utterances lacking a feature or readable audio go to `skipped`."""
    chunk = _Chunk()
    for utt in utts:
        rows = _feature_rows(utt, features)
        audio = _read_audio(utt) if rows is not None else None
        if rows is None or audio is None:
            skipped.append(utt.utt)
            continue
        chunk.utts.append(utt)
        chunk.audio.append(audio)
        chunk.token_rows.append(rows[0])
        chunk.utt_rows.append(rows[1])
        chunk.spk_rows.append(rows[2])
        if len(chunk.utts) == size:
            yield chunk
            chunk = _Chunk()
    if chunk.utts:
        yield chunk


def _feature_rows(utt: Utterance, features: _Features) -> tuple[int, int, int] | None:
    """Rows of the utterance's token, its embedding and its speaker's embedding; None if any is missing."""
    token = features.token_row.get(utt.utt)
    embedding = features.utt_row.get(utt.utt)
    speaker = features.spk_row.get(utt.spk)
    if token is None or embedding is None or speaker is None:
        return None
    return token, embedding, speaker


def _read_audio(utt: Utterance) -> bytes | None:
    """The audio file's bytes, or None (logged) when it cannot be read."""
    try:
        return Path(utt.path).read_bytes()
    except OSError as exc:
        log.warning("export: cannot read %s for utt %s: %s", utt.path, utt.utt, exc.strerror or exc)
        return None


def _write_chunk(out: Path, number: int, chunk: _Chunk, features: _Features) -> Path:
    """Write parquet file `number` and its utt2parquet / spk2parquet maps; returns the parquet path."""
    parquet = out / f"parquet_{number:09d}.tar"
    columns: dict[str, Any] = {
        "utt": [u.utt for u in chunk.utts],
        "wav": [u.path for u in chunk.utts],
        "audio_data": chunk.audio,
        "text": [u.text for u in chunk.utts],
        "spk": [u.spk for u in chunk.utts],
        "utt_embedding": _take(features.utt_embeddings, "embedding", chunk.utt_rows, pa.float64()),
        "spk_embedding": _take(features.spk_embeddings, "embedding", chunk.spk_rows, pa.float64()),
        "speech_token": _take(features.tokens, "speech_token", chunk.token_rows, pa.int64()),
    }
    write_parquet(parquet, pa.Table.from_pydict(columns, schema=COSYVOICE_SCHEMA))
    utt_map = {u.utt: str(parquet) for u in chunk.utts}
    spk_map = {spk: str(parquet) for spk in dict.fromkeys(u.spk for u in chunk.utts)}
    write_text(out / f"utt2parquet_{number:09d}.json", _json(utt_map))
    write_text(out / f"spk2parquet_{number:09d}.json", _json(spk_map))
    return parquet


def _take(table: pa.Table, column: str, rows: list[int], item: pa.DataType) -> pa.Array:
    """`table[column][rows]` as a list<item> array."""
    taken = table.column(column).take(pa.array(rows, type=pa.int64()))
    return taken.cast(pa.list_(item)).combine_chunks()


def _write_lists(out: Path, parquets: list[Path]) -> None:
    """data.list, utt2data.list and spk2data.list: one path per line, as make_parquet_list.py writes."""
    names = [p.name.removeprefix("parquet_").removesuffix(".tar") for p in parquets]
    write_text(out / "data.list", "".join(f"{p}\n" for p in parquets))
    write_text(out / "utt2data.list", "".join(f"{out / f'utt2parquet_{n}.json'}\n" for n in names))
    write_text(out / "spk2data.list", "".join(f"{out / f'spk2parquet_{n}.json'}\n" for n in names))


def _json(mapping: dict[str, str]) -> str:
    """A map as make_parquet_list.py dumps it (UTF-8, indent 2)."""
    return json.dumps(mapping, ensure_ascii=False, indent=2)
