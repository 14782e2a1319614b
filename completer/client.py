"""A one-line client for a running `completer serve`:

    python -m completer.client path/to/file.py:LINE:COL [--url ws://127.0.0.1:8750/v1/ws]

Streams the completion for that cursor to stdout as it arrives, then prints
the server's timings to stderr. The token is read from the server's token file
(or --token / $COMPLETER_TOKEN). A server still loading its models answers
how far it is; the client says so and waits for it (--wait). A one-shot
request races no keystroke: it asks for a deadline of its own (--deadline-ms,
60 s), not the server's keystroke default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import websockets

from completer.cursor import document_at, split_cursor
from completer.server.security import default_token_path


DEFAULT_URL = "ws://127.0.0.1:8750/v1/ws"


# A person asked for this one: the model's whole completion, sure or not (`--confident`: the server's rules).
RULES_OFF = {"min_first_prob": 0.0, "min_token_prob": 0.0, "min_line_prob": 0.0}


async def complete(url: str, token: str, path: Path, prefix: str, suffix: str, mode: str,
                   max_tokens: int | None, deadline_ms: float, confident: bool = False) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(url, additional_headers=headers) as ws:
        request = {"type": "complete", "id": "1", "mode": mode, "deadline_ms": deadline_ms,
                   "document": {"uri": path.resolve().as_uri(), "language": "python",
                                "prefix": prefix, "suffix": suffix}}
        if max_tokens:
            request["max_tokens"] = max_tokens
        if not confident:
            request |= RULES_OFF
        await ws.send(json.dumps(request))
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                sys.stdout.write(msg["text"])
                sys.stdout.flush()
            elif msg["type"] in ("done", "error"):
                return msg


def loading_message(error: Exception) -> str | None:
    """What a server still loading said when it refused the handshake
    (`loading, 55%: loading the model (...)`), else None."""
    response = getattr(error, "response", None)
    if isinstance(error, websockets.exceptions.InvalidStatus) and response.status_code == 503:
        body = (response.body or b"").decode("utf-8", "replace").strip()
        return body if body.startswith("loading") else None
    return None


def complete_when_ready(url: str, token: str, wait_s: float, *request) -> dict:
    """`complete`, waiting (up to `wait_s`) while the server says it is loading."""
    end = time.monotonic() + wait_s
    said = None
    while True:
        try:
            return asyncio.run(complete(url, token, *request))
        except websockets.exceptions.InvalidStatus as e:
            message = loading_message(e)
            if message is None or time.monotonic() > end:
                raise
            if message != said:
                print(f"the server is starting ({message}); waiting until it is ready", file=sys.stderr, flush=True)
                said = message
            time.sleep(1.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m completer.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cursor", help="FILE:LINE:COL (1-based)")
    p.add_argument("--url", default=os.environ.get("COMPLETER_URL") or DEFAULT_URL,
                   help=f"default: $COMPLETER_URL, else {DEFAULT_URL}")
    p.add_argument("--token", help="default: $COMPLETER_TOKEN, then the token file")
    p.add_argument("--mode", default="line", choices=["line", "block", "free"])
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--deadline-ms", type=float, default=60_000.0,
                   help="the request's deadline (default 60 s: a one-shot races no keystroke)")
    p.add_argument("--confident", action="store_true",
                   help="let the server's confidence rules cut the completion, as an editor's are "
                        "(default: the model's whole completion)")
    p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for a server that is still loading its models (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path, line, col = split_cursor(args.cursor)
    prefix, suffix = document_at(path, line, col)
    token = args.token or os.environ.get("COMPLETER_TOKEN")
    if not token:
        try:
            token = default_token_path().read_text().strip()
        except OSError:
            raise SystemExit(f"error: no token: start `completer serve` first ({default_token_path()})") from None
    try:
        result = complete_when_ready(args.url, token, args.wait, path, prefix, suffix, args.mode, args.max_tokens,
                                     args.deadline_ms, args.confident)
    except (OSError, websockets.exceptions.InvalidStatus) as e:
        detail = loading_message(e) or e
        raise SystemExit(f"error: cannot reach {args.url}: {detail}") from None
    print()
    if result["type"] == "error":
        print(f"error: {result['code']}: {result['message']}", file=sys.stderr)
        return 1
    t = result["timings"]
    print(f"[{result['reason']}] ttft {t['ttft_ms']:.1f} ms, total {t['total_ms']:.1f} ms, "
          f"prompt {t['prompt_tokens']} tok ({t['cached_tokens']} cached), "
          f"generated {t['generated_tokens']}, draft {t['draft_accepted']}/{t['draft_proposed']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
