"""The typist's clients (latency_bench/typist.py): ours over the WebSocket
protocol, and llama.cpp's server over its `/completion`, both keeping what
each request streamed, where the typist first saw it, and each first text's
latency. A new key's request supersedes (ours) or abandons (llama.cpp's) the
one before, as the editors' plugins do."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from latency_bench.replay import display

if TYPE_CHECKING:
    from latency_bench.typist import Site


def mode_at(line_before: str, rest: str) -> str:
    """What our clients ask for: `block` on a blank line (nothing on it before or after the cursor), else `line`."""
    return "block" if not line_before.strip() and not rest.split("\n", 1)[0].strip() else "line"


class Streams:
    """A client's requests and what each has streamed: id -> origin (what was typed when it was asked), text,
    when it was sent, where the typist first saw it (`seen`); and each first text's latency."""

    def __init__(self, tag: str) -> None:
        self.by_id: dict[str, dict] = {}
        self.first_text_ms: list[float] = []
        self.tag, self.ids = tag, iter(range(10**9))  # ids unique on the connection: a site's tag, then a count

    def new(self, typed: str) -> str:
        rid = f"{self.tag}-{next(self.ids)}"
        self.by_id[rid] = {"origin": typed, "text": "", "sent": time.perf_counter()}
        return rid

    def add(self, rid: str, text: str) -> None:
        s = self.by_id.get(rid)
        if s is None or not text:
            return
        if not s["text"]:
            self.first_text_ms.append(round((time.perf_counter() - s["sent"]) * 1000, 1))
        s["text"] += text


class CompleterClient(Streams):
    """Ours over the WebSocket protocol: a `complete` per ask, the next superseding it at the server."""

    def __init__(self, ws, site: Site, uri: str, tag: str) -> None:
        super().__init__(tag)
        self.ws, self.site, self.uri = ws, site, uri
        self.reader = asyncio.create_task(self.read())

    async def read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if msg["type"] == "delta":
                self.add(msg["id"], msg["text"])

    async def ask(self, typed: str) -> str:
        rid = self.new(typed)
        prefix = self.site.prefix + typed  # (the lines are taken out: what is left to type is not in the file)
        mode = mode_at(prefix[prefix.rfind("\n") + 1:], self.site.suffix)
        await self.ws.send(json.dumps({"type": "complete", "id": rid, "mode": mode,
                                       "document": {"uri": self.uri, "language": "python",
                                                    "prefix": prefix, "suffix": self.site.suffix}}))
        return rid

    async def close(self) -> None:
        self.reader.cancel()


class LlamaClient(Streams):
    """llama.cpp's server: a streamed `POST /completion` per ask on the very token ids our pipeline builds
    for that place (`replay.prompt_states`), `cache_prompt` on, the one before abandoned (its connection
    closed, as llama.vim stops its job), a line's budget as llama.vim asks it (stop at the newline)."""

    def __init__(self, session, url: str, prompt, site: Site, uri: str, max_tokens: int, tag: str) -> None:
        super().__init__(tag)
        self.session, self.url, self.prompt, self.site, self.uri = session, url, prompt, site, uri
        self.max_tokens, self.task = max_tokens, None

    async def stream(self, rid: str, ids: list[int]) -> None:
        body = {"prompt": ids, "n_predict": self.max_tokens, "cache_prompt": True, "stream": True,
                "temperature": 0.0, "stop": ["\n"]}
        async with self.session.post(f"{self.url}/completion", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    self.add(rid, chunk.get("content", ""))
                    if chunk.get("stop"):
                        return

    async def ask(self, typed: str) -> str:
        if self.task is not None:
            self.task.cancel()
        rid = self.new(typed)
        ids = self.prompt.update(self.site.prefix + typed, self.site.suffix, display(self.uri)).tokens
        self.task = asyncio.create_task(self.stream(rid, list(ids)))
        return rid

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
