"""The TOML config: `[model]`, `[request]`, `[engine]`, `[spec]`, `[server]`.

Every key has a default here; a config file or `--set section.key=value`
overrides it. An unknown section or key, or a value of the wrong type, stops
the start with a message naming it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from completer.engine.config import EngineConfig, SpecConfig
from completer.engine.request import Mode


class ModelSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str = "default"  # "default" (SmolLM2-135M, fetched once), "embedded", a GGUF file or an HF directory
    draft: str = "default"  # "default" (the drafter made for the target, if any), "embedded", a path, "" for none
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"  # auto: bf16 where native, else fp32
    device: str = "cpu"  # "cpu" or "cuda" (or "cuda:N")
    template: str = ""  # FIM template; "" detects it from the tokenizer
    order: str = ""  # "psm" / "spm" to override the template's order
    context_tokens: int = 1024  # prompt + completion window


class RequestSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Defaults for what a request leaves out (every caller reads them here)."""

    max_tokens: int = 64
    deadline_ms: float = 2000.0
    mode: Mode = "line"


class ServerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8750
    token: str = ""  # "" reads (or creates) token_file
    token_file: str = ""  # "" = the per-user default path
    allowed_origins: list[str] = []
    tls_cert: str = ""
    tls_key: str = ""
    max_frame_bytes: int = 4 * 2**20
    max_document_chars: int = 2_000_000
    max_inflight_per_connection: int = 8
    max_connections: int = 64
    send_queue_frames: int = 256  # frames waiting behind a stalled reader before it is disconnected


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelSection = ModelSection()
    request: RequestSection = RequestSection()
    engine: EngineConfig = EngineConfig()
    spec: SpecConfig = SpecConfig()
    server: ServerSection = ServerSection()


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and the key."""


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"


def parse_override(item: str) -> tuple[str, str, object]:
    """`section.key=value`; the value is read as TOML (so 8, true, "x", [..]),
    or taken as a plain string when it is not valid TOML."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key, value


def load_config(path: Path | None = None, overrides: list[str] = ()) -> Config:
    source = str(path) if path else "defaults"
    raw: dict = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
    for key in ("max_tokens", "deadline_ms"):
        if key in raw.get("engine", {}):
            raise ConfigError(f"{source}: engine.{key} is now request.{key}")
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        # msgspec names the key: "Object contains unknown field `x` - at `$.engine`".
        raise ConfigError(f"{source}: {e}") from None
