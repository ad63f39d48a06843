"""The command line as a new user meets it: clear errors with the fix, help that reads, no tracebacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer.main

from tests.conftest import voxmill
from workers.cli import app


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_version() -> None:
    done = voxmill("--version")
    assert done.returncode == 0 and done.stdout.startswith("voxmill ")


def test_os_errors_are_one_line_naming_the_path(tmp_path: Path) -> None:
    done = voxmill("models", "make-standin", "--out", "/proc/nope")
    assert done.returncode == 2 and "/proc/nope" in one_error_line(done.stderr)
    existing = tmp_path / "a-file"
    existing.write_text("x")
    done = voxmill("models", "make-standin", "--out", str(existing))
    assert done.returncode == 2 and str(existing) in one_error_line(done.stderr)


def test_up_and_worker_refuse_a_missing_model_folder_at_once_with_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no-models"
    for command in (["up", "--workers", "1"], ["worker", "-c", "1"]):
        done = voxmill(
            *command, "--models", str(missing), env={"VOXMILL_BROKER_URL": "redis://127.0.0.1:1/0"}
        )
        line = one_error_line(done.stderr)
        assert done.returncode == 2 and f"model folder {missing} does not exist" in line
        assert "--models demo/models" in line and "VOXMILL_MODEL_DIR" in line


def test_extract_says_an_out_that_is_a_file_is_one_and_how_to_make_a_missing_model_folder(
    tmp_path: Path, tiny_models: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"utt": "a", "path": "a.wav"}\n')
    existing = tmp_path / "a-file"
    existing.write_text("x")
    done = voxmill("extract", str(corpus), "--out", str(existing), "--models", str(tiny_models))
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and f"{existing}: it is a file, not a folder" in line
    missing = tmp_path / "no-models"
    done = voxmill("extract", str(corpus), "--out", str(tmp_path / "out"), "--models", str(missing))
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and f"model folder {missing} does not exist" in line
    assert f"`voxmill models make-standin --out {missing}`" in line  # as an empty folder's error says
    assert not (tmp_path / "out").exists()


def test_up_refuses_a_folder_without_the_models_its_queues_need(tmp_path: Path) -> None:
    done = voxmill("up", "--workers", "1", "--models", str(tmp_path), "-Q", "embed")
    assert done.returncode == 2 and "no embedder model" in one_error_line(done.stderr)


def test_extract_on_a_broker_that_never_answered_fails_at_once(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"utt": "a", "path": "a.wav"}\n')
    out = tmp_path / "out"
    done = voxmill(
        "extract", str(corpus), "--out", str(out), env={"VOXMILL_BROKER_URL": "redis://127.0.0.1:1/0"}
    )
    assert done.returncode == 2 and "cannot reach the broker at redis://127.0.0.1:1/0" in done.stderr
    assert not (out / "plan").exists()


def test_every_option_and_argument_explains_itself() -> None:
    def commands(group: Any, prefix: str) -> list[tuple[str, Any]]:
        found = []
        for name, command in group.commands.items():
            if hasattr(command, "commands"):  # a group (`voxmill models`)
                found += commands(command, f"{prefix}{name} ")
            else:
                found.append((prefix + name, command))
        return found

    for name, command in commands(typer.main.get_command(app), ""):
        assert command.help and "\n\n" not in (command.short_help or ""), name
        for param in command.params:
            assert getattr(param, "help", None), f"voxmill {name}: {param.name} has no help"
            if param.name in ("workers", "concurrency"):
                assert not param.show_default, f"voxmill {name} --{param.name} shows a default of 0"


def test_help_reads_as_sentences_on_80_columns() -> None:
    done = voxmill("worker", "--help", env={"COLUMNS": "80"})
    text = " ".join(done.stdout.split())
    assert "voxmill never revokes tasks, so a worker does not spend a second at start" in text


HELP_COLUMNS = 80
MIN_HELP_WIDTH = 36  # of 80: the text beside each option is at least this wide (it was 23 for extract)


def help_text_width(help_page: str) -> dict[str, int]:
    """Per panel of a `--help` page (Options, Arguments...), how wide its help-text column is.

    A panel is a box of lines `│ ... │`; a line whose option column is empty continues the help
    text of the row above, so its indentation is where the help text starts: the column is what
    is left of the box's inside from there.
    """
    widths: dict[str, int] = {}
    panel = ""
    for line in help_page.splitlines():
        if line.startswith("╭─"):
            panel = line.strip("╭─╮ ").split(" ")[0]
        elif line.startswith("│") and line.rstrip().endswith("│") and panel:
            inside = line.rstrip()[1:-1]
            text = inside.lstrip(" ")
            start = len(inside) - len(text)
            if text and start >= 10:  # a continuation line (an option row starts within 4)
                widths[panel] = min(widths.get(panel, len(inside)), len(inside) - start)
    return widths


def test_no_command_squeezes_its_help_text_on_80_columns() -> None:
    """Every command's help: each panel's help-text column is at least MIN_HELP_WIDTH of 80."""
    group = typer.main.get_command(app)
    commands = [[name] for name in group.commands if name != "models"]  # type: ignore[attr-defined]
    commands += [["models", name] for name in group.commands["models"].commands]  # type: ignore[attr-defined]
    squeezed = {}
    for command in commands:
        done = voxmill(*command, "--help", env={"COLUMNS": str(HELP_COLUMNS)})
        assert done.returncode == 0, done.stderr
        assert max(len(line) for line in done.stdout.splitlines()) <= HELP_COLUMNS
        narrow = {p: w for p, w in help_text_width(done.stdout).items() if w < MIN_HELP_WIDTH}
        if narrow:
            squeezed[" ".join(command)] = narrow
    assert squeezed == {}, f"help text narrower than {MIN_HELP_WIDTH} of {HELP_COLUMNS} columns: {squeezed}"
    extract = voxmill("extract", "--help", env={"COLUMNS": str(HELP_COLUMNS)}).stdout
    assert help_text_width(extract)["Options"] >= MIN_HELP_WIDTH  # the panel the test is about, measured


WIDE = {"COLUMNS": "200"}  # an error in one box line


def test_extract_refuses_a_filter_out_of_its_range(tmp_path: Path) -> None:
    for option, value, why in (
        ("--min-speech-ratio", "1.5", "1.5 is not a fraction from 0 to 1"),
        ("--max-clipped", "-0.1", "-0.1 is not a fraction from 0 to 1"),
        ("--min-duration", "-1", "-1 is not a number of seconds (0 or more)"),
    ):
        done = voxmill("extract", str(tmp_path), "--out", str(tmp_path / "out"), option, value, env=WIDE)
        assert done.returncode == 2 and why in done.stderr, done.stderr
        assert not (tmp_path / "out").exists()
