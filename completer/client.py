"""A one-line client for a running `completer serve`:

    python -m completer.client path/to/file.py:LINE:COL [--url ws://127.0.0.1:8750/v1/ws]

Streams the completion for that cursor to stdout as it arrives, then prints
the server's timings to stderr. The token is read from the server's token file
(or --token / $COMPLETER_TOKEN).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import websockets

from completer.cursor import document_at, split_cursor
from completer.server.security import default_token_path


async def complete(url: str, token: str, path: Path, prefix: str, suffix: str, mode: str,
                   max_tokens: int | None) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(url, additional_headers=headers) as ws:
        request = {"type": "complete", "id": "1", "mode": mode,
                   "document": {"uri": path.resolve().as_uri(), "language": "python",
                                "prefix": prefix, "suffix": suffix}}
        if max_tokens:
            request["max_tokens"] = max_tokens
        await ws.send(json.dumps(request))
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                sys.stdout.write(msg["text"])
                sys.stdout.flush()
            elif msg["type"] in ("done", "error"):
                return msg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m completer.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cursor", help="FILE:LINE:COL (1-based)")
    p.add_argument("--url", default="ws://127.0.0.1:8750/v1/ws")
    p.add_argument("--token", help="default: $COMPLETER_TOKEN, then the token file")
    p.add_argument("--mode", default="line", choices=["line", "block", "free"])
    p.add_argument("--max-tokens", type=int)
    args = p.parse_args(argv)
    path, line, col = split_cursor(args.cursor)
    prefix, suffix = document_at(path, line, col)
    token = args.token or os.environ.get("COMPLETER_TOKEN")
    if not token:
        try:
            token = default_token_path().read_text().strip()
        except OSError:
            raise SystemExit(f"error: no token: start `completer serve` first ({default_token_path()})") from None
    try:
        result = asyncio.run(complete(args.url, token, path, prefix, suffix, args.mode, args.max_tokens))
    except (OSError, websockets.exceptions.InvalidStatus) as e:
        raise SystemExit(f"error: cannot reach {args.url}: {e}") from None
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
