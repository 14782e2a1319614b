"""Requests to the compatible routes (`[compat]`) as curl makes them: a
connection each, the token in the Authorization header."""

import http.client
import json

from latency_bench.harness import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Reply:
    def __init__(self, status: int, headers: dict[str, str], raw: bytes):
        self.status, self.headers, self.raw = status, headers, raw

    def json(self):
        return json.loads(self.raw)

    def events(self) -> list[str]:
        """The `data:` payloads of a server-sent event stream, in order."""
        assert self.headers["content-type"].startswith("text/event-stream"), self.headers
        text = self.raw.decode()
        assert text.endswith("\n\n"), text[-200:]
        return [block.removeprefix("data: ") for block in text.split("\n\n")[:-1]]


def call(port: int, method: str, path: str, body=None, headers=AUTH, raw: bytes | None = None) -> Reply:
    """One request on a connection of its own, as curl (llama.vim) makes them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    reply = Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    conn.close()
    return reply
