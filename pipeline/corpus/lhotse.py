"""lhotse manifests read as a stream of utterances (their documented JSONL form; the lhotse package
is not used).

A CutSet (`cuts.jsonl[.gz]`): each supervision of a cut is an utterance (the segment of the
recording it covers inside the cut), a cut without supervisions is one. A recordings +
supervisions pair (`*recordings*.jsonl[.gz]` and `*supervisions*.jsonl[.gz]`, a folder holding
both or the supervisions file): each supervision is an utterance (the recordings are held as a
dict). A `command` source is refused: voxmill never runs a shell command named by a corpus file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.corpus.problems import NO_SHELL, Problems, name_problem, quote, shown, text_problem
from pipeline.corpus.reading import (
    Reading,
    Source,
    absolute,
    finite,
    folder_of,
    is_jsonl,
    parse_json,
    read_lines,
)
from pipeline.records import Utterance
from pipeline.storage.objects import url_exists
from pipeline.storage.urls import URL_SCHEMES, is_url, parse_url


@dataclass(frozen=True)
class _Recording:
    """A lhotse recording: its id and its sources as (path or URL, the channels it holds)."""

    id: str
    sources: tuple[tuple[str, tuple[int, ...]], ...]


def lhotse_pair(folder: Path) -> tuple[Path, Path] | None:
    """(recordings, supervisions) of a folder holding exactly one file of each, else None."""
    try:
        names = [e.name for e in os.scandir(folder) if is_jsonl(e.name)]
    except OSError:
        return None
    recordings = [n for n in names if "recordings" in n]
    supervisions = [n for n in names if "supervisions" in n]
    if len(recordings) == 1 and len(supervisions) == 1:
        return folder / recordings[0], folder / supervisions[0]
    return None


def recordings_beside(file: Source) -> Source | None:
    """The recordings file named like `file` with 'supervisions' replaced, if it exists."""
    name = str(file).rsplit("/", 1)[-1]
    if "supervisions" not in name:
        return None
    other = name.replace("supervisions", "recordings")
    if isinstance(file, str):
        url = str(parse_url(file).parent.join(other))
        return url if url_exists(url) else None
    candidate = file.parent / other
    return candidate if candidate.exists() else None


def jsonl_kind(file: Source) -> str:
    """'cuts', 'supervisions' or 'manifest', told from the first object of the file."""
    for line in read_lines(file, Problems()):
        first, error = parse_json(line.text)
        if error is not None or not isinstance(first, dict):
            return "manifest"  # its problems are reported as a manifest's
        if "supervisions" in first or "recording" in first or str(first.get("type", "")).endswith("Cut"):
            return "cuts"
        if "recording_id" in first and "start" in first:
            return "supervisions"
        return "manifest"
    return "manifest"


def read_cuts(file: Source, reading: Reading) -> Iterator[Utterance]:
    """The utterances of a lhotse CutSet: each supervision's part of a cut, or a whole cut."""
    base = folder_of(file)
    for line in read_lines(file, reading.problems):
        found = _cut_utterances(line.text, base, reading.limit)
        if isinstance(found, str):
            reading.problems.add(file, line.number, found)
            continue
        for utt in found:
            reading.ids.add(utt.utt, line.number)
            yield utt
    reading.durations_listed = True
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(file, None, "lists no cuts")
    _check_ids(file, reading)


def read_lhotse_pair(
    recordings_file: Source, supervisions_file: Source, reading: Reading
) -> Iterator[Utterance]:
    """The utterances of a recordings + supervisions pair: one a supervision."""
    reading.problems.register(supervisions_file, recordings_file)
    recordings: dict[str, _Recording] = {}
    base = folder_of(recordings_file)
    for line in read_lines(recordings_file, reading.problems):
        recording = _recording_entry(line.text, base, reading.limit)
        if isinstance(recording, str):
            reading.problems.add(recordings_file, line.number, recording)
        elif recording.id in recordings:
            reading.problems.add(recordings_file, line.number, f"duplicate recording {recording.id!r}")
        else:
            recordings[recording.id] = recording
    for line in read_lines(supervisions_file, reading.problems):
        utt = _supervision_entry(line.text, recordings, reading.limit)
        if isinstance(utt, str):
            reading.problems.add(supervisions_file, line.number, utt)
            continue
        reading.ids.add(utt.utt, line.number)
        yield utt
    reading.durations_listed = True
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(supervisions_file, None, "lists no supervisions")
    _check_ids(supervisions_file, reading)


def _check_ids(file: Source, reading: Reading) -> None:
    for line, first in sorted(reading.ids.repeats().items()):
        reading.problems.add(file, line, f"duplicate utterance id (first on line {first})")


def _lhotse_source(source: Any, base: Path | str, limit: int | None) -> tuple[str, tuple[int, ...]] | str:
    """(path or URL, channels) of one lhotse AudioSource, or why it cannot be read."""
    if not isinstance(source, dict):
        return "a recording source must be an object"
    kind, where = source.get("type"), source.get("source")
    channels = _channel_list(source.get("channels"))
    if kind == "command":
        return f"recording source of type 'command' refused: {NO_SHELL}"
    if kind not in ("file", "url") or not isinstance(where, str) or not where:
        return f"recording source of type {shown(kind, 40)} is not supported (file and url are)"
    if wrong := name_problem("recording source", where, limit):
        return wrong
    if channels is None:
        return f"channels must be a list of channel numbers, got {shown(source.get('channels'))}"
    if kind == "url" and not is_url(where):
        return f"recording URL scheme not supported (schemes: {', '.join(URL_SCHEMES)})"
    return absolute(base, where), channels


def _channel_list(value: Any) -> tuple[int, ...] | None:
    """A source's `channels` (absent: channel 0), or None when it is not a list of channel numbers."""
    if value is None or value == []:
        return (0,)
    if not isinstance(value, list) or not all(_is_channel(c) for c in value):
        return None
    return tuple(value)


def _is_channel(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65536


def _recording_entry(text: str, base: Path | str, limit: int | None) -> _Recording | str:
    data, error = parse_json(text)
    if error is not None:
        return error
    return _recording_of(data, base, limit)


def _recording_of(data: Any, base: Path | str, limit: int | None) -> _Recording | str:
    """A lhotse recording object, or what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not data.get("sources"):
        return "expected a lhotse recording: an object with 'id' and 'sources'"
    if not isinstance(data["sources"], list):
        return "a recording's 'sources' must be a list"
    if wrong := name_problem("recording id", data["id"], limit):
        return wrong
    sources = []
    for source in data["sources"]:
        parsed = _lhotse_source(source, base, limit)
        if isinstance(parsed, str):
            return parsed
        sources.append(parsed)
    return _Recording(data["id"], tuple(sources))


def _channel_of(recording: _Recording, wanted: Any) -> tuple[str, int | None] | str:
    """(path, channel inside that file or None for the mean) for a supervision's `channel`."""
    if isinstance(wanted, list):
        wanted = wanted[0] if len(wanted) == 1 else None  # several: their mean, as all channels
    if wanted is not None and not _is_channel(wanted):
        return f"channel must be an integer or a list of them, got {shown(wanted)}"
    for path, channels in recording.sources:
        if wanted is None or wanted in channels:
            if wanted is None or len(channels) <= 1:
                return path, None
            return path, channels.index(wanted)
    return f"channel {wanted} is in none of recording {quote(recording.id)}'s sources"


def _number(data: dict[str, Any], key: str, default: float | None = None) -> float | None:
    """A field as a finite number of seconds; None when absent (without default) or not one."""
    return finite(data.get(key, default))


def _supervision_entry(text: str, recordings: dict[str, _Recording], limit: int | None) -> Utterance | str:
    """One lhotse supervision (of a recordings + supervisions pair) as an utterance."""
    data, error = parse_json(text)
    if error is not None:
        return error
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return "expected a lhotse supervision: an object with 'id', 'recording_id', 'start', 'duration'"
    recording_id = data.get("recording_id")
    recording = recordings.get(recording_id) if isinstance(recording_id, str) else None
    if recording is None:
        return f"recording {shown(data.get('recording_id'))} is not in the recordings file"
    start, duration = _number(data, "start"), _number(data, "duration")
    if start is None or duration is None or duration <= 0 or start < 0:
        return "supervision needs a 'start' >= 0 and a 'duration' > 0 (seconds)"
    where = _channel_of(recording, data.get("channel"))
    if isinstance(where, str):
        return where
    return _supervised(data, where, start, start + duration, limit)


def _supervised(
    sup: dict[str, Any], where: tuple[str, int | None], start: float, end: float, limit: int | None
) -> Utterance | str:
    """A lhotse supervision as the utterance [start, end) of the recording file `where` names."""
    utt, speaker, text = sup["id"], sup.get("speaker"), sup.get("text")
    if speaker is not None and not isinstance(speaker, str) or text is not None and not isinstance(text, str):
        return f"supervision {quote(utt)}: 'speaker' and 'text' must be strings"
    wrong = (
        name_problem("supervision id", utt, limit)
        or text_problem("speaker", speaker or "", limit)
        or text_problem("text", text or "", limit)
    )
    if wrong:
        return wrong
    return Utterance(
        utt=utt,
        path=where[0],
        spk=speaker or utt,
        text=text or "",
        duration_s=end - start,
        start_s=start,
        end_s=end,
        channel=where[1],
    )


def _cut_utterances(text: str, base: Path | str, limit: int | None) -> list[Utterance] | str:
    """The utterances of one lhotse cut: each supervision's part of the cut (clipped to it), or
    the whole cut when it has none; or what is wrong with the line."""
    cut, error = parse_json(text)
    if error is not None:
        return error
    if not isinstance(cut, dict):
        return f"expected a JSON object, got {type(cut).__name__}"
    kind = cut.get("type") or "MonoCut"
    if kind != "MonoCut":
        return f"cut of type {shown(kind, 40)} is not supported (MonoCut is)"
    recording = _recording_of(cut.get("recording") or {}, base, limit)
    if isinstance(recording, str):
        return recording
    start, duration = _number(cut, "start", 0.0), _number(cut, "duration")
    if start is None or duration is None or duration <= 0 or start < 0:
        return "cut needs a 'start' >= 0 and a 'duration' > 0 (seconds)"
    supervisions = cut.get("supervisions") or []
    if not isinstance(supervisions, list):
        return "a cut's 'supervisions' must be a list"
    if not supervisions:
        return _whole_cut(cut, recording, start, duration, limit)
    utts = []
    for sup in supervisions:
        part = _cut_supervision(sup, cut, recording, start, duration, limit)
        if isinstance(part, str):
            return part
        if part is not None:
            utts.append(part)
    return utts


def _whole_cut(
    cut: dict[str, Any], recording: _Recording, start: float, duration: float, limit: int | None
) -> list[Utterance] | str:
    """A cut without supervisions: one utterance, the whole cut."""
    where = _channel_of(recording, cut.get("channel"))
    if isinstance(where, str):
        return where
    utt = cut.get("id") or recording.id
    if not isinstance(utt, str):
        return f"a cut's 'id' must be a string, got {shown(utt)}"
    if wrong := name_problem("cut id", utt, limit):
        return wrong
    return [Utterance(utt, where[0], utt, "", duration, start, start + duration, where[1])]


def _cut_supervision(
    sup: Any, cut: dict[str, Any], recording: _Recording, start: float, duration: float, limit: int | None
) -> Utterance | str | None:
    """One supervision of a cut as an utterance (the part of it inside the cut; None if none is)."""
    if not isinstance(sup, dict) or not isinstance(sup.get("id"), str):
        return "a supervision must be an object with an 'id'"
    sup_start, sup_duration = _number(sup, "start"), _number(sup, "duration")
    if sup_start is None or sup_duration is None or sup_duration <= 0:
        return f"supervision {quote(sup['id'])} needs a 'start' and a 'duration' > 0"
    first, last = max(sup_start, 0.0), min(sup_start + sup_duration, duration)  # inside the cut
    if last <= first:
        return None
    where = _channel_of(recording, sup.get("channel", cut.get("channel")))
    if isinstance(where, str):
        return where
    return _supervised(sup, where, start + first, start + last, limit)
