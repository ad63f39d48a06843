"""Every README command a new user copies, run as written, in order, against the demo.

The README's ```sh and ```python blocks run in one folder where `voxmill demo --dir demo` has
run (what `make demo` does), with `.venv/bin` on the PATH (what `source .venv/bin/activate`
does). A block that cannot run unattended says so in a `<!-- readme-test: skip (why) -->` line
above it. The line that starts `voxmill up` runs in the background, as in the README's first
shell; the `export VOXMILL_BROKER_URL=...` it prints is the environment of every later block,
as in the README's second shell. A python block that ends with a `# ...` comment after a print
must print exactly that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import clean_env, wait_for

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = str(Path(sys.executable).parent)
SKIP = re.compile(r"<!-- readme-test: skip \((.+)\) -->")
UP_LINE = re.compile(r"^(\w+=\S+ )*voxmill up\b")  # `VAR=value ... voxmill up ...`
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    text: str
    skip: str | None


def readme_blocks() -> list[Block]:
    text = README.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        skip = SKIP.fullmatch(before[-1].strip()) if before else None
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(line, match.group(1), match.group(2), skip.group(1) if skip else None))
    return blocks


def test_the_readme_has_blocks_to_run_and_every_skip_says_why() -> None:
    blocks = readme_blocks()
    assert sum(b.skip is None for b in blocks) >= 6
    assert all(b.skip for b in blocks if "redis-host" in b.text or "make test" in b.text)


class Shells:
    """The README's two shells: `voxmill up` in the first, the rest in the second."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = clean_env({"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "100"})
        del self.env["VOXMILL_SPEECH_CHECK"]  # the README's own settings, not the tests'
        self.up: subprocess.Popen[str] | None = None
        self.up_output: list[str] = []

    def run(self, block: Block) -> str:
        if block.language == "python":
            return self._run([sys.executable, "-c", block.text], block)
        commands = block.text
        up_line = next((ln for ln in commands.splitlines() if UP_LINE.match(ln)), None)
        if up_line is not None:
            self.start_up(up_line)
            commands = commands.replace(up_line, "")
        return self._run(["bash", "-euo", "pipefail", "-c", commands], block) if commands.strip() else ""

    def _run(self, argv: list[str], block: Block) -> str:
        done = subprocess.run(
            argv, cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"README line {block.line}:\n{block.text}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start_up(self, line: str) -> None:
        self.up = subprocess.Popen(
            ["bash", "-c", line], cwd=self.folder, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        assert self.up.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            printed = self.up.stdout.readline()
            assert printed, "voxmill up ended before printing its export line:\n" + "".join(self.up_output)
            self.up_output.append(printed)
            found = re.search(r"export VOXMILL_BROKER_URL=(\S+)", printed)
            if found:
                self.env["VOXMILL_BROKER_URL"] = found.group(1)
                return
        raise AssertionError("no export line from voxmill up:\n" + "".join(self.up_output))

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            os.killpg(self.up.pid, signal.SIGINT)  # Ctrl-C, as the README says
            try:
                self.up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
                raise


def expected_print(block: Block) -> str | None:
    lines = block.text.rstrip().splitlines()
    if block.language == "python" and len(lines) > 1 and lines[-1].startswith("# ") and "print(" in lines[-2]:
        return lines[-1][2:]
    return None


@pytest.mark.slow
def test_every_readme_block_runs_as_written_against_the_demo(tmp_path: Path) -> None:
    shells = Shells(tmp_path)
    made = subprocess.run(
        [f"{BIN}/voxmill", "demo", "--dir", "demo", "--workers", "2"],
        cwd=tmp_path, env=shells.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    ran = []
    try:
        for block in readme_blocks():
            if block.skip:
                continue
            printed = shells.run(block)
            ran.append(block.line)
            wanted = expected_print(block)
            if wanted is not None:
                assert printed.strip() == wanted, f"README line {block.line} prints {printed!r}"
            if "cp /tmp/seed1/campplus.onnx demo/models/" in block.text:
                assert_the_reload_shows_in_status(shells)
        assert shells.up is not None, "the README starts no `voxmill up`"
    finally:
        shells.stop()
    assert shells.up.returncode == 0, "".join(shells.up_output)
    assert (tmp_path / "demo" / "report.html").stat().st_size > 10_000
    filtered = json.loads((tmp_path / "demo" / "out2" / "report.json").read_text())["filters"]
    assert filtered["min_duration_s"] == 1.5
    assert len(ran) >= 6


def assert_the_reload_shows_in_status(shells: Shells) -> None:
    """The README says: copy the new weights in, then `voxmill status` shows the swap."""

    def swapped() -> bool:
        done = subprocess.run(
            [f"{BIN}/voxmill", "status", "--json"], env=shells.env, capture_output=True, text=True, timeout=30
        )
        embedder = json.loads(done.stdout)["models"]["embedder"]
        published = embedder.get("published") or {}
        return published.get("generation") == 2 and list(embedder["serving"]) == [published.get("sha256")]

    wait_for(swapped, timeout_s=90, interval_s=1.0)
