"""A confined path is opened without a window: swapping a folder inside a root for a symlink to
outside, while jobs resolve and open a file below it, never lets a job read the outside file,
and every failure is a catalogue code (never an `OSError` out of `os.path.realpath`)."""

from __future__ import annotations

import ctypes
import errno
import io
import os
import threading
import wave
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pipeline.audio.decode import load_audio
from pipeline.errors import CODES, FORBIDDEN_PATH, INTERNAL, NOT_FOUND, UNREADABLE, VoxmillError
from pipeline.settings import AudioLimits
from pipeline.storage.objects import open_input
from pipeline.storage.paths import ConfinedPath, resolve_allowed

RENAME_EXCHANGE = 2
AT_FDCWD = -100
JOBS = 600


def _wav(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pcm = (rng.uniform(-0.5, 0.5, round(16000 * seconds)) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def _exchanger(a: Path, b: Path, atomic: bool) -> Callable[[], None]:
    """A call that swaps `a` and `b`: renameat2(RENAME_EXCHANGE) (atomic: each name always
    exists; the test is skipped where libc or the kernel lacks it), or three renames (each
    name is missing for a moment)."""
    if not atomic:
        spare = a.with_name(a.name + ".spare")

        def three_renames() -> None:
            os.rename(a, spare)
            os.rename(b, a)
            os.rename(spare, b)

        return three_renames
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        pytest.skip("libc has no renameat2")
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    first, second = os.fsencode(a), os.fsencode(b)

    def exchange() -> None:
        if renameat2(AT_FDCWD, first, AT_FDCWD, second, RENAME_EXCHANGE) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")

    try:
        exchange()
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EINVAL):
            pytest.skip(f"renameat2(RENAME_EXCHANGE) is not supported here ({exc})")
        raise
    return exchange


@pytest.fixture
def swapped_tree(tmp_path: Path) -> tuple[Path, Path, bytes, bytes]:
    """root/d/clip.wav (inside bytes) and root/swap -> outside/ (outside/clip.wav: other bytes)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    inside_bytes, outside_bytes = _wav(0.5, 1), _wav(0.25, 2)
    (root / "d" / "clip.wav").write_bytes(inside_bytes)
    (outside / "clip.wav").write_bytes(outside_bytes)
    (root / "swap").symlink_to(outside, target_is_directory=True)
    return root, root / "d" / "clip.wav", inside_bytes, outside_bytes


@pytest.mark.parametrize("atomic", [True, False], ids=["renameat2", "three-renames"])
def test_swapping_a_folder_for_a_symlink_never_lets_a_job_read_outside(
    swapped_tree: tuple[Path, Path, bytes, bytes], atomic: bool
) -> None:
    root, clip, inside_bytes, outside_bytes = swapped_tree
    exchange = _exchanger(root / "d", root / "swap", atomic)
    limits = AudioLimits()
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        while not stop.is_set():
            exchange()
            swaps[0] += 1

    outcomes: Counter[str] = Counter()
    escaped: list[str] = []
    strays: list[str] = []
    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    try:
        for job in range(JOBS):
            try:
                source = resolve_allowed(str(clip), [root])
                if job % 2:
                    with open_input(source) as stream:
                        data = stream.read()
                    if data == outside_bytes:
                        escaped.append(f"open_input read the outside file ({source})")
                    outcomes["ok" if data == inside_bytes else "other bytes"] += 1
                else:
                    samples = load_audio(source, limits).samples
                    if len(samples) == 4000:
                        escaped.append(f"load_audio decoded the outside clip ({source})")
                    outcomes["ok" if len(samples) == 8000 else "other clip"] += 1
            except VoxmillError as exc:
                outcomes[exc.code] += 1
                if exc.code not in CODES or exc.code == INTERNAL:
                    strays.append(f"{exc.code}: {exc.message}")
            except Exception as exc:  # the very thing this test is about
                outcomes[type(exc).__name__] += 1
                strays.append(f"{type(exc).__name__}: {exc}")
    finally:
        stop.set()
        thread.join(10)
    summary = f"{swaps[0]} swaps, outcomes {dict(outcomes)}"
    print(summary)
    assert not escaped, f"{len(escaped)} of {JOBS} jobs read outside the root: {escaped[:3]} ({summary})"
    assert not strays, f"errors outside the catalogue: {strays[:3]} ({summary})"
    assert set(outcomes) <= {"ok", FORBIDDEN_PATH, NOT_FOUND, UNREADABLE}, summary
    assert outcomes["ok"] > 0 and outcomes[FORBIDDEN_PATH] > 0, summary  # the race really ran both ways


def test_a_confined_path_names_its_real_path_and_root(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(_wav(0.1, 3))
    source = resolve_allowed(str(tmp_path / "x" / ".." / "a.wav"), [tmp_path])
    assert isinstance(source, ConfinedPath)
    assert source.path == (tmp_path / "a.wav").resolve() and source.root == str(tmp_path.resolve())
    assert os.fspath(source) == str(source) == str((tmp_path / "a.wav").resolve())
    assert len(load_audio(source, AudioLimits()).samples) == 1600


def test_a_symlink_that_appears_after_the_check_is_refused_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "a.wav").write_bytes(_wav(0.1, 4))
    (outside / "a.wav").write_bytes(_wav(0.2, 5))
    source = resolve_allowed(str(root / "d" / "a.wav"), [root])
    os.rename(root / "d", root / "d.old")
    (root / "d").symlink_to(outside, target_is_directory=True)  # a folder became a symlink
    for read in (lambda: load_audio(source, AudioLimits()), lambda: open_input(source).close()):
        with pytest.raises(VoxmillError) as caught:
            read()
        assert caught.value.code == FORBIDDEN_PATH and "symlink" in caught.value.message
    (root / "d").unlink()
    (root / "d").mkdir()
    os.symlink(outside / "a.wav", root / "d" / "a.wav")  # the file itself became a symlink
    with pytest.raises(VoxmillError) as file_link:
        load_audio(source, AudioLimits())
    assert file_link.value.code == FORBIDDEN_PATH
    (root / "d" / "a.wav").unlink()
    with pytest.raises(VoxmillError) as gone:
        load_audio(source, AudioLimits())
    assert gone.value.code == NOT_FOUND


def test_a_fifo_below_a_root_is_refused_without_being_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.wav")
    source = resolve_allowed(str(tmp_path / "pipe.wav"), [tmp_path])
    for read in (lambda: load_audio(source, AudioLimits()), lambda: open_input(source).close()):
        with pytest.raises(VoxmillError) as caught:
            read()  # a blocking open of a FIFO would hang here
        assert caught.value.code == UNREADABLE and "not a regular file" in caught.value.message


def test_the_fallback_decoder_reads_the_opened_file_not_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """audioread opens a name by itself: it gets the descriptor's /proc name, so swapping the
    folder between voxmill's open and the decoder's changes nothing."""
    import audioread
    import soundfile as sf

    from pipeline.audio import sources

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "a.wav").write_bytes(_wav(0.5, 6))
    (outside / "a.wav").write_bytes(_wav(0.25, 7))
    source = resolve_allowed(str(root / "d" / "a.wav"), [root])
    names: list[str] = []
    real_open = audioread.audio_open

    def swap_then_open(path: str, *args: object, **kwargs: object) -> object:
        if not names:
            os.rename(root / "d", root / "d.old")
            (root / "d").symlink_to(outside, target_is_directory=True)
        names.append(path)
        return real_open(path, *args, **kwargs)

    def refuse() -> None:
        raise sf.LibsndfileError(1, "Error opening: ")

    monkeypatch.setattr(audioread, "audio_open", swap_then_open)
    monkeypatch.setattr(sources.Opened, "soundfile", lambda self: refuse())
    clip = load_audio(source, AudioLimits())
    assert clip.codec == "audioread" and len(clip.samples) == 8000  # the inside clip
    assert names and all(name.startswith(f"/proc/{os.getpid()}/fd/") for name in names)


def test_a_root_or_a_folder_below_it_is_refused_as_a_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for path in (tmp_path, tmp_path / "sub"):
        source = resolve_allowed(str(path), [tmp_path])
        with pytest.raises(VoxmillError) as caught:
            load_audio(source, AudioLimits())
        assert caught.value.code == UNREADABLE and "is a directory, not an audio file" in caught.value.message
