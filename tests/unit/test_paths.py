"""Confinement of path jobs to the allowed roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.errors import BAD_REQUEST, FORBIDDEN_PATH, VoxmillError
from pipeline.paths import is_within, resolve_allowed_path


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A root `data/` holding `a.wav`, and a sibling `outside/` holding `secret.wav`."""
    root = tmp_path / "data"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a.wav").write_bytes(b"x")
    (outside / "secret.wav").write_bytes(b"x")
    return root, outside


def _forbidden(path: str | Path, roots: list[Path], base: Path | None = None) -> VoxmillError:
    with pytest.raises(VoxmillError) as info:
        resolve_allowed_path(path, roots, base=base)
    assert info.value.code == FORBIDDEN_PATH
    return info.value


def test_is_within() -> None:
    assert is_within(Path("/data/a/b.wav"), Path("/data"))
    assert is_within(Path("/data"), Path("/data"))
    assert not is_within(Path("/database/x.wav"), Path("/data"))
    assert not is_within(Path("/"), Path("/data"))
    assert is_within("/data/a.wav", "/") and is_within("/", "/")


def test_file_inside_root_resolves_to_its_real_path(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    assert resolve_allowed_path(root / "a.wav", [root]) == (root / "a.wav").resolve()


def test_dotdot_escape_is_forbidden(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    error = _forbidden(root / ".." / "outside" / "secret.wav", [root])
    assert "outside the allowed roots" in error.message
    assert str(root.resolve()) in error.message


def test_dotdot_that_stays_inside_is_allowed(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    (root / "sub").mkdir()
    assert resolve_allowed_path(root / "sub" / ".." / "a.wav", [root]) == (root / "a.wav").resolve()


def test_absolute_path_outside_is_forbidden(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    error = _forbidden("/etc/passwd", [root])
    assert error.message.startswith(f"path /etc/passwd is outside the allowed roots ({root.resolve()}); ")
    assert "VOXMILL_ALLOWED_ROOTS" in error.message and "--bytes" in error.message


def test_prefix_sibling_is_not_inside(tree: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = tree
    sibling = tmp_path / "data2"
    sibling.mkdir()
    (sibling / "b.wav").write_bytes(b"x")
    _forbidden(sibling / "b.wav", [root])


def test_symlink_pointing_outside_is_forbidden(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    link = root / "link.wav"
    link.symlink_to(outside / "secret.wav")
    _forbidden(link, [root])


def test_symlinked_directory_pointing_outside_is_forbidden(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    (root / "escape").symlink_to(outside, target_is_directory=True)
    _forbidden(root / "escape" / "secret.wav", [root])


def test_symlink_inside_to_inside_is_allowed(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    link = root / "alias.wav"
    link.symlink_to(root / "a.wav")
    assert resolve_allowed_path(link, [root]) == (root / "a.wav").resolve()


def test_root_given_through_a_symlink_still_matches(tree: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = tree
    root_link = tmp_path / "root-link"
    root_link.symlink_to(root, target_is_directory=True)
    assert resolve_allowed_path(root / "a.wav", [root_link]) == (root / "a.wav").resolve()


def test_unicode_and_spaces_are_allowed(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    name = root / "ñandú voix été" / "clip №1 — 声.wav"
    name.parent.mkdir()
    name.write_bytes(b"x")
    assert resolve_allowed_path(str(name), [root]) == name.resolve()


def test_relative_path_is_taken_against_base(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    assert resolve_allowed_path("a.wav", [root], base=root) == (root / "a.wav").resolve()
    _forbidden("../outside/secret.wav", [root], base=root)


def test_relative_path_defaults_to_cwd(tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = tree
    monkeypatch.chdir(root)
    assert resolve_allowed_path("a.wav", [root]) == (root / "a.wav").resolve()
    monkeypatch.chdir(outside)
    _forbidden("a.wav", [root])


def test_missing_file_inside_is_returned_for_the_caller_to_report(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    resolved = resolve_allowed_path(root / "nope.wav", [root])
    assert resolved == root.resolve() / "nope.wav"
    assert not resolved.exists()


def test_missing_file_outside_is_forbidden_not_missing(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    _forbidden(outside / "nope.wav", [root])


def test_any_of_several_roots(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    assert resolve_allowed_path(outside / "secret.wav", [root, outside]) == (outside / "secret.wav").resolve()


def test_no_roots_forbids_everything(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    _forbidden(root / "a.wav", [])


@pytest.mark.parametrize("bad", ["a\x00.wav", "/data/\x00/../etc/passwd"])
def test_nul_byte_is_a_bad_request(tree: tuple[Path, Path], bad: str) -> None:
    root, _ = tree
    with pytest.raises(VoxmillError) as info:
        resolve_allowed_path(bad, [root], base=root)
    assert info.value.code == BAD_REQUEST
    assert "NUL" in info.value.message


def test_empty_path_is_a_bad_request(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(VoxmillError) as info:
        resolve_allowed_path("", [root], base=root)
    assert info.value.code == BAD_REQUEST


def test_result_is_absolute_and_has_no_symlinks(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    (root / "alias.wav").symlink_to("a.wav")
    resolved = resolve_allowed_path("alias.wav", [root], base=root)
    assert resolved.is_absolute()
    assert os.path.realpath(resolved) == str(resolved)
