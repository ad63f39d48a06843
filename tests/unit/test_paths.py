"""Confinement of path jobs to the allowed roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.errors import BAD_REQUEST, FORBIDDEN_PATH, VoxmillError
from pipeline.storage.paths import Roots, confine_path, is_within, real_path, resolve_allowed_path


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


def _forbidden(path: str | Path, roots: list[Path] | Roots, base: Path | None = None) -> VoxmillError:
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


# --------------------------------------------------------------------------- budgets and scale


@pytest.mark.parametrize("shape", ["a/", "/", "../", "./"])
def test_a_multi_megabyte_path_is_a_bad_request_before_any_path_call(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    root, _ = tree
    huge = shape * (3 * 1024 * 1024 // len(shape)) + "a.wav"  # realpath is quadratic in its '/'

    def no_path_calls(*args: object) -> None:
        raise AssertionError("a path call ran on a string over the limit")

    monkeypatch.setattr(os.path, "realpath", no_path_calls)
    with pytest.raises(VoxmillError) as info:
        resolve_allowed_path(huge, [root], base=root)
    assert info.value.code == BAD_REQUEST
    assert info.value.message == f"path is {len(huge)} characters long; the limit is 4096 (max_text_chars)"
    assert huge[:100] not in info.value.message  # never echoed


def test_the_length_limit_is_a_parameter_and_counts_characters(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    name = "é" * 60 + ".wav"
    (root / name).write_bytes(b"x")
    assert resolve_allowed_path(name, [root], base=root, max_chars=64) == (root / name).resolve()
    with pytest.raises(VoxmillError) as info:
        resolve_allowed_path(name, [root], base=root, max_chars=63)
    assert info.value.code == BAD_REQUEST and "64 characters long; the limit is 63" in info.value.message


def test_a_path_that_changes_while_it_is_resolved_is_forbidden_not_an_oserror(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = tree

    def racing(path: str) -> str:  # what realpath raises when a symlink it lstat'ed is a folder again
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os.path, "realpath", racing)
    error = _forbidden("a.wav", [Path("/")], base=root)
    assert "changed while it was being resolved (Invalid argument)" in error.message


def test_roots_are_resolved_once_and_found_by_walking_the_folders(
    tree: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, outside = tree
    many = [tmp_path / f"corpus-{n}" / "wav" for n in range(5000)] + [root]
    roots = Roots.of(many)
    assert roots.paths[-1] == str(root.resolve()) and len(roots.paths) == 5001
    expected = (root / "a.wav").resolve()
    calls: list[str] = []
    real = os.path.realpath

    def counted(path: str, **kwargs: bool) -> str:
        calls.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(os.path, "realpath", counted)
    assert resolve_allowed_path(root / "a.wav", roots) == expected
    assert len(calls) == 1  # the candidate only, never a root
    error = _forbidden(outside / "secret.wav", roots)
    assert "corpus-0/wav" in error.message and "and 4996 more" in error.message  # five shown
    assert len(error.message) < 1000


def test_the_root_set_answers_exactly_as_is_within(tmp_path: Path) -> None:
    roots = ["/", "/data", "/data/a", "/srv/x y", "/database"]
    candidates = ["/", "/data", "/data/", "/data/a", "/data/ab", "/data/a/b.wav", "/database/x",
                  "/datab", "/srv/x y/z", "/srv/x", "/srv", "/d", "/data/a/../b"]  # fmt: skip
    for chosen in ([], *([r] for r in roots), roots[1:], roots[2:4]):
        found = Roots(tuple(chosen))
        for candidate in candidates:
            inside = [r for r in chosen if is_within(candidate, r)]
            deepest = max(inside, key=len) if inside else None
            assert found.root_of(candidate) == deepest, (chosen, candidate)


def test_real_paths_through_kept_folders_equal_realpath(tree: tuple[Path, Path], tmp_path: Path) -> None:
    root, outside = tree
    (root / "sub").mkdir()
    (root / "sub" / "b.wav").write_bytes(b"x")
    (root / "link.wav").symlink_to(outside / "secret.wav")  # a file that is a symlink
    (root / "dirlink").symlink_to(outside)  # a folder that is one
    (root / "loop").symlink_to(root / "loop")
    names = ["a.wav", "link.wav", "sub/b.wav", "sub/../a.wav", "dirlink/secret.wav", "missing.wav",
             "sub/missing/c.wav", "sub/.", "sub/..", "sub/", "loop", "dirlink/../a.wav", "./a.wav"]
    folders: dict[str, str] = {}
    for name in names * 2:  # the second time from the kept folders
        path = os.path.join(str(root), name)
        assert real_path(path, folders) == os.path.realpath(path), name
    assert folders[str(root)] == os.path.realpath(root)
    with pytest.raises(VoxmillError) as info:  # the jail holds through the kept folders too
        confine_path(root / "link.wav", [root], folders=folders)
    assert info.value.code == FORBIDDEN_PATH
