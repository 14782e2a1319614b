"""Reading a config: the TOML file, then the `--set section.key=value`
overrides in order, then every section's checks; the first problem stops the
start with one line naming the key and where it was set (the file, or the
`--set` or flag that set it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from completer.config.cluster import ClusterConfig, cluster_problems
from completer.config.disagg import DisaggConfig, disagg_problems
from completer.config.engine import EngineConfig, SpecConfig, engine_problems, spec_problems
from completer.config.model import ModelSection, model_problems
from completer.config.problem import ConfigError, ConfigProblem
from completer.config.request import RequestSection, request_problems
from completer.config.server import CompatSection, ServerSection, compat_problems, server_problems


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelSection = ModelSection()
    request: RequestSection = RequestSection()
    engine: EngineConfig = EngineConfig()
    spec: SpecConfig = SpecConfig()
    server: ServerSection = ServerSection()
    compat: CompatSection = CompatSection()
    disagg: DisaggConfig = DisaggConfig()
    cluster: ClusterConfig = ClusterConfig()


DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"

# The least prompt worth completing from: request.max_tokens must leave this
# much of model.context_tokens to the prompt (at 0 or below, fitting a prompt
# into the window cannot succeed).
MIN_PROMPT_TOKENS = 64

SECTIONS: dict[str, type[msgspec.Struct]] = {
    "model": ModelSection, "request": RequestSection, "engine": EngineConfig, "spec": SpecConfig,
    "server": ServerSection, "compat": CompatSection, "disagg": DisaggConfig,
    "cluster": ClusterConfig,
}
RENAMED = {"engine.max_tokens": "request.max_tokens", "engine.deadline_ms": "request.deadline_ms"}


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


def load_config(path: Path | None = None, overrides: list[str] = (),
                spelled: dict[str, str] | None = None) -> Config:
    """The config in `path` (None: the defaults) with `section.key=value`
    overrides applied in order, checked.

    spelled: an override -> how the user wrote it (`--port 0` for the
    `server.port=0` that flag made), for messages; others are `--set ITEM`."""
    file_source = str(path) if path else "defaults"
    raw: dict = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    for name, new in RENAMED.items():
        section, key = name.split(".")
        if key in raw.get(section, {}):
            raise ConfigError(f"{file_source}: {name} is now {new}")
    _convert(raw, Config, file_source)  # the file's own mistakes are named as the file's
    set_by: dict[str, str] = {}  # "section.key" -> the override that set it last
    for item in overrides:
        where = (spelled or {}).get(item) or f"--set {item}"
        section, key, value = parse_override(item)
        if f"{section}.{key}" in RENAMED:
            raise ConfigError(f"{where}: {section}.{key} is now {RENAMED[f'{section}.{key}']}")
        if section not in SECTIONS:
            raise ConfigError(f"{where}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
        if key not in {f.name for f in msgspec.structs.fields(SECTIONS[section])}:
            raise ConfigError(f"{where}: unknown key {key!r} in [{section}]")
        # The section's other keys have defaults, so this checks the value's type alone.
        _convert({key: value}, SECTIONS[section], where)
        raw.setdefault(section, {})[key] = value
        set_by[f"{section}.{key}"] = where
    config = _convert(raw, Config, file_source)
    if found := problems(config):
        first = found[0]
        where = next((set_by[k] for k in first.keys if k in set_by), file_source)
        raise ConfigError(f"{where}: {first.message}")
    return config


def _convert(raw: dict, kind: type[msgspec.Struct], source: str):
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as e:
        # msgspec names the key: "Object contains unknown field `x` - at `$.engine`".
        raise ConfigError(f"{source}: {e}") from None


def problems(config: Config) -> list[ConfigProblem]:
    """Values that pass their types but cannot work, alone or together; each
    section's own first, then those across sections."""
    m, r = config.model, config.request
    found = engine_problems(config.engine) + spec_problems(config.spec) + disagg_problems(config.disagg) \
        + cluster_problems(config.cluster) + model_problems(m) + request_problems(r) \
        + server_problems(config.server) + compat_problems(config.compat, config.server)
    if config.cluster.enabled and config.disagg.enabled:
        found.append(ConfigProblem(("cluster.enabled", "disagg.enabled"), "cluster.enabled and disagg.enabled: "
                                   "a cluster's replicas prefill locally (disaggregation is one engine's)"))
    if not found and m.context_tokens - r.max_tokens < MIN_PROMPT_TOKENS:
        found.append(ConfigProblem(
            ("request.max_tokens", "model.context_tokens"),
            f"request.max_tokens = {r.max_tokens} must leave at least {MIN_PROMPT_TOKENS} tokens of "
            f"model.context_tokens = {m.context_tokens} to the prompt: lower it to "
            f"{m.context_tokens - MIN_PROMPT_TOKENS} or less, or raise model.context_tokens"))
    return found
