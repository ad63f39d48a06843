"""Where a corpus's audio lies: the local folders and URL prefixes its listing names (paths only,
nothing opened), which an embedded run lets its own workers read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from pipeline.corpus.kaldi import KALDI_WAV_SCP
from pipeline.corpus.lhotse import jsonl_kind, lhotse_pair
from pipeline.corpus.listing import CorpusListing
from pipeline.corpus.problems import Problems, name_problem
from pipeline.corpus.reading import Source, absolute, as_source, is_jsonl, parse_json, read_lines
from pipeline.corpus.tars import input_is_tars
from pipeline.errors import VoxmillError
from pipeline.storage.urls import MAX_TEXT_CHARS, is_url, parse_url


def corpus_roots(source: Source, limit: int = 64) -> tuple[list[Path], list[str]]:
    """(local folders, URL prefixes) holding a corpus's audio or tars.

    The folders are exactly those of the listed files, less any below another of them (it adds
    nothing): never a common ancestor, which would let the workers read what the corpus does not
    name. There may be many (one per speaker or chapter): the embedded run hands them to its
    workers in a file (`workers.corpus.cluster.EmbeddedCluster`). The URL prefixes are the listed
    objects' parents, or their buckets beyond `limit` of them.
    """
    source = as_source(source)
    if isinstance(source, Path) and source.is_dir() and not _listing_names_paths(source):
        return [source.absolute()], []
    folders: set[str] = set()
    prefixes: set[str] = set()
    for path in _listed_paths(source):
        if "://" in path and is_url(path):
            try:
                prefixes.add(str(parse_url(path).parent))
            except VoxmillError:
                continue  # the worker reports it for its utterance
            if len(prefixes) > limit:  # many prefixes: their buckets
                prefixes = {_bucket_of(p) for p in prefixes}
            continue
        if "\x00" not in path:  # the worker refuses such a path for its utterance
            folders.add(os.path.dirname(path))
    return [Path(folder) for folder in outermost_folders(folders)], sorted(prefixes)


def outermost_folders(folders: Iterable[str]) -> list[str]:
    """The absolute folders none of the others holds, sorted: '/a/b' drops '/a/b/c', never '/a/bc'.

    A folder is below another when that one is a prefix of it ending at a '/' and no '..' follows
    it ('/a/b/../c' is not below '/a/b'). A set of the kept ones and a look at each ancestor: a
    few steps per folder, whatever their number.
    """
    kept: set[str] = set()
    trimmed = {f.rstrip("/") or f[:1] for f in folders}  # '/a/' is '/a'; '/' stays '/', '' stays ''
    for folder in sorted(trimmed, key=lambda f: (f.count("/"), f)):
        if not folder.startswith("/"):
            continue  # not a local absolute path: the worker refuses it for its utterance
        if folder == "/" or "/" in kept:
            return ["/"]
        parts = folder.split("/")  # '/a/b/c': '', 'a', 'b', 'c'
        ancestors = []
        for end in range(len(parts) - 1, 1, -1):  # '/a/b', then '/a'
            if parts[end] == "..":
                break
            ancestors.append("/".join(parts[:end]))
        if not any(ancestor in kept for ancestor in ancestors):
            kept.add(folder)
    return sorted(kept)


def _bucket_of(url: str) -> str:
    parsed = parse_url(url)
    return f"{parsed.scheme}://{parsed.bucket}"


def _listing_names_paths(folder: Path) -> bool:
    """Whether a folder input is a listing that names its audio (Kaldi, lhotse, tars), not a
    folder of audio files whose audio is the folder itself."""
    return (folder / KALDI_WAV_SCP).is_file() or lhotse_pair(folder) is not None or input_is_tars(folder)


def _listed_paths(source: Source) -> Iterator[str]:
    """The audio paths a listing names, parsed no further than that (a wav.scp line is split once,
    a manifest line's JSON read for its 'path'); a path the reader refuses (too long, a NUL byte)
    is left out: the listing is refused before anything runs."""
    wav_scp = source / KALDI_WAV_SCP if isinstance(source, Path) and source.is_dir() else source
    if isinstance(wav_scp, Path) and wav_scp.name == KALDI_WAV_SCP:
        base = str(wav_scp.parent.absolute())
        with open(wav_scp, "rb") as stream:
            for raw in stream:
                parts = raw.split(None, 1)
                if len(parts) == 2 and len(parts[1]) <= MAX_TEXT_CHARS and b"\x00" not in parts[1]:
                    yield absolute(base, parts[1].strip().decode("utf-8", "replace"))
    elif (
        isinstance(source, Path)
        and source.is_file()
        and is_jsonl(source.name)
        and jsonl_kind(source) == "manifest"
    ):
        base = str(source.parent.absolute())
        for line in read_lines(source, Problems()):
            data, _ = parse_json(line.text)
            path = data.get("path") if isinstance(data, dict) else None
            if isinstance(path, str) and path.strip() and name_problem("path", path, MAX_TEXT_CHARS) is None:
                yield absolute(base, path)
    else:
        yield from (utt.path for utt in CorpusListing(source, find_repeats=False))
