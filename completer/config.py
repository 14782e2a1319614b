"""The TOML config: `[model]`, `[request]`, `[engine]`, `[spec]`, `[server]`, `[compat]`, `[disagg]`,
`[cluster]`.

Every key has a default here; a config file or `--set section.key=value`
overrides it. An unknown section or key, a value of the wrong type, or values
that cannot work together (a completion as long as the whole window) stop the
start with one line naming the key and where it was set: the file, or the
`--set` (or flag) that set it.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from completer.cluster.config import ClusterConfig, cluster_problems
from completer.disagg.config import DisaggConfig, disagg_problems
from completer.engine.config import ConfigProblem, EngineConfig, SpecConfig, engine_problems, spec_problems
from completer.engine.request import Mode


class ModelSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str = "default"  # a named model fetched once ("default": SmolLM2-135M; "gemma3-270m"), "embedded", a path
    draft: str = "default"  # "default" (the drafter made for the target, if any), "embedded", a path, "" for none
    # auto: bf16 where native, else fp32 (a quantized GGUF on CPU: int4, int8 or int4+int8, docs/models.md);
    # int8 / int4 / int4+int8: CPU quantized weights (completer/cpu_quant.py)
    precision: Literal["auto", "fp32", "bf16", "fp8", "int8", "int4", "int4+int8"] = "auto"
    fuse_projections: bool = True  # one GEMM for q/k/v and one for gate/up (false: HF's seven per layer)
    device: str = "cpu"  # "cpu" or "cuda" (or "cuda:N")
    template: str = ""  # FIM template; "" detects it from the tokenizer
    order: str = ""  # "psm" / "spm" to override the template's order
    context_tokens: int = 1024  # prompt + completion window
    int4_dense_rows: int = 32  # int4: passes of this many rows or more use a resident bf16 copy (0: none)
    # oneDNN's and ideep's per-shape kernel caches, entries each (theirs: 1,024, ~1.2 MB more per new prompt length).
    kernel_cache_entries: int = 128
    # On a CPU, the start refuses models whose weights and K/V pool (completer/memory.py's estimate) exceed
    # this many GB; 0: the memory available when it starts.
    max_memory_gb: float = 0.0
    # The context block: the windows of the files a client sent that best match the code before the
    # cursor (completer/retrieval.py), kept while typing; false: the files whole, in the client's order.
    retrieval: bool = True
    # ... and at a jump within the window, kept unless a new choice is far better (retrieval.HOLD_MARGIN):
    # a new block recomputes the cached window behind it. false: the margin of typing alone.
    retrieval_hold: bool = True
    # Where a window may start: "content", lines chosen by a hash of their text (the same starts for the
    # same text, whatever a client sends above it; prompt.anchored); "lines", line numbers on a grid.
    window_grid: Literal["content", "lines"] = "content"
    # Token healing (completer/healing.py): where the prompt ends with the prefix, its last token is taken back
    # and the completion must spell it again, so a word cut by the cursor is continued as a word. false: off.
    token_healing: bool = True


class RequestSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Defaults for what a request leaves out (every caller reads them here)."""

    max_tokens: int = 64
    deadline_ms: float = 2000.0
    # The first request of a document on a connection prefills the whole file cold, and no keystroke
    # races it: a keystroke's budget cut its suggestion mid-expression (issue #32).
    first_deadline_ms: float = 15000.0
    mode: Mode = "line"
    # The confidence rules (a token's probability, 0 to 1; 0: no rule; engine.request.Confidence), for
    # `line` and `block` completions: below min_first_prob up to the first visible token, nothing is shown;
    # below min_token_prob later on the first line, the suggestion ends before that token; below
    # min_line_prob on a later line of a block, the block ends before that line.
    # Chosen on the typist (BENCHMARKS.md, 2026-12-06): Tab saves ~10 points more keystrokes than without.
    min_first_prob: float = 0.4
    min_token_prob: float = 0.35
    min_line_prob: float = 0.7


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
    keepalive_s: float = 20.0  # ping period; a connection silent for 3 periods (no frame, no pong) is closed
    max_documents_per_connection: int = 256  # prompt state kept per connection (least recently used goes)
    prefix_cache_scope: Literal["shared", "connection"] = "shared"  # who may reuse a prompt's cached K/V
    public_metrics: bool = False  # true: /metrics without the token (a scraper that cannot send one)
    # Per connection: the files its client sent (context, documents) kept as retrieval candidates (0: none).
    context_store_chars: int = 1_000_000
    # All connections together: the characters their stores and retrieval window caches hold (~15 bytes of
    # memory each), the least recently used, whichever connection's, dropped first (context_store.LEDGER).
    context_chars_total: int = 32_000_000
    # Folders on this machine under which a request's `workspace` may be read to resolve its document's
    # imports (completer/workspace.py); absolute paths. Empty: the server never reads a client's files.
    workspace_roots: list[str] = []
    workspace_file_bytes: int = 256 * 1024  # a larger imported file is not read
    # Warming (completer/server/warming.py): after a request on a document, once its client pauses this
    # long, up to this many windows its next jump may take are prefilled while the engine is idle (0: none).
    warm_windows: int = 3
    # The longest deadline a request may ask for (the protocol allows 600,000 ms): longer ones are cut to it,
    # so no client holds the engine's slots for minutes (never below request.deadline_ms, first_deadline_ms).
    max_deadline_ms: float = 60000.0
    warm_after_ms: float = 100.0
    # A file to append one JSON line to per finished request: its arrival, route, client, end and timings,
    # never its text (server/request_log.py). "": none.
    request_log: str = ""
    # `done.hold_ms`: how long the server asks a client to wait after a keystroke before asking (0 unless
    # other clients share the engine and requests wait for it; server/hold.py). false: not sent.
    client_hold: bool = True


class CompatSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The llama.cpp- and OpenAI-compatible HTTP routes (`server/compat/`), on a listener of their own."""

    enabled: bool = True
    host: str = ""  # "" = server.host
    # llama.vim's and llama.vscode's default endpoint is http://127.0.0.1:8012: their users change nothing.
    port: int = 8012
    max_inflight: int = 32  # requests in flight on these routes together; more get 429
    # Slow or idle clients (server/compat/connections.py): each holds a socket and a file descriptor.
    # Open at once; past it one not busy is closed: one that never sent the token before any that did
    # (compat/connections.py, ConnectionGuard.victim).
    max_connections: int = 128
    header_timeout_s: float = 10.0  # from a request's first byte to its last header line
    body_timeout_s: float = 30.0  # to read a request's whole body
    idle_timeout_s: float = 60.0  # a connection with no request in it (keep-alive, or never used)


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelSection = ModelSection()
    request: RequestSection = RequestSection()
    engine: EngineConfig = EngineConfig()
    spec: SpecConfig = SpecConfig()
    server: ServerSection = ServerSection()
    compat: CompatSection = CompatSection()
    disagg: DisaggConfig = DisaggConfig()
    cluster: ClusterConfig = ClusterConfig()


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and where it was
    set (the file, or the `--set` or flag)."""


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"

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
    """Values that pass their types but cannot work, alone or together; the
    ones about a single key first."""
    from completer.prompt import TEMPLATES  # here: the prompt module is not needed to read a config

    m, r, s = config.model, config.request, config.server
    found = engine_problems(config.engine) + spec_problems(config.spec) + disagg_problems(config.disagg) \
        + cluster_problems(config.cluster)
    if m.template and m.template not in TEMPLATES:
        found.append(ConfigProblem(("model.template",), f"model.template = {m.template!r}: unknown "
                                   f"(known: {', '.join(TEMPLATES)}, or \"\" to detect it)"))
    if m.order not in ("", "psm", "spm"):
        found.append(ConfigProblem(("model.order",), f"model.order = {m.order!r}: must be \"psm\", \"spm\" or \"\""))
    if r.max_tokens < 1:
        found.append(ConfigProblem(("request.max_tokens",), f"request.max_tokens = {r.max_tokens}: must be at least 1"))
    for key in ("deadline_ms", "first_deadline_ms"):
        if not (getattr(r, key) > 0 and math.isfinite(getattr(r, key))):  # NaN fails too
            found.append(ConfigProblem((f"request.{key}",),
                                       f"request.{key} = {getattr(r, key)}: must be a positive number"))
    for key in ("min_first_prob", "min_token_prob", "min_line_prob"):
        if not 0 <= getattr(r, key) <= 1:  # NaN fails too
            found.append(ConfigProblem((f"request.{key}",), f"request.{key} = {getattr(r, key)}: must be a "
                                       "probability, 0 (no rule) to 1"))
    if not 0 <= s.port <= 65535:
        found.append(ConfigProblem(("server.port",), f"server.port = {s.port}: must be 0 (any free port) to 65535"))
    if s.context_store_chars < 0:
        found.append(ConfigProblem(("server.context_store_chars",), f"server.context_store_chars = "
                                   f"{s.context_store_chars}: must be 0 (none) or more"))
    if s.context_chars_total < 0:
        found.append(ConfigProblem(("server.context_chars_total",), f"server.context_chars_total = "
                                   f"{s.context_chars_total}: must be 0 (nothing kept across requests) or more"))
    for i, root in enumerate(s.workspace_roots):
        if not Path(root).is_absolute() or not Path(root).is_dir():
            found.append(ConfigProblem(("server.workspace_roots",), f"server.workspace_roots[{i}] = {root!r}: "
                                       "must be the absolute path of an existing folder"))
    for key in ("max_frame_bytes", "max_document_chars", "max_inflight_per_connection", "max_connections",
                "send_queue_frames", "max_documents_per_connection", "workspace_file_bytes"):
        if getattr(s, key) < 1:
            found.append(ConfigProblem((f"server.{key}",), f"server.{key} = {getattr(s, key)}: must be at least 1"))
    if not (s.max_deadline_ms > 0 and math.isfinite(s.max_deadline_ms)):
        found.append(ConfigProblem(("server.max_deadline_ms",), f"server.max_deadline_ms = {s.max_deadline_ms}: "
                                   "must be a positive number of milliseconds"))
    if s.warm_windows < 0:
        found.append(ConfigProblem(("server.warm_windows",), f"server.warm_windows = {s.warm_windows}: "
                                   "must be 0 (no warming) or more"))
    if not (s.warm_after_ms >= 0 and math.isfinite(s.warm_after_ms)):
        found.append(ConfigProblem(("server.warm_after_ms",), f"server.warm_after_ms = {s.warm_after_ms}: "
                                   "must be 0 or more milliseconds"))
    if not s.keepalive_s > 0:
        found.append(ConfigProblem(("server.keepalive_s",), f"server.keepalive_s = {s.keepalive_s}: must be above 0"))
    c = config.compat
    if not 0 <= c.port <= 65535:
        found.append(ConfigProblem(("compat.port",), f"compat.port = {c.port}: must be 0 (any free port) to 65535"))
    if c.max_inflight < 1:
        found.append(ConfigProblem(("compat.max_inflight",), f"compat.max_inflight = {c.max_inflight}: "
                                   "must be at least 1"))
    if c.max_connections < 1:
        found.append(ConfigProblem(("compat.max_connections",), f"compat.max_connections = {c.max_connections}: "
                                   "must be at least 1"))
    for key in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
        if not (getattr(c, key) > 0 and math.isfinite(getattr(c, key))):
            found.append(ConfigProblem((f"compat.{key}",), f"compat.{key} = {getattr(c, key)}: "
                                       "must be a positive number of seconds"))
    if c.enabled and c.port and c.port == s.port and (c.host or s.host) == s.host:
        found.append(ConfigProblem(("compat.port", "server.port"), f"compat.port = {c.port} is server.port: "
                                   "the compatible routes need a port of their own"))
    if s.tls_key and not s.tls_cert:
        found.append(ConfigProblem(("server.tls_key", "server.tls_cert"),
                                   "server.tls_key is set but server.tls_cert is not: TLS needs both"))
    if m.int4_dense_rows < 0:
        found.append(ConfigProblem(("model.int4_dense_rows",), f"model.int4_dense_rows = {m.int4_dense_rows}: "
                                   "must be 0 (no copy) or more"))
    if not (m.max_memory_gb >= 0 and math.isfinite(m.max_memory_gb)):  # (NaN fails too)
        found.append(ConfigProblem(("model.max_memory_gb",), f"model.max_memory_gb = {m.max_memory_gb}: "
                                   "must be 0 (the memory available at start) or a positive number of GB"))
    if m.kernel_cache_entries < 1:
        found.append(ConfigProblem(("model.kernel_cache_entries",),
                                   f"model.kernel_cache_entries = {m.kernel_cache_entries}: must be at least 1"))
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
