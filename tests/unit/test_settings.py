"""Settings: one place per default, the YAML file rendered from it, the environment on top."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.settings import DEFAULT_CONFIG, SECTIONS, Settings, render_config


def test_config_file_is_rendered_from_the_settings() -> None:
    assert DEFAULT_CONFIG.read_text() == render_config(), (
        "config/voxmill.yaml is stale: run `python -m pipeline.settings > config/voxmill.yaml`"
    )


def test_every_setting_is_in_the_file_with_its_default_and_explained() -> None:
    from_file = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert set(from_file) == set(Settings.model_fields)
    assert Settings(**from_file) == Settings()
    assert all(info.description for info in Settings.model_fields.values())
    assert set(SECTIONS) <= set(Settings.model_fields)


def test_the_environment_overrides_the_file(tmp_path: Path) -> None:
    config = tmp_path / "voxmill.yaml"
    config.write_text("shard_size: 8\nallowed_roots: [/a]\n")
    settings = Settings.load({"VOXMILL_SHARD_SIZE": "16", "VOXMILL_ALLOWED_ROOTS": "/b:/c"}, config)
    assert settings.shard_size == 16 and settings.allowed_roots == (Path("/b"), Path("/c"))
    assert Settings.load({}, config).shard_size == 8


def test_settings_travel_to_a_child_process_intact() -> None:
    settings = Settings(broker_url="redis://127.0.0.1:1/0", allowed_roots=(Path("/a"), Path("/b")))
    assert Settings.load(settings.to_env(), Path("/nonexistent.yaml")) == settings
