"""A digest of the files a local listing is read from: equal digests, the same listing."""

from __future__ import annotations

import hashlib
import os

from pipeline.corpus.kaldi import KALDI_FILES, KALDI_WAV_SCP
from pipeline.corpus.reading import Source, as_source, is_jsonl
from pipeline.corpus.tars import input_is_tars


def listing_digest(source: Source) -> str | None:
    """A digest of the files a local Kaldi dir (those of `KALDI_FILES` it has) or JSONL manifest
    is read from: their paths, sizes and bytes, and the working folder. Equal digests mean the
    listing would read the same, so a resume of a finished plan need not parse it again (CHANGELOG
    21). None for the other listings (a folder scan, tars, URLs, lhotse pairs), which a resume
    reads again."""
    source = as_source(source)
    if isinstance(source, str) or input_is_tars(source):
        return None
    if source.is_dir() and (source / KALDI_WAV_SCP).is_file():
        files = [source / name for name in KALDI_FILES if (source / name).is_file()]
    elif source.is_file() and source.name == KALDI_WAV_SCP:
        files = [source.parent / name for name in KALDI_FILES if (source.parent / name).is_file()]
    elif source.is_file() and is_jsonl(source.name):
        files = [source]
    else:
        return None
    digest = hashlib.sha256(os.getcwd().encode())
    for path in files:
        digest.update(f"\0{path.absolute()}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as stream:
            while block := stream.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
