"""`completer lsp`: the language server's command line (stdio by default, as
editors start a language server; `--tcp HOST:PORT` to attach by hand)."""

from __future__ import annotations

import argparse
import logging
import sys

LSP_HELP = ("a language server over stdio: inline completion (LSP 3.18 textDocument/inlineCompletion) "
            "for any editor with a language client, from a running `completer serve`")


def add_parser(sub) -> None:
    p = sub.add_parser("lsp", help=LSP_HELP, description=LSP_HELP)
    p.add_argument("--stdio", action="store_true", help="talk over stdin/stdout (the default; accepted "
                   "because many editors pass it)")
    p.add_argument("--tcp", metavar="HOST:PORT", help="listen on a TCP port instead (debugging)")
    p.add_argument("--url", help="the server's WebSocket (default: the `url` setting, $COMPLETER_URL, "
                   "else ws://127.0.0.1:8750/v1/ws)")
    p.add_argument("--token-file", help="the server's token file (default: the `token_file` setting, "
                   "$COMPLETER_TOKEN, else where `completer serve` writes it)")
    p.add_argument("--log-file", help="write the language server's log here (stdout is the protocol's)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every message (with --log-file)")
    p.set_defaults(func=cmd_lsp)


def cmd_lsp(args: argparse.Namespace) -> int:
    from completer.lsp.server import build
    from completer.lsp.settings import LspSettings

    if args.log_file:
        logging.basicConfig(filename=args.log_file, level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    else:
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    server = build(LspSettings(url=args.url or "", token_file=args.token_file or ""))
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        try:
            server.start_tcp(host or "127.0.0.1", int(port))
        except ValueError:
            raise SystemExit(f"error: --tcp takes HOST:PORT, not {args.tcp!r}") from None
    else:
        server.start_io()
    return 0
