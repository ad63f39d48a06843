"""Fixtures the unit tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.models.standin import make_standins


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of tiny stand-in models, one per test module (a module may change its files)."""
    folder = tmp_path_factory.mktemp("models")
    make_standins(folder)
    return folder
