"""A folder of audio files read as a stream of utterances: the files found recursively (hidden ones
skipped); utt = path relative to the folder without its extension (posix separators), spk = name
of the parent folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from pipeline.corpus.reading import Reading
from pipeline.records import Utterance

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".m4a", ".aac", ".wma"})


def read_folder(folder: Path, reading: Reading) -> Iterator[Utterance]:
    """The audio files below `folder`, each an utterance."""
    base = folder.absolute()
    # Two files of one stem (a.wav, a.flac) are in the same folder: the stems of the folder
    # being listed are enough to find them.
    folder_now, stems = "", dict[str, str]()
    for rel in _audio_files(base):
        utt = rel.rsplit(".", 1)[0]
        parent = rel.rsplit("/", 2)[-2] if "/" in rel else base.name
        here = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if here != folder_now:
            folder_now, stems = here, {}
        if utt in stems:
            reading.problems.add(folder, None, f"duplicate utt {utt!r} from {stems[utt]!r} and {rel!r}")
            continue
        stems[utt] = rel
        yield Utterance(utt=utt, path=str(base / rel), spk=parent)
    if reading.count == 0 and not reading.problems.items:
        reading.problems.add(folder, None, f"holds no audio files ({', '.join(sorted(AUDIO_EXTENSIONS))})")


def _audio_files(base: Path, rel_dir: PurePosixPath = PurePosixPath()) -> Iterator[str]:
    """Posix paths, relative to `base`, of the audio files below it (hidden ones skipped), in the
    order a sort of those paths gives: a folder's entries sorted as `name/` and `name`."""
    try:
        entries = list(os.scandir(base / rel_dir))
    except OSError:
        return
    keyed = sorted(
        ((entry.name + "/" if entry.is_dir() else entry.name), entry.name)
        for entry in entries
        if not entry.name.startswith(".")
    )
    for key, name in keyed:
        if key.endswith("/"):
            yield from _audio_files(base, rel_dir / name)
        elif Path(name).suffix.lower() in AUDIO_EXTENSIONS:
            yield (rel_dir / name).as_posix()
