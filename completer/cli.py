"""The `completer` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from completer.training import cli as train_cli


def split_cursor(spec: str) -> tuple[Path, int, int]:
    """`path/to/file.py:LINE:COL` (1-based, COL counts characters)."""
    try:
        path, line, col = spec.rsplit(":", 2)
        return Path(path), int(line), int(col)
    except ValueError:
        raise SystemExit(f"error: expected FILE:LINE:COL, got {spec!r}") from None


def document_at(path: Path, line: int, col: int) -> tuple[str, str]:
    """The file's text before and after the cursor."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}") from None
    lines = text.split("\n")
    if not 1 <= line <= len(lines) or not 1 <= col <= len(lines[line - 1]) + 1:
        raise SystemExit(f"error: {path}:{line}:{col} is outside the file "
                         f"({len(lines)} lines; line {min(line, len(lines))} has "
                         f"{len(lines[min(line, len(lines)) - 1])} characters)")
    offset = sum(len(s) + 1 for s in lines[: line - 1]) + col - 1
    return text[:offset], text[offset:]


def cmd_complete(args: argparse.Namespace) -> int:
    """One completion through the engine (the server's path), streamed to stdout."""
    import asyncio

    from completer.checkpoint import CheckpointError
    from completer.engine.core import EngineError, request_for
    from completer.engine.engine import Engine, run_in_passing_thread
    from completer.engine.sequence import SamplingParams
    from completer.loading import load_models
    from completer.model_store import ModelFetchError

    if args.cursor:
        path, line, col = split_cursor(args.cursor)
        prefix, suffix = document_at(path, line, col)
        name = str(path)
    else:
        if args.prefix is None:
            raise SystemExit("error: give FILE:LINE:COL or --prefix (use - to read it from stdin)")
        stdin = sys.stdin.read() if "-" in (args.prefix, args.suffix) else ""
        prefix = stdin if args.prefix == "-" else args.prefix
        suffix = stdin if args.suffix == "-" else (args.suffix or "")
        name = None
    try:  # torch work stays off this thread (see run_in_passing_thread)
        target, draft = run_in_passing_thread(load_models, args.model, args.draft, args.precision, args.template)
    except (CheckpointError, ModelFetchError) as e:
        raise SystemExit(f"error: {e}") from None
    builder = target.prompt_builder(args.context_tokens - args.max_tokens)
    engine = Engine.build(target, draft)
    request = request_for("cli", builder.build(prefix, suffix, name), prefix, suffix,
                          SamplingParams(max_tokens=args.max_tokens, mode=args.mode),
                          engine.core.healer, builder.template.order)

    async def stream():
        engine.start()
        try:
            deltas = engine.submit(request)
            async for delta in deltas:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            return await deltas.finished()
        finally:
            engine.stop()

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


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from completer.checkpoint import CheckpointError
    from completer.config import ConfigError, DEFAULT_CONFIG, load_config
    from completer.model_store import ModelFetchError
    from completer.server import security
    from completer.server.app import run

    overrides = list(args.set or [])
    if args.host:
        overrides.append(f"server.host={json.dumps(args.host)}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    if args.precision:
        overrides.append(f'model.precision="{args.precision}"')
    if args.model:
        overrides.append(f"model.target={json.dumps(args.model)}")
    try:
        # configs/default.toml spells out the built-in defaults; a non-editable
        # install may not have it, and then the defaults are the same.
        default = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
        config = load_config(args.config or default, overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    token = args.token or os.environ.get("COMPLETER_TOKEN") or config.server.token
    if token:
        source = "given on the command line, in $COMPLETER_TOKEN or in the config"
    else:
        path = Path(config.server.token_file).expanduser() if config.server.token_file \
            else security.default_token_path()
        token = security.load_or_create_token(path)
        source = str(path)
    try:
        return run(config, token, source)
    except (CheckpointError, ModelFetchError) as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: cannot serve on {config.server.host}:{config.server.port}: {e}") from None


def cmd_models(args: argparse.Namespace) -> int:
    from completer.model_store import DEFAULT_TARGET, ModelFetchError, cached_path, pull

    if args.action == "path":
        print(cached_path())
        return 0
    try:
        print(pull(DEFAULT_TARGET))
    except ModelFetchError as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from completer.evaluate import main as evaluate_main

    return evaluate_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="completer", description="low-latency code completion")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("complete", help="print one completion for a cursor in a file")
    p.add_argument("cursor", nargs="?", help="FILE:LINE:COL (1-based)")
    p.add_argument("--prefix", help="text before the cursor (- reads stdin)")
    p.add_argument("--suffix", help="text after the cursor (- reads stdin)")
    p.add_argument("--model", default="default",
                   help="a GGUF file, an HF checkpoint directory, 'default' (SmolLM2-135M, fetched "
                        "once into the cache) or 'embedded' (the small model shipped in the package)")
    p.add_argument("--draft", default="default",
                   help="drafter: a file or directory, 'embedded', or '' for none "
                        "(default: the drafter made for the target: ours for 'default' and "
                        "'embedded', none for other models)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp8"])
    p.add_argument("--template", help="FIM template (default: detected from the tokenizer)")
    p.add_argument("--mode", default="line", choices=["line", "block", "free"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--context-tokens", type=int, default=1024, help="prompt + completion budget")
    p.set_defaults(func=cmd_complete)

    p = sub.add_parser("serve", help="serve completions over WebSocket (protocol v1)")
    p.add_argument("--config", type=Path, help="TOML config (default: configs/default.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8750; 0 picks a free one)")
    p.add_argument("--token", help="bearer token (default: $COMPLETER_TOKEN, or the token file)")
    p.add_argument("--model", help="target: a GGUF file, an HF checkpoint directory, 'default' or "
                                   "'embedded' (sets model.target)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp8"],
                   help="weights precision (auto: bf16 where native; fp8 is emulated on CPU)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set spec.ngram=false")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("models", help="fetch the default model into the cache (pull), or print where it goes (path)")
    p.add_argument("action", choices=["pull", "path"])
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("evaluate", help="evaluate the target and drafter on code outside the stdlib")
    from completer.evaluate import add_arguments
    add_arguments(p)
    p.set_defaults(func=cmd_evaluate)

    train_cli.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
