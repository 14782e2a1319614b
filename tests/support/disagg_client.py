"""A protocol client run as its own process, for servers a test cannot reach
from its own network namespace (tests/cluster/test_disagg_netns.py runs it with
`ip netns exec`): connects to ws://127.0.0.1:PORT/v1/ws with the token in
$COMPLETER_TOKEN, sends one `complete` per document named on stdin (a JSON
list of {"id", "prefix", "suffix"}, one request at a time) and prints each
terminal frame (`done` or `error`) as a JSON line.

    python tests/support/disagg_client.py PORT < requests.json
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from latency_bench.harness import ServerProcess, collect, complete_msg, connect


async def main(port: int, requests: list[dict]) -> None:
    server = ServerProcess(None, port, [])
    async with connect(server, token=os.environ["COMPLETER_TOKEN"]) as ws:
        for r in requests:
            await ws.send(complete_msg(r["id"], r["prefix"], r["suffix"], uri=r.get("uri", "file:///proj/app/main.py"),
                                       deadline_ms=r.get("deadline_ms", 60000), max_tokens=r.get("max_tokens", 8)))
            _, terminal = await asyncio.wait_for(collect(ws, r["id"]), 120)
            print(json.dumps(terminal), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), json.load(sys.stdin)))
