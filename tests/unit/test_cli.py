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
