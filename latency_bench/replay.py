"""Replay keystroke traces against a running server, N editors at once.

    python -m latency_bench replay --url ws://127.0.0.1:8750/v1/ws --token-file ~/.config/completer/token \\
        --editors 8 --seconds 60 --out replay.json
    python -m latency_bench replay --llama http://127.0.0.1:8080 --editors 8 --seconds 60

Each editor types its trace (`keystrokes.py`) at the trace's own times (open
loop: a person does not wait for the model) and asks for a completion after
every key, after the wait the plugins' rule gives (`client_wait.py`; a key
the next one comes before sends nothing; every figure counts from the key):

- completer (`--url`): one WebSocket per editor; a `complete` per key (the
  next one supersedes it on the server), a `cancel` when the editor moves to
  another document, and `feedback` for each suggestion shown before the next
  key: accepted when the user's next keys are the suggestion.
- llama.cpp's server (`--llama`): a streamed `POST /completion` per key with
  `cache_prompt`, the previous request abandoned (its connection closed, as
  llama.vim stops its curl job). The prompt is the very token ids completer's
  pipeline builds for that keystroke (same window, same file header; without
  token healing, which llama.cpp does not do), so both servers do the same
  work on the same weights.

Per keystroke a `Sample`; `summarize` turns them into the figures the bench
reports: TTFT, end-to-end and inter-token latency percentiles, the share of
keys answered before the next key, exact match against the real text, cached
share of prompt tokens, acceptance, errors.

Past 300 lines: the simulated editor, its two wire clients (ours and
llama.cpp's) and the report read as one replay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import msgspec

from latency_bench.client_wait import ClientWait
from latency_bench.editors import percentile_ms as nearest_rank_ms
from latency_bench.keystrokes import EditorState, Trace, corpus_files, make_trace

DRAIN_S = 5.0  # after the last key: answers still owed get this long beyond the deadline


class Sample(msgspec.Struct):
    editor: int
    key: int
    sent_s: float  # since the run's start: the key (its request left `wait_s` later, if it did)
    next_key_s: float | None  # until the editor's next key; None after its last
    expect: str
    ttft_s: float | None = None  # first streamed text
    answer_s: float | None = None  # the request's end (done, error, stream end)
    outcome: str = "unanswered"  # done:<reason>, error:<code>, abandoned, unanswered
    text: str = ""
    generated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: dict | None = None  # completer's `done.timings` (the server's side of the timeline)
    wait_s: float = 0.0  # the client's wait before asking (client_wait.py)


class ReplayOptions(msgspec.Struct, frozen=True):
    editors: int = 2
    seconds: float = 30.0
    seed: int = 0
    run: str = "replay"  # names the documents: runs on one server that must not share a cache differ
    max_tokens: int = 64
    deadline_ms: float = 2000.0
    # Context sent with each keystroke, as the clients send open buffers: the editor's
    # most recently used other documents, whole, as they are now (0: none).
    context_files: int = 0
    client_wait: str = "server"  # the plugins' rule for the wait after a key (client_wait.py)
    # How a completer editor reaches the server: "websocket" (its own frames, below) or "lsp"
    # (through a `completer lsp` of its own over stdio, lsp_replay.py; the same frames result).
    via: str = "websocket"


def traces(files: list[tuple[str, str]], opts: ReplayOptions) -> list[Trace]:
    keys = int(opts.seconds / 0.15) + 50  # more than the run can type
    return [make_trace(files, opts.seed, e, keys, opts.run) for e in range(opts.editors)]


async def wait_to_send(wait: ClientWait, trace: Trace, n: int, key, at: float, nxt: float | None, start: float,
                       samples: list[Sample], progress) -> float | None:
    """The client's wait after key `n` (pressed at `at`), slept through; None when
    the next key comes first (the key is recorded as not sent)."""
    wait.keystroke(at)
    delay = wait.delay(at)
    if delay > 0 and nxt is not None and nxt <= delay:
        samples.append(Sample(trace.editor, n, at, nxt, key.expect, outcome="not_sent", wait_s=delay))
        progress()
        return None
    if delay > 0:
        await asyncio.sleep(max(0.0, start + at + delay - time.perf_counter()))
    return delay


def accepted(sample: Sample) -> bool:
    """The user's next keys are the suggestion (a Tab would have saved them)."""
    shown = sample.text.rstrip()
    return bool(shown) and sample.expect.startswith(shown)


def keys_in_time(trace: Trace, seconds: float):
    """(index, key, when it is pressed, seconds until the next one) within `seconds`."""
    at = 0.0
    keys = trace.keys
    for n, key in enumerate(keys):
        at += key.gap_s
        if at > seconds:
            return
        nxt = keys[n + 1].gap_s if n + 1 < len(keys) and at + keys[n + 1].gap_s <= seconds else None
        yield n, key, at, nxt


# -- completer over WebSocket ----------------------------------------------------

async def completer_editor(trace: Trace, url: str, token: str, start: float, opts: ReplayOptions,
                           samples: list[Sample], progress) -> None:
    import websockets

    live: dict[str, Sample] = {}
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {token}"},
                                  max_size=None) as ws:
        await ws.send(json.dumps({"type": "hello", "client": "latency_bench/replay", "protocol": 1}))

        async def read() -> None:
            async for raw in ws:
                msg = json.loads(raw)
                s = live.get(msg.get("id"))
                if s is None:
                    continue
                now = time.perf_counter() - start
                if msg["type"] == "delta":
                    s.ttft_s = s.ttft_s if s.ttft_s is not None else now - s.sent_s
                    s.text += msg["text"]
                    continue
                if msg["type"] not in ("done", "error"):
                    continue
                del live[msg["id"]]
                s.answer_s = now - s.sent_s
                if msg["type"] == "error":
                    s.outcome = f"error:{msg['code']}"
                    continue
                s.outcome, t = f"done:{msg['reason']}", msg["timings"]
                if msg["reason"] != "cancelled":
                    wait.answered(s.answer_s - s.wait_s, msg.get("hold_ms"), now)
                if msg["reason"] == "cancelled":  # superseded: nothing was shown
                    s.text = ""
                s.generated, s.prompt_tokens, s.cached_tokens = (
                    t["generated_tokens"], t["prompt_tokens"], t["cached_tokens"])
                s.timings = t
                if s.text.strip() and (s.next_key_s is None or s.answer_s <= s.next_key_s):
                    await ws.send(json.dumps({"type": "feedback", "id": msg["id"],
                                              "accepted_chars": len(s.text) if accepted(s) else 0}))

        wait = ClientWait(opts.client_wait)
        reader = asyncio.create_task(read())
        state, last = EditorState(trace), None
        recent: list[int] = []  # documents by last use, most recent first
        for n, key, at, nxt in keys_in_time(trace, opts.seconds):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            prefix, suffix = state.press(key)
            rid = f"{trace.editor}-{n}"
            if (delay := await wait_to_send(wait, trace, n, key, at, nxt, start, samples, progress)) is None:
                continue
            if last is not None and last[1] != key.doc and last[0] in live:  # left that document
                await ws.send(json.dumps({"type": "cancel", "id": last[0]}))
            s = Sample(trace.editor, n, time.perf_counter() - start - delay, nxt, key.expect, wait_s=delay)
            live[rid], last = s, (rid, key.doc)
            samples.append(s)
            if key.doc in recent:
                recent.remove(key.doc)
            recent.insert(0, key.doc)
            context = [{"uri": trace.documents[d].uri, "text": state.texts[d]}
                       for d in recent[1: 1 + opts.context_files]]
            await ws.send(json.dumps({
                "type": "complete", "id": rid, "mode": "line", "max_tokens": opts.max_tokens,
                "deadline_ms": opts.deadline_ms,
                "document": {"uri": trace.documents[key.doc].uri, "language": "python",
                             "prefix": prefix, "suffix": suffix},
                **({"context": context} if context else {})}))
            progress()
        deadline = time.perf_counter() + opts.deadline_ms / 1000 + DRAIN_S
        while live and time.perf_counter() < deadline and not reader.done():
            await asyncio.sleep(0.05)
        reader.cancel()


# -- llama.cpp's server over HTTP ------------------------------------------------

async def llama_request(session, url: str, ids: list[int], opts: ReplayOptions, s: Sample,
                        start: float) -> None:
    body = {"prompt": ids, "n_predict": opts.max_tokens, "cache_prompt": True, "stream": True,
            "temperature": 0.0, "stop": ["\n"], "t_max_predict_ms": opts.deadline_ms}
    try:
        async with session.post(f"{url}/completion", json=body) as resp:
            if resp.status != 200:
                s.outcome, s.answer_s = f"error:http_{resp.status}", time.perf_counter() - start - s.sent_s
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter() - start - s.sent_s
                if chunk.get("content"):
                    s.ttft_s = s.ttft_s if s.ttft_s is not None else now
                    s.text += chunk["content"]
                if chunk.get("stop"):
                    t = chunk.get("timings", {})
                    s.answer_s, s.outcome = now, f"done:{chunk.get('stop_type', 'stop')}"
                    s.generated, s.prompt_tokens = t.get("predicted_n", 0), len(ids)
                    s.cached_tokens = max(0, len(ids) - t.get("prompt_n", len(ids)))
                    return
    except asyncio.CancelledError:
        s.outcome = "abandoned"  # leaving the `async with` closes the connection: the server stops
        raise


async def llama_editor(trace: Trace, url: str, builder_for, start: float, opts: ReplayOptions,
                       samples: list[Sample], progress) -> None:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        state, prompts, inflight = EditorState(trace), {}, None
        for n, key, at, nxt in keys_in_time(trace, opts.seconds):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            prefix, suffix = state.press(key)
            if inflight is not None and not inflight.done():
                inflight.cancel()
            doc = trace.documents[key.doc]
            prompt = prompts.setdefault(key.doc, builder_for()).update(prefix, suffix, display(doc.uri))
            s = Sample(trace.editor, n, time.perf_counter() - start, nxt, key.expect)
            samples.append(s)
            inflight = asyncio.create_task(llama_request(session, url, prompt.tokens, opts, s, start))
            progress()
        if inflight is not None:
            await asyncio.wait([inflight], timeout=opts.deadline_ms / 1000 + DRAIN_S)
            inflight.cancel()


def display(uri: str) -> str | None:
    from completer.pipeline import display_path
    return display_path(uri)


def prompt_states(model: str, context_tokens: int, max_tokens: int):
    """A factory of completer's per-document prompt state for `model`, without its weights."""
    from completer.checkpoint import load_tokenizer
    from completer.document import DocumentPrompt
    from completer.loading import detect_template
    from completer.model_store import resolve_target
    from completer.prompt import PromptBuilder, get_template

    tokenizer = load_tokenizer(resolve_target(model))
    template = get_template(detect_template(tokenizer))
    return lambda: DocumentPrompt(PromptBuilder(tokenizer, template, context_tokens - max_tokens))


# -- the run ---------------------------------------------------------------------

async def replay(traces_: list[Trace], opts: ReplayOptions, *, url: str = "", token: str = "",
                 llama: str = "", builder_for=None, progress=lambda: None) -> list[Sample]:
    """All editors at once; every keystroke's sample."""
    samples: list[Sample] = []
    start = time.perf_counter()
    if opts.via == "lsp" and not llama:
        from latency_bench.lsp_replay import lsp_replay
        return await lsp_replay(traces_, opts, url, token, progress)
    if llama:
        runs = [llama_editor(t, llama, builder_for, start, opts, samples, progress) for t in traces_]
    else:
        runs = [completer_editor(t, url, token, start, opts, samples, progress) for t in traces_]
    await asyncio.gather(*runs)
    return sorted(samples, key=lambda s: (s.editor, s.key))


MIN_SAMPLES = 20  # a percentile of fewer answers is not reported


def percentile_ms(values: list[float], q: float) -> float | None:
    return nearest_rank_ms(sorted(values), q) if len(values) >= MIN_SAMPLES else None


def finished(s: Sample, deadline_s: float) -> bool:
    """A suggestion that ended by itself: not cancelled, not cut off by its
    deadline (completer's `deadline`; llama.cpp's `t_max_predict_ms` ends
    with stop type `limit`, as `n_predict` does, so the time tells)."""
    return (s.outcome.startswith("done:") and s.outcome not in ("done:cancelled", "done:deadline")
            and s.answer_s is not None and s.answer_s < deadline_s)


def summarize(samples: list[Sample], deadline_ms: float = ReplayOptions().deadline_ms) -> dict:
    ended = [s for s in samples if finished(s, deadline_ms / 1000)]
    firsts = [s.ttft_s for s in samples if s.ttft_s is not None]
    first_answer = [(s.ttft_s if s.ttft_s is not None else s.answer_s, s.next_key_s) for s in samples
                    if s.next_key_s is not None]
    itl = [(s.answer_s - s.ttft_s) / (s.generated - 1) for s in ended
           if s.ttft_s is not None and s.generated > 1]
    shown = [s for s in ended if s.text.strip() and (s.next_key_s is None or s.answer_s <= s.next_key_s)]
    typed = [s for s in ended if s.expect.strip()]
    computed = [s for s in samples if s.generated > 0]  # their whole prompt went through (cancelled or not)
    prompt = sum(s.prompt_tokens for s in computed)
    outcomes = Counter(s.outcome for s in samples)
    return {
        "keystrokes": len(samples),
        "requests_per_key": round(sum(s.outcome != "not_sent" for s in samples) / max(1, len(samples)), 4),
        "ttft_n": len(firsts), "e2e_n": len(ended), "itl_n": len(itl),
        "served_before_next_key": round(sum(a is not None and a <= n for a, n in first_answer)
                                        / max(1, len(first_answer)), 4),
        # its count, of the keys a next key followed (the share's denominator)
        "served_n": sum(a is not None and a <= n for a, n in first_answer), "next_key_n": len(first_answer),
        "whole_before_next_key": round(sum(s.next_key_s is not None and s.answer_s <= s.next_key_s
                                           for s in ended) / max(1, len(first_answer)), 4),
        **{f"ttft_p{q}_ms": percentile_ms(firsts, q / 100) for q in (50, 90, 99)},
        **{f"e2e_p{q}_ms": percentile_ms([s.answer_s for s in ended], q / 100) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": percentile_ms(itl, q / 100) for q in (50, 90, 99)},
        "completed": len(ended),
        "exact_match": round(sum(s.text.rstrip() == s.expect.rstrip() for s in typed) / max(1, len(typed)), 4),
        "exact_n": len(typed),
        # editor-key -> exact, for comparing two rows on the sites both finished
        "finished_sites": {f"{s.editor}-{s.key}": s.text.rstrip() == s.expect.rstrip() for s in typed},
        # editor-key -> ms, for comparing two rows' latencies on the keystrokes both answered or finished
        "ttft_sites": {f"{s.editor}-{s.key}": round(s.ttft_s * 1000, 2) for s in samples if s.ttft_s is not None},
        "line_sites": {f"{s.editor}-{s.key}": round(s.answer_s * 1000, 2) for s in ended},
        "cached_share": round(sum(s.cached_tokens for s in computed) / prompt, 4) if prompt else None,
        "shown": len(shown),
        "accepted_share": round(sum(accepted(s) for s in shown) / max(1, len(shown)), 4),
        "errors": sum(n for o, n in outcomes.items() if o.startswith("error:") or o == "unanswered"),
        "outcomes": dict(outcomes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="completer's WebSocket, ws://HOST:PORT/v1/ws")
    where.add_argument("--llama", help="llama.cpp server's base URL, http://HOST:PORT")
    ap.add_argument("--token", default="")
    ap.add_argument("--token-file", type=Path, default=None)
    ap.add_argument("--model", default="default", help="for --llama: the tokenizer (completer's model setting)")
    ap.add_argument("--context-tokens", type=int, default=1024, help="for --llama: completer's model.context_tokens")
    ap.add_argument("--corpus", type=Path, default=None, help="a directory of code (default: pip's sources)")
    ap.add_argument("--editors", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    token = a.token or (a.token_file.read_text().strip() if a.token_file else "")
    opts = ReplayOptions(editors=a.editors, seconds=a.seconds, seed=a.seed)
    corpus, files = corpus_files(a.corpus)
    builder_for = prompt_states(a.model, a.context_tokens, opts.max_tokens) if a.llama else None
    typed = traces(files, opts)
    from rich.progress import Progress
    with Progress() as bar:
        task = bar.add_task(f"{opts.editors} editors typing",
                            total=sum(1 for t in typed for _ in keys_in_time(t, opts.seconds)))
        samples = asyncio.run(replay(typed, opts, url=a.url or "", token=token, llama=a.llama or "",
                                     builder_for=builder_for, progress=lambda: bar.advance(task)))
    summary = summarize(samples)
    print(json.dumps(summary, indent=1))
    if a.out:
        a.out.write_bytes(msgspec.json.encode({"corpus": corpus, "options": opts, "summary": summary,
                                               "samples": samples}))


if __name__ == "__main__":
    main()
