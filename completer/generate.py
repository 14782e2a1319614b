"""One-shot greedy completion with a static KV cache.

This is the simple loop behind `completer complete` and the evaluation; the
engine (warm per-session cache, batching, speculation) replaces it for serving.
"""

from __future__ import annotations

import codecs
import time
from typing import Literal

import msgspec
import torch

from completer.healing import TokenHealer, consume
from completer.kv import StaticKVCache
from completer.model import Transformer
from completer.prompt import PromptBuilder, Snippet

Mode = Literal["line", "block", "free"]


class Completion(msgspec.Struct):
    text: str
    reason: str  # "stop", "length", "eos"
    prompt_tokens: int
    generated_tokens: int
    prefill_ms: float
    decode_ms: float


def line_mode_end(text: str) -> int | None:
    """Where a `line` completion ends: the first newline after some visible text
    (a completion at the end of `def f():` may begin with a newline and indent)."""
    seen_text = False
    for i, ch in enumerate(text):
        if ch == "\n" and seen_text:
            return i
        if not ch.isspace():
            seen_text = True
    return None


@torch.inference_mode()
def complete(model: Transformer, builder: PromptBuilder, prefix: str, suffix: str = "",
             path: str | None = None, snippets: list[Snippet] | None = None,
             max_tokens: int = 64, mode: Mode = "line",
             healer: TokenHealer | None = None) -> Completion:
    tok = builder.tok
    prompt = builder.build(prefix, suffix, path, snippets)
    tokens, pending = prompt.tokens, b""
    if healer is not None and builder.template.order == "spm":
        tokens, pending = healer.back_off(prompt.tokens, prompt.prefix_tokens)
    n = len(tokens)
    cache = StaticKVCache(model.config, 1, n + max_tokens, dtype=next(model.parameters()).dtype)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stops = set(builder.stop_ids)

    started = time.perf_counter()
    logits = model(torch.tensor([tokens]), torch.arange(n)[None], cache)[:, -1]
    prefill_ms = (time.perf_counter() - started) * 1000

    started = time.perf_counter()
    text, reason, generated = "", "length", 0
    for step in range(max_tokens):
        if pending:
            logits = healer.constrain(logits, healer.allowed(pending, logits.shape[-1]))
        next_id = int(logits.argmax(-1))
        if next_id in stops:
            reason = "eos"
            break
        generated += 1
        pending, new_bytes = consume(pending, tok.token_bytes(next_id))
        text += decoder.decode(new_bytes)
        if mode == "line" and (cut := line_mode_end(text)) is not None:
            text, reason = text[:cut], "stop"
            break
        if step + 1 < max_tokens:
            logits = model(torch.tensor([[next_id]]), torch.tensor([[n + step]]), cache)[:, -1]
    text += decoder.decode(b"", final=True) if reason == "length" else ""
    decode_ms = (time.perf_counter() - started) * 1000
    return Completion(text=text, reason=reason, prompt_tokens=n, generated_tokens=generated,
                      prefill_ms=prefill_ms, decode_ms=decode_ms)
