"""The TOML config: `[model]`, `[request]`, `[engine]`, `[spec]`, `[server]`, `[compat]`, `[disagg]`,
`[cluster]`, each section's schema and checks in a module of its own here.

Every key has a default; a config file or `--set section.key=value`
overrides it. An unknown section or key, a value of the wrong type, or values
that cannot work together (a completion as long as the whole window) stop the
start with one line naming the key and where it was set (`load.py`).

Every subsystem imports its section from here, and nothing here imports a
subsystem (tests/docs/test_import_graph.py): the schemas sit below all of them."""

from completer.config.cluster import ClusterConfig
from completer.config.disagg import DisaggConfig
from completer.config.engine import EngineConfig, SpecConfig
from completer.config.load import DEFAULT_CONFIG, SECTIONS, Config, load_config
from completer.config.model import ModelSection
from completer.config.problem import ConfigError, ConfigProblem
from completer.config.request import Mode, RequestSection
from completer.config.server import CompatSection, ServerSection

__all__ = [
    "ClusterConfig", "CompatSection", "Config", "ConfigError", "ConfigProblem", "DEFAULT_CONFIG", "DisaggConfig",
    "EngineConfig", "Mode", "ModelSection", "RequestSection", "SECTIONS", "ServerSection", "SpecConfig",
    "load_config",
]
