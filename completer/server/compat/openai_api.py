"""OpenAI's completions API, as Continue's, Tabby's and llama.vscode's
OpenAI backends call it: POST /v1/completions and GET /v1/models (and the
same under /completions and /models, for clients whose base URL has no /v1).
docs/compat_api.md has the fields and what each does here."""

from __future__ import annotations

import time

from aiohttp import web

from completer.protocol import ContextItem, Document
from completer.server.compat.generation import Budget, CompatEngine, Outcome, seed_of, temperature_of
from completer.server.compat.raw_prompt import split_prompt
from completer.server.compat.shapes import (Choice, Completion, CompletionsRequest, LlamaTimings, ModelCard,
                                            ModelList, ModelMeta, Usage)
from completer.server.compat.wire import ENGINE, EventStream, HttpError, error_envelope, json_response, read_body
from completer.server.service import RequestOptions

ROUTE = "v1/completions"


def finish_reason(reason: str) -> str:
    """"stop" for the end of text or a stop string, else "length" (max_tokens, a deadline)."""
    return "stop" if reason in ("eos", "stop") else "length"


def document_of(body: CompletionsRequest) -> tuple[list[ContextItem], Document]:
    """With a `suffix` (Tabby's openai/completion), `prompt` is the prefix;
    without one, `prompt` is read back into a document (raw_prompt)."""
    unsupported = {"echo": body.echo, "best_of": (body.best_of or 1) > 1, "logprobs": bool(body.logprobs)}
    for field, asked in unsupported.items():
        if asked:
            raise HttpError(400, f"{field} is not supported: the answer carries the completion's text only", field)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise HttpError(400, f"one prompt per request (got {len(prompt)})", "prompt")
        prompt = prompt[0]
    if body.suffix is not None:
        return [], Document(uri="", prefix=prompt, suffix=body.suffix)
    before, prefix, suffix = split_prompt(prompt)
    return [ContextItem(uri="", text=before)] if before.strip() else [], Document(uri="", prefix=prefix,
                                                                                  suffix=suffix)


def options_of(body: CompletionsRequest) -> RequestOptions:
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    if max_tokens is not None and max_tokens < 0:
        raise HttpError(400, f"max_tokens = {max_tokens}: must be 0 or more", "max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if body.stream and body.n > 1:
        raise HttpError(400, "n > 1 is not supported with stream", "n")
    return RequestOptions(mode="free", max_tokens=max_tokens, temperature=temperature_of(body.temperature),
                          stop=tuple(s for s in stop if s), seed=seed_of(body.seed), n=body.n)


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_body(request, CompletionsRequest, engine.body_limit, engine.body_timeout_s)
    received = time.perf_counter()
    context, document = document_of(body)
    options = options_of(body)
    flight, truncated = engine.start(ROUTE, engine.client_of(request, "openai"), document, context, options,
                                     received)
    head = Completion(id=f"cmpl-{flight.id}", created=int(time.time()), model=body.model or engine.model_name,
                      choices=[])
    if not body.stream:
        outcome = await engine.run(flight, Budget(), truncated)
        choices = [Choice(outcome.text, 0, finish_reason(outcome.reason))]
        choices += [Choice(text, i, "stop") for i, text in enumerate(outcome.candidates, 1)]
        return json_response(last(head, outcome, choices))
    events = EventStream(request)

    async def send_piece(text: str) -> None:
        await events.send(Completion(head.id, head.created, head.model, [Choice(text, 0, None)]))

    try:
        outcome = await engine.run(flight, Budget(), truncated, send_piece)
    except HttpError as e:
        if not events.started:
            raise
        await events.send(error_envelope(e.status, e.message, e.param))
        return await events.end()
    # Tabby reads chunks until one has a finish_reason, and fails on [DONE] before it.
    await events.send(last(head, outcome, [Choice("", 0, finish_reason(outcome.reason))]))
    await events.send(b"[DONE]")
    return await events.end()


def last(head: Completion, outcome: Outcome, choices: list[Choice]) -> Completion:
    """The answer, or the stream's last chunk: with usage and (llama.cpp's extension) timings."""
    t = outcome.timings
    usage = Usage(t.prompt_tokens, t.generated_tokens, t.prompt_tokens + t.generated_tokens)
    return Completion(head.id, head.created, head.model, choices, usage=usage, timings=LlamaTimings.of(t))


async def models(request: web.Request) -> web.Response:
    engine: CompatEngine = request.app[ENGINE]
    engine.check_ready()
    meta = ModelMeta(engine.config.model.context_tokens, engine.service.target.tokenizer.vocab_size)
    return json_response(ModelList([ModelCard(engine.model_name, engine.started, "completer", meta)]))
