"""Protocol fuzzing: the frames a broken or hostile client can send, and a
long run of them against the real server.

    python -m latency_bench fuzz --frames 100000 [--json out.json]

starts `completer serve --model embedded` on an ephemeral port, sends the
frames over a few connections while another session keeps completing, checks
that each frame gets the answer docs/protocol.md promises, and prints figures:
frames sent and answers by kind, frames left unanswered or answered wrongly,
connections lost, wall time, the server's RSS before and after. It exits 1
when any frame was answered wrongly or not at all, or a connection was lost.
Two things close a connection by design and are left out: invalid UTF-8 goes
in binary frames (in a text frame it closes with 1007), and no frame is larger
than `server.max_frame_bytes` (1009).

The frames come from fuzz_frames.py's generators, which tests/server/test_fuzz.py
draws from too (property tests of `protocol.decode`, and a short run of this
one), with the answer checks here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Literal

import msgspec
from websockets.exceptions import ConnectionClosed

from completer.protocol import PROTOCOL_VERSION, Complete, Error, Hello, decode
from latency_bench.fuzz_frames import Frame, draw_frames
from latency_bench.harness import ServerProcess, collect, complete_msg, connect, running_server
from latency_bench.run_results import Machine, machine, now, write_result

TOKEN = "fuzz-token-0123456789abcdef"  # the server wants 16 characters or more
# The run is about the protocol, not the model: few tokens, a short window
# (a huge document costs one cheap prefill), deadlines that are never hit.
# (fuzz_http.py's too: a body shorter than its Content-Length gets its 408 after compat.body_timeout_s.)
SERVER_SETTINGS = ("request.deadline_ms=60000", "request.max_tokens=4", "model.context_tokens=256",
                   "compat.body_timeout_s=5", "compat.max_inflight=64")
MAX_NEW_TOKENS = 4  # what a served frame may ask for


# -- against the real server ---------------------------------------------------------------

class Expected(msgspec.Struct, frozen=True):
    # "either": a stream, or an error whose id may be null. Near the parser's
    # depth whether a frame decodes depends on how deep the caller's stack
    # already is (msgspec counts Python's recursion limit): the server, deep
    # in its event loop, refuses at ~990 levels what this process decodes.
    what: Literal["error", "ready", "stream", "either", "nothing"]
    id: str | None = None
    code: str | None = None


def expected_answer(frame: Frame) -> Expected:
    """What docs/protocol.md promises for `frame` (test_fuzz.py checks that
    `decode`, used here, answers as the generators expect)."""
    if isinstance(frame.data, bytes):
        return Expected("error", None, "bad_request")  # a binary frame, whatever it holds
    message = decode(frame.data)
    if isinstance(message, Error):
        return Expected("error", message.id, message.code)
    if isinstance(message, Complete):
        return Expected("either" if frame.valid is None else "stream", message.id)
    if isinstance(message, Hello):
        return Expected("ready") if message.protocol == PROTOCOL_VERSION else Expected("error", None, "unsupported")
    return Expected("nothing")  # cancel (of nothing in flight), feedback


async def exchange(ws, frame: Frame, expected: Expected, probe_id: str, timeout: float) -> list[dict]:
    """Send `frame`, then a probe the server answers with an error carrying
    `probe_id`. A session handles frames in order, so what arrives before the
    probe's answer is the frame's; only a stream's end may come after it."""
    await ws.send(frame.data)
    await ws.send(json.dumps({"type": "fuzz-probe", "id": probe_id}))
    answers: list[dict] = []
    probe_answered, streaming = False, expected.what in ("stream", "either")
    while not probe_answered or streaming:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if message.get("id") == probe_id and message.get("type") == "error":
            probe_answered = True
            continue
        answers.append(message)
        ends = message.get("type") in ("done", "error") and (
            message.get("id") == expected.id or expected.what == "either" and message.get("id") is None)
        if streaming and ends:
            streaming = False
    return answers


def wrong_answer(expected: Expected, answers: list[dict]) -> str | None:
    """How `answers` differ from what was promised; None when they do not."""
    if expected.what == "nothing":
        return f"expected no answer, got {answers}" if answers else None
    if expected.what == "ready":
        return None if [a["type"] for a in answers] == ["ready"] else f"expected ready, got {answers}"
    if expected.what == "error":
        ok = len(answers) == 1 and answers[0]["type"] == "error" and \
            (answers[0]["id"], answers[0]["code"]) == (expected.id, expected.code)
        return None if ok else f"expected one error (id {expected.id!r}, {expected.code}), got {answers}"
    if expected.what == "either" and [(a["type"], a["id"]) for a in answers] == [("error", None)]:
        return None if answers[0]["code"] == "bad_request" else f"expected bad_request, got {answers}"
    *deltas, last = answers or [{}]
    if any(d.get("type") != "delta" or d.get("id") != expected.id for d in deltas):
        return f"expected deltas of {expected.id!r}, got {answers}"
    if last.get("id") != expected.id or last.get("type") not in ("done", "error"):
        return f"expected one done or error for {expected.id!r}, got {answers}"
    if last["type"] == "done" and last["text"] != "".join(d["text"] for d in deltas):
        return f"done's text is not the deltas joined: {answers}"
    if last["type"] == "error" and last["code"] == "internal":
        return f"internal error: {last['message']}"
    return None


class Figures(msgspec.Struct):
    command: str = ""
    date: str = ""  # when the run ended (RELIABILITY.md's section says it)
    machine: Machine | None = None  # where it ran, as every benchmark records it
    frames: int = 0
    sent_by_kind: dict[str, int] = {}
    answers_by_kind: dict[str, int] = {}  # "error:bad_request", "done:length", "delta", ...
    unanswered: int = 0  # no answer (or no probe's answer) within the timeout, or the connection closed first
    wrong_answers: int = 0
    examples: list[str] = []  # the first few unanswered or wrong ones
    connections_lost: int = 0
    neighbour_done: int = 0  # another session's completions while the fuzz ran
    neighbour_failed: int = 0
    wall_s: float = 0.0
    server_rss_mb_before: float | None = None
    server_rss_mb_after: float | None = None
    remark: str = ""  # why this run was made (--remark), for RELIABILITY.md

    def note(self, frame: Frame, problem: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(f"{frame.kind} {frame.data[:200]!r}: {problem[:500]}")

    def broken(self) -> bool:
        return bool(self.unanswered or self.wrong_answers or self.connections_lost or self.neighbour_failed
                    or not self.neighbour_done)


async def fuzz_connection(server: ServerProcess, queue: asyncio.Queue, figures: Figures, name: str,
                          timeout: float) -> None:
    """Send the queue's frames over one connection, one after the other,
    checking each answer; a lost connection is counted and opened again."""
    ws = await connect(server, token=TOKEN)
    number = 0
    while (frame := await queue.get()) is not None:
        number += 1
        figures.sent_by_kind[frame.kind] = figures.sent_by_kind.get(frame.kind, 0) + 1
        try:
            expected = expected_answer(frame)
        except Exception as e:  # decode raised, the bug this hunts: the server's answer will show it too
            figures.note(frame, f"decode raised {e!r}")
            expected = Expected("error", None, "bad_request")
        try:
            answers = await exchange(ws, frame, expected, f"fuzz-probe-{name}-{number}", timeout)
        except (asyncio.TimeoutError, ConnectionClosed) as e:
            figures.unanswered += 1
            figures.connections_lost += isinstance(e, ConnectionClosed)
            figures.note(frame, f"no answer: {e!r}")
            await ws.close()
            ws = await connect(server, token=TOKEN)  # what is left on the old one would muddle the next
            continue
        for a in answers:
            key = a["type"] + {"error": f":{a.get('code')}", "done": f":{a.get('reason')}"}.get(a["type"], "")
            figures.answers_by_kind[key] = figures.answers_by_kind.get(key, 0) + 1
        if (problem := wrong_answer(expected, answers)) is not None:
            figures.wrong_answers += 1
            figures.note(frame, problem)
    try:  # after all that, still open and answering
        await ws.send(json.dumps({"type": "hello", "protocol": PROTOCOL_VERSION}))
        assert json.loads(await asyncio.wait_for(ws.recv(), timeout))["type"] == "ready"
    except (asyncio.TimeoutError, ConnectionClosed, AssertionError) as e:
        figures.connections_lost += 1
        figures.examples.append(f"the connection did not answer after its frames: {e!r}")
    await ws.close()


async def neighbour(server: ServerProcess, stop: asyncio.Event, figures: Figures) -> None:
    """Another editor that keeps completing while the fuzz runs."""
    ws = await connect(server, token=TOKEN)
    while not stop.is_set():
        request_id = f"n{figures.neighbour_done + figures.neighbour_failed}"
        try:
            await ws.send(complete_msg(request_id, "def total(items):\n    result = 0\n    ", mode="free",
                                       max_tokens=MAX_NEW_TOKENS))
            deltas, done = await asyncio.wait_for(collect(ws, request_id), 120)
        except (asyncio.TimeoutError, ConnectionClosed) as e:
            figures.neighbour_failed += 1
            figures.examples.append(f"neighbour: {e!r}")
            await ws.close()
            ws = await connect(server, token=TOKEN)
            continue
        if done["type"] == "done" and done["text"] == "".join(deltas):
            figures.neighbour_done += 1
        else:
            figures.neighbour_failed += 1
            figures.examples.append(f"neighbour: {done}")
    await ws.close()


async def fuzz_server(server: ServerProcess, batches: AsyncIterator[list[Frame]], connections: int = 1,
                      timeout: float = 60.0, progress: bool = False) -> Figures:
    """Send every frame of `batches` over `connections` connections while a
    neighbour session completes; the figures of it all."""
    figures, stop = Figures(), asyncio.Event()
    queue: asyncio.Queue[Frame | None] = asyncio.Queue(maxsize=4 * connections)
    started = time.perf_counter()

    async def feed() -> None:
        async for batch in batches:
            for frame in batch:
                await queue.put(frame)
                figures.frames += 1
            if progress:
                print(f"{figures.frames} frames sent, {time.perf_counter() - started:.0f} s, "
                      f"{figures.wrong_answers + figures.unanswered} answered wrongly or not", file=sys.stderr)
        for _ in range(connections):
            await queue.put(None)

    neighbour_task = asyncio.create_task(neighbour(server, stop, figures))
    tasks = [asyncio.create_task(feed())] + [
        asyncio.create_task(fuzz_connection(server, queue, figures, str(n), timeout)) for n in range(connections)]
    try:  # a task that fails ends the run (the feeder would otherwise wait on a full queue forever)
        await asyncio.gather(*tasks)
        stop.set()
        await neighbour_task
    finally:
        for task in [neighbour_task, *tasks]:
            task.cancel()
    figures.wall_s = round(time.perf_counter() - started, 1)
    return figures


# -- the command -------------------------------------------------------------------------------

async def generated_batches(frames: int, seed: int, batch: int) -> AsyncIterator[list[Frame]]:
    """Batches of frames drawn in another process (hypothesis is slow: ~5 ms a
    frame), the next one while this one is sent."""
    loop = asyncio.get_running_loop()
    sizes = [min(batch, frames - start) for start in range(0, frames, batch)]
    with ProcessPoolExecutor(max_workers=1) as pool:
        pending = [loop.run_in_executor(pool, draw_frames, size, seed + i, MAX_NEW_TOKENS)
                   for i, size in enumerate(sizes[:2])]
        for i in range(len(sizes)):
            drawn = await pending[i]
            if i + 2 < len(sizes):
                pending.append(loop.run_in_executor(pool, draw_frames, sizes[i + 2], seed + i + 2, MAX_NEW_TOKENS))
            yield drawn


def rss_mb(server: ServerProcess) -> float:
    import psutil  # the command's alone: the test extra does not install it

    return round(psutil.Process(server.proc.pid).memory_info().rss / 2**20, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1000, help="frames drawn at a time")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--remark", default="", help="why this run was made (shown in RELIABILITY.md)")
    args = ap.parse_args()
    with running_server(*SERVER_SETTINGS, token=TOKEN) as server:
        before = rss_mb(server)
        figures = asyncio.run(fuzz_server(server, generated_batches(args.frames, args.seed, args.batch),
                                          args.connections, progress=True))
        figures.server_rss_mb_before, figures.server_rss_mb_after = before, rss_mb(server)
    shown = [a for a, before in zip(sys.argv[1:], ["", *sys.argv[1:]]) if "--remark" not in (a, before)]
    figures.command = "python -m latency_bench fuzz " + " ".join(shown)
    figures.remark = args.remark
    figures.date, figures.machine = now(), machine()
    report = msgspec.json.format(msgspec.json.encode(figures))
    print(report.decode())
    if args.json:
        write_result(args.json, report)
    return 1 if figures.broken() else 0


if __name__ == "__main__":
    sys.exit(main())
