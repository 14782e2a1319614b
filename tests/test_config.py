"""Config: defaults, the shipped TOML files, overrides, and errors naming the key."""

from pathlib import Path

import pytest

from completer.config import Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), Config)


def test_default_toml_matches_defaults():
    assert load_config(CONFIGS / "default.toml") == Config()


def test_overrides_are_typed():
    cfg = load_config(None, ["engine.prefix_cache=false", "spec.max_batch=4",
                             "server.allowed_origins=[\"http://x\"]", "model.target=/tmp/m"])
    assert cfg.engine.prefix_cache is False and cfg.spec.max_batch == 4
    assert cfg.server.allowed_origins == ["http://x"] and cfg.model.target == "/tmp/m"


@pytest.mark.parametrize("override, needle", [
    ("engine.prefix_cahce=true", "prefix_cahce"),
    ("turbo.on=true", "turbo"),
    ("spec.max_batch=lots", "max_batch"),
    ("nodot=1", "section.key=value"),
])
def test_bad_keys_are_named(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[engine]\nkv_cache_mb = \n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "unknown.toml").write_text("[engine]\nwarp = 9\n")
    with pytest.raises(ConfigError, match=r"unknown.toml: .*warp"):
        load_config(tmp_path / "unknown.toml")
