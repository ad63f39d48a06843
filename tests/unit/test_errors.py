"""pipeline/errors.py: one tree of errors, one catalogue of codes, and the README lists them all."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.errors import CODES, ModelUnavailable, RunError, VoxmillError
from workers.corpus.cluster import NoRunConsumer
from workers.embedded import ProcessExited
from workers.observe.run_metrics import RunMetricsPortError
from workers.queue.client import BrokerNotConfigured, NoConsumer

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_names_every_code() -> None:
    named = set(re.findall(r"`([a-z_]+)`", README.read_text().split("Error codes are stable", 1)[1][:2500]))
    assert set(CODES) <= named, sorted(set(CODES) - named)


def test_codes_are_unique() -> None:
    assert len(set(CODES)) == len(CODES)


@pytest.mark.parametrize(
    "error, code",
    [
        (RunError("the listing is malformed"), "run_error"),
        (RunMetricsPortError("port 9466 is taken"), "run_error"),
        (BrokerNotConfigured(), "no_broker"),
        (NoConsumer("embed"), "no_consumer"),
        (NoRunConsumer(["tokenize"], "no live worker consumes the tokenize queue"), "no_consumer"),
        (ProcessExited("the local worker exited with code 1"), "process_exited"),
        (ModelUnavailable("no tokenizer loaded yet"), "model_error"),
    ],
)
def test_every_failure_is_a_voxmill_error_with_a_catalogue_code(error: VoxmillError, code: str) -> None:
    assert isinstance(error, VoxmillError)
    assert error.code == code and error.code in CODES
    assert error.to_dict() == {"code": code, "message": error.message} and error.message
