"""Fixtures of the integration tests that replace model files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def models(tiny_models: Path, tmp_path: Path) -> Path:
    """This test's own copy of the tiny stand-ins, free to replace, truncate and delete."""
    folder = tmp_path / "models"
    shutil.copytree(tiny_models, folder)
    return folder
