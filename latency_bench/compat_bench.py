"""A keystroke over llama.cpp's /infill against the same keystroke over the
WebSocket protocol: same server, same document, one run.

    python -m latency_bench compat [--keystrokes 24] [--n-predict 8] [--model embedded] [--json out.json]

starts `completer serve` (the `[compat]` routes on an ephemeral port), then
types a line of `examples/shapes.py` key by key. After every key it asks for
a completion both ways, in turns (which goes first alternates):

- WebSocket: one connection kept open, a `complete` per key (`mode` free,
  `max_tokens` N), timed from the frame sent to its `done`;
- /infill: llama.vim's request (input_prefix the lines above, `prompt` the
  line so far, input_suffix the rest; n_predict N), each on a new connection
  as llama.vim's curl makes it, timed from connecting to the whole answer.

The WebSocket document has a URI, the /infill one none (llama.cpp's API
names no current file): their prompts differ from the file header on, so
each path is warm only from its own previous keystroke, as in an editor.
The first keystroke (cold) is left out of the figures. Printed per path:
client latency p50/p90, the server's own time (admission to the end: the
prompt's and the tokens'), the overhead (client less server time, per
keystroke: connection, HTTP or frame, JSON), prompt tokens computed and
found cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp

from latency_bench.harness import ROOT, TOKEN, collect, complete_msg, connect, running_server
from latency_bench.replay import percentile_ms

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# The line typed: Rectangle.perimeter's body in examples/shapes.py, at its cursor.
TYPED = "return 2 * (self.width + self.height)"


def document() -> tuple[str, str]:
    """(the text above the cursor's line, the text after the cursor) of examples/shapes.py at its line 27."""
    text = (ROOT / "examples" / "shapes.py").read_text()
    cursor = text.index("    def perimeter(self) -> float:\n        \n", text.index("class Rectangle"))
    above = text[: cursor] + "    def perimeter(self) -> float:\n"
    return above, text[len(above) + len("        "):]


async def over_websocket(ws, key: int, prefix: str, suffix: str, n_predict: int) -> dict:
    started = time.perf_counter()
    await ws.send(complete_msg(f"k{key}", prefix, suffix, uri="file:///proj/examples/shapes.py", mode="free",
                               max_tokens=n_predict))
    _, done = await collect(ws, f"k{key}")
    elapsed = time.perf_counter() - started
    assert done["type"] == "done", done
    t = done["timings"]
    return {"client_s": elapsed, "server_ms": t["total_ms"] - t["queue_ms"], "computed": t["prompt_tokens"] - t["cached_tokens"],
            "cached": t["cached_tokens"], "generated": t["generated_tokens"]}


def infill_body(above: str, line: str, suffix: str, n_predict: int) -> dict:
    """llama.vim's /infill body: the lines above, the line so far as `prompt`, the rest as the suffix."""
    return {"id_slot": 0, "input_prefix": above, "input_suffix": suffix, "input_extra": [], "prompt": line,
            "n_predict": n_predict, "stop": [], "n_indent": 0, "samplers": ["top_k", "top_p", "infill"],
            "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "model": ""}


async def over_infill(url: str, above: str, line: str, suffix: str, n_predict: int) -> dict:
    body = infill_body(above, line, suffix, n_predict)
    started = time.perf_counter()
    # A connection per request, closed after it: llama.vim runs curl per keystroke.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(url, json=body, headers=AUTH) as response:
            answer = await response.json()
    elapsed = time.perf_counter() - started
    assert response.status == 200, answer
    t = answer["timings"]
    return {"client_s": elapsed, "server_ms": t["prompt_ms"] + t["predicted_ms"], "computed": t["prompt_n"],
            "cached": t["cache_n"], "generated": t["predicted_n"]}


def summary(samples: list[dict]) -> dict:
    client = [s["client_s"] for s in samples]
    # What the path adds around the engine's work (connection, HTTP or frame, JSON), keystroke by keystroke.
    overhead = [s["client_s"] - s["server_ms"] / 1000 for s in samples]
    med = lambda key: sorted(s[key] for s in samples)[len(samples) // 2]  # noqa: E731
    return {"keystrokes": len(samples), "client_p50_ms": percentile_ms(client, 0.5),
            "client_p90_ms": percentile_ms(client, 0.9), "server_p50_ms": round(med("server_ms"), 1),
            "overhead_p50_ms": percentile_ms(overhead, 0.5), "computed_p50": med("computed"),
            "cached_p50": med("cached"), "generated_p50": med("generated")}


async def bench(compat_port: int, keystrokes: int, n_predict: int, server) -> dict:
    above, suffix = document()
    line_indent = "        "
    url = f"http://127.0.0.1:{compat_port}/infill"
    results: dict[str, list[dict]] = {"websocket": [], "infill": []}
    async with connect(server) as ws:
        for key in range(keystrokes + 1):  # key 0: the cold first keystroke, left out
            line = line_indent + TYPED[:key]
            ws_call = lambda: over_websocket(ws, key, above + line, suffix, n_predict)  # noqa: E731
            http_call = lambda: over_infill(url, above, line, suffix, n_predict)  # noqa: E731
            order = [("websocket", ws_call), ("infill", http_call)]
            for name, run in order if key % 2 == 0 else order[::-1]:
                sample = await run()
                if key:
                    results[name].append(sample)
    return {name: summary(samples) for name, samples in results.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keystrokes", type=int, default=24)
    p.add_argument("--n-predict", type=int, default=8, help="tokens generated per keystroke, both ways")
    p.add_argument("--model", default="embedded", help="as `completer serve --model`")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    with running_server("compat.port=0", "request.deadline_ms=60000", model=args.model) as server:
        compat_port = next(int(line.rsplit(":", 1)[1]) for line in server.log if line.startswith("compat API"))
        figures = asyncio.run(bench(compat_port, args.keystrokes, args.n_predict, server))
    print(f"{'path':<10} {'keys':>5} {'client p50':>11} {'client p90':>11} {'server p50':>11} "
          f"{'overhead p50':>13} {'computed':>9} {'cached':>7} {'generated':>9}")
    for name, f in figures.items():
        print(f"{name:<10} {f['keystrokes']:>5} {f['client_p50_ms']:>8} ms {f['client_p90_ms']:>8} ms "
              f"{f['server_p50_ms']:>8} ms {f['overhead_p50_ms']:>10} ms {f['computed_p50']:>9} "
              f"{f['cached_p50']:>7} {f['generated_p50']:>9}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "n_predict": args.n_predict, **figures}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
