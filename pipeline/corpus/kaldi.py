"""A Kaldi data dir (CosyVoice's layout) read as a stream of utterances.

`wav.scp` ("utt path", split on the first whitespace so paths may hold spaces), optional
`utt2spk` ("utt spk"), `text` ("utt words...") and `utt2dur` ("utt seconds"). With a `segments`
file ("utt rec start end", end -1: to the recording's end) `wav.scp` maps recording ids to paths
(held as a dict: recordings are few next to segments) and each segment is an utterance;
`reco2dur` ("rec seconds") is optional. The side files are joined as they stream by, kept aside
only where their order differs from `wav.scp`'s. A Kaldi pipe (`wav.scp` line ending in `|`) is
refused: voxmill never runs a shell command named by a corpus file. An utterance without speaker
information is its own speaker (Kaldi's convention), so speaker embeddings never pool unrelated
clips.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.corpus.problems import NO_SHELL, Problems, name_problem, quote
from pipeline.corpus.reading import NoIds, Reading, absolute, read_lines, split_first
from pipeline.records import Utterance

if TYPE_CHECKING:
    from pipeline.corpus.listed_ids import ListedIds

KALDI_WAV_SCP = "wav.scp"
KALDI_UTT2SPK = "utt2spk"
KALDI_TEXT = "text"
KALDI_UTT2DUR = "utt2dur"
KALDI_SEGMENTS = "segments"
KALDI_RECO2DUR = "reco2dur"
KALDI_FILES = (KALDI_WAV_SCP, KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR, KALDI_SEGMENTS, KALDI_RECO2DUR)


def read_kaldi(folder: Path, reading: Reading) -> Iterator[Utterance]:
    """The utterances of a Kaldi data dir: `wav.scp` and its side files, or its `segments`."""
    if (folder / KALDI_SEGMENTS).is_file():
        yield from _read_segments(folder, reading)
        return
    wav_scp = folder / KALDI_WAV_SCP
    reading.problems.register(
        wav_scp, *(folder / name for name in (KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR))
    )
    speakers, texts, durations = _side_files(folder, reading)
    reading.durations_listed = durations.exists
    base = str(folder.absolute())
    for line in read_lines(wav_scp, reading.problems):
        utt, rest = split_first(line.text)
        if not rest:
            what = f"expected 'utt path', got {quote(line.text.strip())}"
            reading.problems.add(wav_scp, line.number, what)
            continue
        wrong = name_problem("utt", utt, reading.limit) or name_problem("path", rest, reading.limit)
        if wrong:
            reading.problems.add(wav_scp, line.number, wrong)
            continue
        if rest.endswith("|"):
            reading.problems.add(wav_scp, line.number, _pipe_refused(rest))
            continue
        reading.ids.add(utt, line.number)
        seconds = durations.value(utt)
        yield Utterance(
            utt=utt,
            path=absolute(base, rest),
            spk=speakers.value(utt) or utt,
            text=texts.value(utt) or "",
            duration_s=_seconds(seconds, durations.file, reading.problems),
        )
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(wav_scp, None, "lists no utterances")
    reading.check_ids(wav_scp, lambda text: split_first(text)[0])
    for side in (speakers, texts, durations):
        side.finish(reading.ids)


def _side_files(folder: Path, reading: Reading) -> tuple[_SideFile, _SideFile, _SideFile]:
    """utt2spk, text and utt2dur of a Kaldi dir, joined as they stream by."""
    limit = reading.limit
    return (
        _SideFile(folder / KALDI_UTT2SPK, reading.problems, "utt spk", "speaker", limit),
        _SideFile(folder / KALDI_TEXT, reading.problems, "utt words", None, limit),
        _SideFile(folder / KALDI_UTT2DUR, reading.problems, "utt seconds", "duration", limit),
    )


def _read_segments(folder: Path, reading: Reading) -> Iterator[Utterance]:
    """`segments` ("utt rec start end"): each line an utterance of recording `rec` of wav.scp."""
    wav_scp, segments = folder / KALDI_WAV_SCP, folder / KALDI_SEGMENTS
    side = (KALDI_UTT2SPK, KALDI_TEXT, KALDI_UTT2DUR, KALDI_RECO2DUR)
    reading.problems.register(segments, wav_scp, *(folder / name for name in side))
    recordings: dict[str, str] = {}
    base = str(folder.absolute())
    for line in read_lines(wav_scp, reading.problems):
        rec, rest = split_first(line.text)
        wrong = name_problem("recording", rec, reading.limit) or name_problem("path", rest, reading.limit)
        if not rest:
            what = f"expected 'recording path', got {quote(line.text.strip())}"
            reading.problems.add(wav_scp, line.number, what)
        elif wrong:
            reading.problems.add(wav_scp, line.number, wrong)
        elif rest.endswith("|"):
            reading.problems.add(wav_scp, line.number, _pipe_refused(rest))
        elif rec in recordings:
            reading.problems.add(wav_scp, line.number, f"duplicate recording {rec!r}")
        else:
            recordings[rec] = absolute(base, rest)
    lengths = _durations_of(folder / KALDI_RECO2DUR, reading.problems)
    speakers, texts, _ = _side_files(folder, reading)
    reading.durations_listed = True
    for line in read_lines(segments, reading.problems):
        parsed = segment_line(line.text, recordings, lengths, reading.limit)
        if isinstance(parsed, str):
            reading.problems.add(segments, line.number, parsed)
            continue
        utt, path, start, end = parsed
        reading.ids.add(utt, line.number)
        yield Utterance(
            utt=utt,
            path=path,
            spk=speakers.value(utt) or utt,
            text=texts.value(utt) or "",
            duration_s=None if end is None else max(0.0, end - start),
            start_s=start,
            end_s=end,
        )
        if end is None:
            reading.durations_listed = False
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(segments, None, "lists no utterances")
    reading.check_ids(segments, lambda text: split_first(text)[0])
    for side_file in (speakers, texts):
        side_file.finish(reading.ids)


class _SideFile:
    """A Kaldi side file (`utt2spk`, `text`, `utt2dur`) joined to `wav.scp` as both stream by.

    Values are read ahead only until the wanted utt: when the file lists utts in `wav.scp`'s order
    nothing is held; lines met out of that order wait in `aside` until their utt comes (at worst
    the whole file, as a plain dict would hold it). When both files are sorted, the read stops at
    the first utt that sorts after the wanted one, so an utt the file lacks costs nothing. Whether
    the file is sorted is read (the whole file, once) only when that question first comes up: a
    file in `wav.scp`'s order never asks it, so the first utterances come without reading it.
    """

    def __init__(
        self, file: Path, problems: Problems, shape: str, value_name: str | None, limit: int | None
    ) -> None:
        """`value_name`: what the one word after the utt is (a speaker, a duration); None: the rest
        of the line is free text (`text`). Such a word is held to `limit` characters."""
        self.file = file
        self.problems = problems
        self.shape = shape
        self.value_name = value_name
        self.single_word = value_name is not None
        self.limit = limit
        self.exists = file.exists()
        self.aside: dict[str, tuple[str, int]] = {}
        self._sorted: bool | None = None
        self._lines = read_lines(file, problems) if self.exists else iter(())
        self._peeked: tuple[str, str, int] | None = None
        self._last_key = ""
        self._last_line = 0

    def sorted(self) -> bool:
        if self._sorted is None:
            self._sorted = _keys_sorted(self.file)
        return self._sorted

    def value(self, utt: str) -> str | None:
        """The value listed for `utt`, or None when the file does not list it."""
        if not self.exists:
            return None
        if utt in self.aside:
            return self.aside.pop(utt)[0]
        while (entry := self._next()) is not None:
            key, value, number = entry
            if key == utt:
                return value
            if key > utt and self.sorted():
                self._peeked = entry  # every later key sorts after `utt` too: it is not listed
                return None
            self._keep_aside(key, value, number)
        return None

    def _next(self) -> tuple[str, str, int] | None:
        if self._peeked is not None:
            entry, self._peeked = self._peeked, None
            return entry
        for line in self._lines:
            key, rest = split_first(line.text)
            if self.single_word and (not rest or len(rest.split()) != 1):
                self.problems.add(
                    self.file, line.number, f"expected '{self.shape}', got {quote(line.text.strip())}"
                )
                continue
            if self.value_name is not None and (wrong := name_problem(self.value_name, rest, self.limit)):
                self.problems.add(self.file, line.number, wrong)
                continue
            if key == self._last_key:
                self.problems.add(
                    self.file, line.number, f"duplicate utt {key!r} (first on line {self._last_line})"
                )
                continue
            self._last_key, self._last_line = key, line.number
            return key, rest, line.number
        return None

    def _keep_aside(self, key: str, value: str, number: int) -> None:
        if key in self.aside:
            self.problems.add(
                self.file, number, f"duplicate utt {key!r} (first on line {self.aside[key][1]})"
            )
            return
        self.aside[key] = (value, number)

    def finish(self, ids: ListedIds | NoIds) -> None:
        """Report what the file lists that `wav.scp` does not (or lists twice)."""
        if not self.exists:
            return
        while (entry := self._next()) is not None:
            self._keep_aside(*entry)
        for key, (_, number) in sorted(self.aside.items(), key=lambda item: item[1][1]):
            if ids.contains(key):
                self.problems.add(self.file, number, f"duplicate utt {key!r}")
            else:
                self.problems.add(self.file, number, f"utt {key!r} is not in {KALDI_WAV_SCP}")
        self.aside.clear()


def _keys_sorted(file: Path) -> bool:
    """Whether the file's lines come in sorted order of their first word (Kaldi's convention)."""
    previous = ""
    for line in read_lines(file, Problems()):
        key = split_first(line.text)[0]
        if key < previous:
            return False
        previous = key
    return True


def _seconds(value: str | None, file: Path, problems: Problems) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        problems.add(file, None, f"duration {quote(value)} is not a number of seconds")
        return None
    return seconds if seconds >= 0 else None


def _pipe_refused(command: str) -> str:
    return f"piped commands are not supported ({command!r}): {NO_SHELL}; list audio files"


def _durations_of(file: Path, problems: Problems) -> dict[str, float]:
    """`reco2dur` ("rec seconds") as a dict; empty when there is no such file."""
    if not file.exists():
        return {}
    lengths: dict[str, float] = {}
    for line in read_lines(file, problems):
        rec, rest = split_first(line.text)
        seconds = recording_seconds(rest)
        if seconds is None:
            problems.add(file, line.number, f"expected 'recording seconds', got {quote(line.text.strip())}")
        else:
            lengths[rec] = seconds
    return lengths


def recording_seconds(text: str) -> float | None:
    """The seconds of a `reco2dur` line's value, or None when it is not a finite number."""
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) else None


def segment_line(
    text: str, recordings: dict[str, str], lengths: dict[str, float], limit: int | None
) -> tuple[str, str, float, float | None] | str:
    """(utt, path, start, end or None) of a `segments` line, or what is wrong with it."""
    parts = text.split()
    if len(parts) != 4:
        return f"expected 'utt recording start end', got {quote(text.strip())}"
    utt, rec, start_text, end_text = parts
    if wrong := name_problem("utt", utt, limit):
        return wrong
    if rec not in recordings:
        return f"recording {quote(rec)} is not in {KALDI_WAV_SCP}"
    try:
        start, end = float(start_text), float(end_text)
    except ValueError:
        start = end = math.nan
    if not (math.isfinite(start) and math.isfinite(end)):
        return f"start and end must be seconds, got {quote(start_text, 40)} and {quote(end_text, 40)}"
    if start < 0:
        return f"segment {utt!r} starts before 0 s"
    if end == -1:  # Kaldi: to the end of the recording
        return utt, recordings[rec], start, lengths.get(rec)
    if end <= start:
        return f"segment {utt!r} ends ({end:g} s) before it starts ({start:g} s)"
    return utt, recordings[rec], start, end
