"""What `voxmill status` and `voxmill models list|verify` print reads on an 80-column terminal."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from workers.models import describe_folder, render_models
from workers.observe.status_view import render_status

A, B, C = "a" * 64, "b" * 64, "c" * 64


def printed(render: object, *args: object) -> list[str]:
    console = Console(width=80, record=True, soft_wrap=False)
    render(*args, console)  # type: ignore[operator]
    return console.export_text().splitlines()


def test_status_fits_80_columns_and_says_everything() -> None:
    worker = {
        "worker_id": "gpu-node-17.cluster.local:123456",
        "queues": ["tokenize", "embed", "extract"],
        "pool": "prefork",
        "tasks_done": 1234,
        "tasks_last_minute": 56,
        "last_seen": time.time(),
        "aside": True,
        "models": {
            "tokenizer": {"sha256": A, "generation": 2},
            "embedder": {"sha256": B, "generation": None},
        },
        "load_errors": {},
    }
    report = {
        "broker": "redis://:***@redis-host:6379/0",
        "queues": {"tokenize": 0, "embed": 3, "extract": 0},
        "throughput": {"tasks_last_minute": 56, "per_second": 0.933},
        "workers": [worker],
        "models": {
            "tokenizer": {
                "published": {"sha256": A, "generation": 2},
                "validating": [{"sha256": C}],
                "serving": {A: ["gpu-node-17.cluster.local:123456"]},
                "last_rejection": {
                    "file": "speech_tokenizer_v2.onnx",
                    "sha256": C,
                    "time": time.time(),
                    "reason": "x",
                },
                "reload_failures": {},
            },
            "embedder": {"published": None, "validating": [], "serving": {}, "last_rejection": None},
        },
    }
    lines = printed(render_status, report)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert "gpu-node-17.cluster.local:123456 (aside: reloading)" in text
    assert "tokenizer aaaaaaaaaaaa (generation 2)" in text and "embed 3 waiting" in text
    assert "(validating cccccccccccc)" in text and "last rejection: speech_tokenizer_v2.onnx" in text


def test_models_list_and_verify_fit_80_columns(tiny_models: Path, tmp_path: Path) -> None:
    for rows in (
        describe_folder(tiny_models, load=False),
        describe_folder(tiny_models, load=True),
        describe_folder(tmp_path / "empty", load=True),
    ):
        lines = printed(render_models, rows)
        assert max(len(line) for line in lines) <= 80, "\n".join(lines)
        assert len(lines) <= 3 * len(rows)
    listed = "\n".join(printed(render_models, describe_folder(tiny_models, load=False)))
    assert "speech_tokenizer_v2.onnx" in listed and "campplus.onnx" in listed  # names never cut
