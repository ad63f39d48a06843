"""A JSONL manifest read as a stream of utterances: one `{"utt", "path", "spk"?, "text"?, "duration"?}`
object per line (`duration_s` is read as `duration` too). The manifest may be at a URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pipeline.corpus.problems import Problems, name_problem, shown_json, text_problem
from pipeline.corpus.reading import Line, Reading, Source, absolute, finite, folder_of, parse_json, read_lines
from pipeline.records import Utterance

DURATION_FIELDS = ("duration", "duration_s")


def read_manifest(file: Source, reading: Reading) -> Iterator[Utterance]:
    """The utterances of a JSONL manifest, one object a line."""
    for line in read_lines(file, reading.problems):
        utt = _manifest_entry(file, line, reading.problems, reading.limit)
        if utt is None:
            continue
        reading.ids.add(utt.utt, line.number)
        reading.durations_listed = reading.durations_listed or utt.duration_s is not None
        yield utt
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(file, None, "lists no utterances")
    reading.check_ids(file, _manifest_utt)


def _manifest_entry(file: Source, line: Line, problems: Problems, limit: int | None) -> Utterance | None:
    """One manifest line as an `Utterance`, or None after reporting what is wrong with it."""
    data, error = parse_json(line.text)
    if error is None and not isinstance(data, dict):
        error = f"expected a JSON object, got {type(data).__name__}"
    wrong = [error] if error is not None else manifest_field_problems(data, limit)
    if wrong:
        problems.add(file, line.number, "; ".join(wrong))
        return None
    utt = str(data["utt"])
    duration = next((data[key] for key in DURATION_FIELDS if isinstance(data.get(key), (int, float))), None)
    seconds = finite(duration)
    return Utterance(
        utt=utt,
        path=absolute(folder_of(file), data["path"]),
        spk=data.get("spk") or utt,
        text=data.get("text") or "",
        duration_s=seconds if seconds is not None and seconds >= 0 else None,
    )


def _manifest_utt(text: str) -> str:
    data, _ = parse_json(text)
    return str(data.get("utt")) if isinstance(data, dict) else "?"


def manifest_field_problems(data: dict[str, Any], limit: int | None) -> list[str]:
    """What is wrong with the fields of one manifest object (empty when nothing is)."""
    wrong: list[str] = []
    for key in ("utt", "path"):
        value = data.get(key)
        if key not in data:
            wrong.append(f"missing field {key!r}")
        elif not isinstance(value, str) or not value.strip():
            wrong.append(f"field {key!r} must be a non-empty string, got {shown_json(value)}")
        elif problem := name_problem(f"field {key!r}", value, limit):
            wrong.append(problem)
    for key in ("spk", "text"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            wrong.append(f"field {key!r} must be a string, got {shown_json(value)}")
        elif isinstance(value, str) and (problem := text_problem(key, value, limit)):
            wrong.append(problem)
    return wrong
