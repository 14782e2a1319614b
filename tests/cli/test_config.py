"""Config: defaults, the shipped TOML files, overrides, and errors naming the key."""

from pathlib import Path

import pytest

from completer.config import Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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


def message_of(overrides: list[str], path: Path | None = CONFIGS / "default.toml") -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(path, overrides)
    return str(refused.value)


def test_an_unknown_set_key_is_blamed_on_the_set_not_the_file():
    message = message_of(["engine.warp=1"])
    assert message.startswith("--set engine.warp=1: ") and "warp" in message
    assert "default.toml" not in message


def test_a_flag_is_named_as_typed():
    with pytest.raises(ConfigError, match=r"^--port 99999: server\.port"):
        load_config(None, ["server.port=99999"], spelled={"server.port=99999": "--port 99999"})


# A value out of its own range: the message names its key.
OUT_OF_RANGE = [
    "request.max_tokens=0", "request.deadline_ms=0", "request.deadline_ms=nan",
    "request.min_first_prob=-0.1", "request.min_token_prob=1.5", "request.min_line_prob=nan",
    "engine.kv_cache_mb=0", "engine.kv_cache_mb=-1.5", "engine.block_size=0", "engine.max_running=0",
    "engine.max_queue=0", "engine.prefill_chunk=0", "engine.threads=-1",
    "spec.k_max=-1", "spec.ngram_min=0", "spec.draft_share=0", "spec.draft_share=1",
    "server.port=70000", "server.max_frame_bytes=0", "server.max_connections=0", "server.send_queue_frames=0",
    "model.order=xyz", "model.template=nope", "compat.port=70000", "compat.max_inflight=0",
    "server.context_chars_total=-1", "model.max_memory_gb=-1", "model.max_memory_gb=nan",
]
# Values that cannot work together: the message names every key of the relation.
BROKEN_RELATIONS = {
    # the whole window for the completion: the prompt budget would be negative (issue #13: a loop at 100% CPU)
    "request.max_tokens=1100": ["request.max_tokens", "model.context_tokens"],
    "request.max_tokens=961": ["request.max_tokens", "model.context_tokens"],  # 63 prompt tokens left
    "model.context_tokens=100": ["request.max_tokens", "model.context_tokens"],
    "spec.k_init=9": ["spec.k_init", "spec.k_max"],
    "spec.ngram_max=1": ["spec.ngram_max", "spec.ngram_min"],
    "server.tls_key=key.pem": ["server.tls_key", "server.tls_cert"],
    "compat.port=8750": ["compat.port", "server.port"],
}


@pytest.mark.parametrize("override, keys", [(o, [o.split("=")[0]]) for o in OUT_OF_RANGE]
                         + list(BROKEN_RELATIONS.items()))
def test_values_that_cannot_work_stop_the_load_naming_the_keys_and_the_set(override, keys):
    message = message_of([override])
    assert message.startswith(f"--set {override}: "), message
    assert all(key in message for key in keys), message
    assert "\n" not in message


@pytest.mark.parametrize("overrides", [
    ["request.max_tokens=960"],  # leaves exactly the 64-token minimum to the prompt
    ["spec.k_init=8"], ["spec.k_max=0", "spec.k_init=0"], ["spec.ngram_min=1", "spec.ngram_max=1"],
    ["spec.draft_model=false", "spec.draft_share=0"],  # no drafter, no share to give it
    ["server.port=0"], ["engine.threads=0"], ["compat.port=0"], ["compat.enabled=false", "compat.port=8750"],
    ["server.context_chars_total=0"],  # nothing kept across requests: each request's own files only
    ["request.min_first_prob=0", "request.min_token_prob=1", "request.min_line_prob=1"],  # a rule off, or all
])
def test_values_at_their_bounds_load(overrides):
    assert isinstance(load_config(CONFIGS / "default.toml", overrides), Config)


def test_a_relation_broken_in_the_file_names_the_file(tmp_path):
    (tmp_path / "long.toml").write_text("[request]\nmax_tokens = 1100\n")
    assert message_of([], tmp_path / "long.toml").startswith(f"{tmp_path / 'long.toml'}: request.max_tokens")


def test_the_kv_cache_size_suggested_holds_one_full_window_and_a_tenth_less_does_not():
    """kv_cache_problem, on the embedded target's and drafter's shapes: the
    size it asks for is enough for a request over the whole window, and it is
    the least (to a tenth of a MB); the engine's own worst case agrees."""
    import re

    from completer.checkpoint import parse_config
    from completer.engine.block_manager import BlockManager
    from completer.config import EngineConfig, SpecConfig
    from completer.engine.paged_kv import kv_cache_problem
    from completer.engine.kv_cache_manager import KVCacheManager
    from completer.engine.paged_kv import pool_blocks
    from completer.model_store import EMBEDDED_DRAFT, EMBEDDED_TARGET

    shapes = {"target": parse_config(EMBEDDED_TARGET / "config.json"),
              "draft": parse_config(EMBEDDED_DRAFT / "config.json")}
    spec, context = SpecConfig(), 1024
    assert kv_cache_problem(EngineConfig(), spec, context, shapes) is None  # the default 256 MB
    problem = kv_cache_problem(EngineConfig(kv_cache_mb=0.01), spec, context, shapes)
    assert problem is not None and "engine.kv_cache_mb" in problem.message
    enough = float(re.search(r"at least ([0-9.]+)", problem.message).group(1))
    assert kv_cache_problem(EngineConfig(kv_cache_mb=enough), spec, context, shapes) is None
    assert kv_cache_problem(EngineConfig(kv_cache_mb=enough - 0.1), spec, context, shapes) is not None
    # The engine, built on that budget, takes a full-window request.
    share = {"target": 1 - spec.draft_share, "draft": spec.draft_share}
    bs = EngineConfig().block_size
    pools = {role: BlockManager(pool_blocks(cfg, enough * share[role], bs), bs) for role, cfg in shapes.items()}
    kv = KVCacheManager(pools, spec.k_max + 1)
    assert kv.too_large(context - 64, 64) is None
