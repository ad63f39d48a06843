"""What an embedded run lets its own workers read: the folders its corpus names, however many,
and nothing above them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.corpus.roots import corpus_roots, outermost_folders
from pipeline.outputs.folder import RunFolder
from pipeline.settings import Settings
from workers.corpus.cluster import EmbeddedCluster


def test_nested_folders_collapse_into_the_outer_one_and_nothing_widens() -> None:
    folders = ["/a/b", "/a/b/c/", "/a/bc", "/a/b/../c", "/x/y", "/x/y/z/w", "/p/q/..", "/p/q", "", "rel"]
    assert outermost_folders(folders) == ["/a/b", "/a/b/../c", "/a/bc", "/p/q", "/p/q/..", "/x/y"]
    assert outermost_folders(["/a", "/"]) == ["/"]


def test_the_roots_of_a_corpus_are_its_folders_not_their_common_ancestor(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    lines = [{"utt": f"u{i}", "path": f"/corpus/spk{i:04d}/ch{i % 2}/u{i}.wav"} for i in range(300)]
    lines.append({"utt": "nested", "path": "/corpus/spk0001/ch1/deeper/n.wav"})  # below a listed folder
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    folders, prefixes = corpus_roots(manifest)
    assert prefixes == []
    assert len(folders) == 300 and Path("/corpus") not in folders
    assert folders[:2] == [Path("/corpus/spk0000/ch0"), Path("/corpus/spk0001/ch1")]


def test_thousands_of_folders_reach_the_workers_in_a_private_file_not_the_environment(
    tmp_path: Path, tiny_models: Path
) -> None:
    folders = [Path(f"/data/{'d' * 100}{i:05d}") for i in range(5000)]  # ~550 kB of ':'-joined roots
    settings = Settings(model_dir=tiny_models, allowed_roots=(tmp_path / "mine",))
    cluster = EmbeddedCluster(settings, folders, RunFolder.of(tmp_path / "out"), ["embed"], 1)
    try:
        env = cluster.settings.to_env()
        assert max(len(value) for value in env.values()) < 4096  # far below Linux's 128 kB per variable
        roots_file = Path(env["VOXMILL_ALLOWED_ROOTS_FILE"])
        assert roots_file.stat().st_mode & 0o777 == 0o600
        assert (roots_file.parent.stat().st_mode & 0o777) == 0o700
        child = Settings.load(env)  # what a local worker reads
        assert set(child.roots()) == {
            (tmp_path / "mine").resolve(),
            (tmp_path / "out").resolve(),
            *(f.resolve() for f in folders),
        }
        assert env["VOXMILL_ALLOWED_ROOTS"] == f"{tmp_path / 'mine'}:{(tmp_path / 'out').resolve()}"
    finally:
        cluster.stop()
    assert not roots_file.exists()


def test_a_roots_file_others_may_write_is_refused(tmp_path: Path) -> None:
    listed = tmp_path / "roots.txt"
    listed.write_text("/data/a\n/data/b c\n")
    os.chmod(listed, 0o644)
    assert Settings(allowed_roots_file=listed).roots() == (Path("/data/a"), Path("/data/b c"))
    os.chmod(listed, 0o666)
    with pytest.raises(ValueError, match="may be written by others"):
        Settings(allowed_roots_file=listed).roots()
