"""The output lock: one `voxmill extract` writes a folder at a time; a store's marker object
belongs to a live run only while it is refreshed and, on this host, its process exists."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import RunError
from pipeline.outputs.folder import RunFolder
from pipeline.run.lock import LOCK_STALE_S, lock_output, marker_is_live


def test_a_local_folder_is_locked_once_until_its_run_ends(tmp_path: Path) -> None:
    folder = RunFolder.of(tmp_path / "out")
    held = lock_output(folder, tmp_path / "state")
    try:
        with pytest.raises(RunError, match="another `voxmill extract` is running on"):
            lock_output(folder, tmp_path / "state")
        other = lock_output(RunFolder.of(tmp_path / "other"), tmp_path / "state")  # another folder
        other.close()
    finally:
        held.close()
    lock_output(folder, tmp_path / "state").close()  # free again once the first run ended


def test_a_marker_is_live_while_refreshed_and_its_process_exists() -> None:
    host, now = socket.gethostname(), time.time()
    mine = {"host": host, "pid": os.getpid(), "refreshed": now - 1}
    assert marker_is_live(mine, host, now)
    assert not marker_is_live({**mine, "refreshed": now - LOCK_STALE_S - 1}, host, now)  # stale
    exited = [sys.executable, "-c", "import os; print(os.getpid())"]
    gone = subprocess.run(exited, capture_output=True, text=True, check=True)
    dead = {**mine, "pid": int(gone.stdout)}
    assert not marker_is_live(dead, host, now)  # its process on this host is gone
    assert marker_is_live(dead, "another-host", now)  # a pid elsewhere cannot be looked at
    assert not marker_is_live({"refreshed": "yesterday"}, host, now)  # written by hand: not a run
