"""HTTP fuzzing of the compatible routes (`[compat]`): bodies and headers a
broken or hostile client can send, against the real server.

    python -m latency_bench fuzz-http --requests 100000 [--json out.json]

starts `completer serve --model embedded` (ephemeral ports), sends each
request on a connection of its own (raw bytes: any header value, any body)
while a neighbour keeps completing over /infill, and checks what
docs/compat_api.md promises: every request gets a status line; every status
of 400 or more comes with the JSON error envelope (`error.code` the status),
never a plain-text page; no 500; the neighbour never fails. Bodies are
fuzz_frames.py's frames (bad JSON, deep nesting, huge, wrong types, unicode,
binary) sent as /infill, /completion and /v1/completions bodies; headers are
drawn from missing, wrong, empty and non-ASCII keys, foreign Origin and Host,
and lying Content-Length. It exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec

from latency_bench.fuzz import SERVER_SETTINGS, TOKEN, generated_batches, rss_mb
from latency_bench.harness import running_server
from latency_bench.run_results import machine, now, write_result

ROUTES = [("POST", "/infill"), ("POST", "/completion"), ("POST", "/completions"), ("POST", "/v1/completions"),
          ("GET", "/health"), ("GET", "/props"), ("GET", "/v1/models"), ("GET", "/nowhere"), ("PUT", "/infill")]
GOOD = f"Authorization: Bearer {TOKEN}"
HEADER_CHOICES = [
    [GOOD], [GOOD], [GOOD], [],  # mostly the token: the bodies get read
    ["Authorization: Bearer "], ["Authorization: Bearer ключ"], ["X-Api-Key: clé"], ["api-key: \udcff"],
    ["Authorization: \udcff\udcfe"], [f"{GOOD}x"], [GOOD, "Origin: https://evil.example"],
    [GOOD, "Origin: \udcff"], [GOOD, "X-Junk: " + "a" * 9000],
]
HOSTS = ["127.0.0.1:{port}", "127.0.0.1:{port}", "evil.example", "\udcff", ""]


def request_bytes(rng: random.Random, port: int, body: bytes) -> bytes:
    method, path = rng.choice(ROUTES)
    host = rng.choice(HOSTS).format(port=port)
    headers = list(rng.choice(HEADER_CHOICES))
    if host:
        headers.append(f"Host: {host}")
    length = len(body)
    if rng.random() < 0.05:  # a lying Content-Length: longer (the body never ends) or shorter
        length = rng.choice([length + 10, max(0, length - 5)])
    headers += ["Content-Type: application/json", f"Content-Length: {length}", "Connection: close"]
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    return head.encode("utf-8", "surrogateescape") + body


async def read_all(reader: asyncio.StreamReader) -> tuple[bytes, BaseException | None]:
    """What the server sent until it closed, and the error that ended it, if any
    (a reset after its answer keeps the answer)."""
    raw = b""
    try:
        while chunk := await reader.read(65536):
            raw += chunk
    except ConnectionError as e:
        return raw, e
    return raw, None


async def one(port: int, data: bytes, timeout: float) -> tuple[int | None, bytes, bytes]:
    """(status or None, headers, body) of one request on its own connection. The
    answer is read while the request is sent, as a browser or curl does: a server
    may answer an oversized request and close before taking all of it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reading = asyncio.ensure_future(asyncio.wait_for(read_all(reader), timeout))
    try:
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:
            pass  # closed mid-request: what it answered is still read below
        raw, error = await reading
    except TimeoutError as e:
        return None, b"", repr(e).encode()
    finally:
        reading.cancel()
        writer.close()
    if not raw and error is not None:
        return None, b"", repr(error).encode()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), head, body
    except (IndexError, ValueError):
        return None, head, body


def problem_of(status: int | None, head: bytes, body: bytes) -> str | None:
    if status is None:
        return "no status line"
    if status == 500:
        return "500"
    if status >= 400:
        if b"application/json" not in head.lower():
            return f"{status} not in JSON"
        try:
            if json.loads(body)["error"]["code"] != status:
                return f"{status} with another code in its envelope"
        except (ValueError, KeyError, TypeError):
            return f"{status} without the error envelope"
    return None


async def neighbour(port: int, stop: asyncio.Event, figures: Counter) -> None:
    body = json.dumps({"input_prefix": "def total(items):\n    result = 0\n    ", "input_suffix": "\n",
                       "n_predict": 4}).encode()
    data = (f"POST /infill HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{GOOD}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    while not stop.is_set():
        status, _, _ = await one(port, data, 60)
        figures["neighbour_done" if status == 200 else "neighbour_failed"] += 1
        await asyncio.sleep(0.2)


async def fuzz_http(port: int, requests: int, seed: int, concurrency: int, batch: int = 1000) -> dict:
    rng = random.Random(seed)
    statuses, kinds, figures = Counter(), Counter(), Counter()
    problems: Counter = Counter()
    examples: list[str] = []
    stop = asyncio.Event()
    side = asyncio.create_task(neighbour(port, stop, figures))
    limit = asyncio.Semaphore(concurrency)

    async def send(kind: str, data: bytes) -> None:
        async with limit:
            status, head, body = await one(port, data, 30)
        statuses[str(status)] += 1
        if (problem := problem_of(status, head, body)) is not None:
            problems[problem] += 1
            if len(examples) < 10:
                examples.append(f"{kind}: {problem}: {data[:200]!r} -> {head[:100]!r} {body[:200]!r}")

    started = time.monotonic()
    async for frames in generated_batches(requests, seed, batch):
        sends = []
        for frame in frames:
            body = frame.data.encode("utf-8", "surrogateescape") if isinstance(frame.data, str) else frame.data
            kinds[frame.kind] += 1
            sends.append(send(frame.kind, request_bytes(rng, port, body)))
        await asyncio.gather(*sends)
    stop.set()
    await side
    return {"requests": requests, "sent_by_kind": dict(kinds), "statuses": dict(statuses),
            "problems": dict(problems), "examples": examples, **figures,
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    # Frames larger than the body limit get their 413 (JSON, checked like the rest).
    with running_server(*SERVER_SETTINGS, token=TOKEN) as server:
        before = rss_mb(server)
        figures = asyncio.run(fuzz_http(server.compat, args.requests, args.seed, args.concurrency))
        figures["server_rss_mb_before"], figures["server_rss_mb_after"] = before, rss_mb(server)
        figures["server_alive"] = server.proc.poll() is None
    figures["command"] = "python -m latency_bench fuzz-http " + " ".join(sys.argv[1:])
    figures["date"], figures["machine"] = now(), msgspec.to_builtins(machine())
    report = json.dumps(figures, indent=2)
    print(report)
    if args.json:
        write_result(args.json, report)
    broken = figures["problems"] or figures.get("neighbour_failed") or not figures["server_alive"]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
