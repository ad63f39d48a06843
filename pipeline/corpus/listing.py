"""Corpus listings, read as a stream (pure: no queue, no audio opened).

`CorpusListing(source)` accepts the input kinds of `voxmill extract` (DESIGN.md, Contract), each
read by its own module, all yielding the same `Utterance`:

- a Kaldi data dir (`pipeline.corpus.kaldi`): `wav.scp` with optional `utt2spk`, `text`,
  `utt2dur`, or `segments` of the recordings `wav.scp` lists;
- a JSONL manifest (`pipeline.corpus.manifest`): one `{"utt", "path", "spk"?, "text"?,
  "duration"?}` object per line;
- lhotse cuts, or a recordings + supervisions pair (`pipeline.corpus.lhotse`);
- WebDataset tar shards (`pipeline.corpus.tars`): one entry per tar, and `tars` is set;
- any other folder (`pipeline.corpus.folder`): the audio files found below it.

Audio paths may be `s3://`, `gs://` or `http(s)://` URLs; a manifest, cuts, a tar list or tar
shards may themselves be at a URL (read through `pipeline.storage.objects`).

Iterating it yields `Utterance`s in listing order without holding the listing in memory, and
duplicate utterance ids are found from 16-byte digests of the ids. Every problem found is
collected; `raise_problems()` after the iteration raises them together as one `CorpusError`,
each as "FILE line N: what is wrong". A caller that plans as the listing streams by calls it
once the iteration ends. `read_corpus(source)` is the whole listing as a list, problems raised;
`first_problems(source)` those of its first lines (what a run looks at before it starts anything).

A missing audio file is not an error here: the worker reports `not_found` for that utterance.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice

from pipeline.corpus.folder import read_folder
from pipeline.corpus.kaldi import KALDI_WAV_SCP, read_kaldi
from pipeline.corpus.lhotse import jsonl_kind, lhotse_pair, read_cuts, read_lhotse_pair, recordings_beside
from pipeline.corpus.manifest import read_manifest
from pipeline.corpus.reading import NoIds, Reading, Source, as_source, is_jsonl
from pipeline.corpus.tars import input_is_tars, read_tars
from pipeline.errors import BAD_REQUEST, VoxmillError
from pipeline.records import Utterance
from pipeline.storage.urls import MAX_TEXT_CHARS

MAX_LISTED_PROBLEMS = 20
FIRST_UTTERANCES = 1000  # what a run reads of its listing before it starts anything


class CorpusError(VoxmillError):
    """Problems in a corpus listing, each "FILE line N: what is wrong" (code `bad_request`)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED_PROBLEMS]
        lines = [f"{len(self.problems)} problem(s) in the corpus:", *(f"  {p}" for p in shown)]
        if len(self.problems) > MAX_LISTED_PROBLEMS:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED_PROBLEMS} more")
        super().__init__(BAD_REQUEST, "\n".join(lines))


class CorpusListing(Reading):
    """A corpus listing of `source`, read as it is iterated (once); the `Reading` its format
    readers share.

    `tars` is set when the source is WebDataset tar shards: then each item is a tar, not an
    utterance (`Utterance(utt=tar as listed, path=tar)`). `find_repeats` False: the listing is
    read only for its paths, and ids listed twice are not looked for. `max_text_chars`: the
    longest utt, speaker, recording id, path or URL a line may carry (`Settings.max_text_chars`),
    told before any path call; None: no limit. A name or path holding a NUL byte, or text that
    is not valid Unicode (a lone surrogate from a JSON escape), is a problem whatever the limit.
    """

    def __init__(
        self, source: Source, find_repeats: bool = True, max_text_chars: int | None = MAX_TEXT_CHARS
    ) -> None:
        if find_repeats:
            from pipeline.corpus.listed_ids import ListedIds  # numpy: `corpus_roots` runs before it is needed

            super().__init__(max_text_chars, ListedIds())
        else:
            super().__init__(max_text_chars, NoIds())
        self.source: Source = as_source(source)
        self.tars = input_is_tars(self.source)

    def __iter__(self) -> Iterator[Utterance]:
        source = self.source
        utts: Iterator[Utterance]
        if self.tars:
            utts = read_tars(source, self)
        elif isinstance(source, str):
            utts = self._remote(source)
        elif source.is_dir() and (source / KALDI_WAV_SCP).is_file():
            utts = read_kaldi(source, self)
        elif source.is_dir() and (pair := lhotse_pair(source)) is not None:
            utts = read_lhotse_pair(*pair, self)
        elif source.is_dir():
            utts = read_folder(source, self)
        elif source.is_file() and source.name == KALDI_WAV_SCP:
            utts = read_kaldi(source.parent, self)
        elif source.is_file() and is_jsonl(source.name):
            utts = self._jsonl(source)
        elif not source.exists():
            self.problems.add(source, None, "no such file or folder")
            return
        else:
            what = (
                "not a Kaldi data dir (with wav.scp), a .jsonl manifest, lhotse cuts, WebDataset .tar "
                "shards or a folder of audio files"
            )
            self.problems.add(source, None, what)
            return
        for utt in utts:
            self.count += 1
            yield utt

    def _remote(self, url: str) -> Iterator[Utterance]:
        """A listing file at a URL: a JSONL manifest or lhotse cuts."""
        if is_jsonl(url):
            return self._jsonl(url)
        self.problems.add(
            url,
            None,
            "a URL input must be a .jsonl[.gz] manifest or lhotse cuts, a .tar, a brace pattern of "
            ".tar, a prefix of .tar shards (ending in '/') or a .txt list of tars",
        )
        return iter(())

    def _jsonl(self, file: Source) -> Iterator[Utterance]:
        """A JSONL file: a manifest, lhotse cuts, or lhotse supervisions (their recordings beside)."""
        kind = jsonl_kind(file)
        if kind == "cuts":
            return read_cuts(file, self)
        if kind == "supervisions":
            recordings = recordings_beside(file)
            if recordings is None:
                self.problems.add(file, None, "lhotse supervisions without a recordings file beside them")
                return iter(())
            return read_lhotse_pair(recordings, file, self)
        return read_manifest(file, self)

    def raise_problems(self) -> None:
        """Raise every problem found so far (call it once the iteration ended)."""
        if self.problems.items:
            raise CorpusError(self.problems.items)


def read_corpus(source: Source, max_text_chars: int | None = MAX_TEXT_CHARS) -> list[Utterance]:
    """The whole corpus at `source`, in listing order (`CorpusError` for any problem in it)."""
    listing = CorpusListing(source, max_text_chars=max_text_chars)
    utts = list(listing)
    listing.raise_problems()
    return utts


def first_problems(
    source: Source, max_text_chars: int | None = MAX_TEXT_CHARS, utterances: int = FIRST_UTTERANCES
) -> list[str]:
    """The problems of the listing's first `utterances` (a missing or unknown input included), as
    the reader words them: a run looks before it starts its workers, so a listing wrong from its
    first lines fails at once. Ids listed twice are left to the whole listing's check."""
    listing = CorpusListing(source, find_repeats=False, max_text_chars=max_text_chars)
    for _ in islice(listing, utterances):
        pass
    return listing.problems.items
