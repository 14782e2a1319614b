"""llama.cpp's server API, the part completion plugins use (llama.vim,
llama.vscode; Continue's and Tabby's llama.cpp backends): POST /infill,
POST /completion, GET /health, GET /props. docs/compat_api.md has the
fields and what each does here."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from completer import __version__
from completer.protocol import ContextItem, Document
from completer.server.compat.generation import Budget, CompatEngine, Outcome, seed_of, temperature_of
from completer.server.compat.raw_prompt import split_prompt
from completer.server.compat.shapes import (CompletionRequest, DefaultSettings, GenerationSettings, Health,
                                            InfillRequest, LlamaOptions, LlamaPartial, LlamaResult, LlamaTimings,
                                            Props)
from completer.server.compat.wire import ENGINE, EventStream, HttpError, error_envelope, json_response, read_body
from completer.server.service import RequestOptions

# The engine's finish reasons as llama.cpp's stop types; "limit" is also a Budget's end.
STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "deadline": "limit", "limit": "limit"}


async def infill(request: web.Request) -> web.StreamResponse:
    """input_prefix + prompt is the text before the cursor (llama.cpp puts
    `prompt` right after the prefix), input_suffix the text after it, and
    each input_extra chunk a context snippet named by its filename."""
    engine = request.app[ENGINE]
    body = await read_body(request, InfillRequest, engine.body_limit, engine.body_timeout_s)
    received = time.perf_counter()
    document = Document(uri="", prefix=body.input_prefix + body.prompt, suffix=body.input_suffix)
    context = [ContextItem(uri=c.filename, text=c.text) for c in body.input_extra]
    return await answer(request, engine, "infill", body, document, context, received)


async def completion(request: web.Request) -> web.StreamResponse:
    """`prompt` is read back into a document (raw_prompt): a FIM template
    the client filled in, or plain text to continue."""
    engine = request.app[ENGINE]
    body = await read_body(request, CompletionRequest, engine.body_limit, engine.body_timeout_s)
    received = time.perf_counter()
    before, prefix, suffix = split_prompt(body.prompt)
    context = [ContextItem(uri="", text=before)] if before.strip() else []
    return await answer(request, engine, "completion", body, Document(uri="", prefix=prefix, suffix=suffix),
                        context, received)


def options_of(body: LlamaOptions) -> RequestOptions:
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    # `free`: llama.cpp's ends (end of text, n_predict, stop strings, n_indent,
    # the time budget), not the protocol's line or block.
    return RequestOptions(mode="free", max_tokens=None if n_predict is None or n_predict < 0 else n_predict,
                          temperature=temperature_of(body.temperature), stop=tuple(s for s in stop if s),
                          seed=seed_of(body.seed), n=body.n_cmpl or body.n or 1)


async def answer(request: web.Request, engine: CompatEngine, route: str, body: LlamaOptions, document: Document,
                 context: list[ContextItem], received: float) -> web.StreamResponse:
    """Run the request and answer as llama.cpp does: one object (an array of
    them for n_cmpl > 1), or events of text ending with the final object."""
    options = options_of(body)
    if body.stream and options.n > 1:
        raise HttpError(400, "n_cmpl > 1 is not supported with stream", "n_cmpl")
    flight, truncated = engine.start(route, engine.client_of(request, body.id_slot), document, context, options,
                                     received)
    budget = Budget(max(0, body.n_indent), body.t_max_predict_ms)
    slot = max(0, body.id_slot)
    if not body.stream:
        outcome = await engine.run(flight, budget, truncated)
        results = [fields(result(engine, body, options, outcome, i, text), body.response_fields)
                   for i, text in enumerate((outcome.text, *outcome.candidates))]
        return json_response(results if options.n > 1 else results[0])
    events = EventStream(request)

    async def send_piece(text: str) -> None:
        await events.send(LlamaPartial(0, text, slot))

    try:
        outcome = await engine.run(flight, budget, truncated, send_piece)
    except HttpError as e:
        if not events.started:
            raise
        await events.send(error_envelope(e.status, e.message))
        return await events.end()
    # The text went out in pieces: the last event has the figures and no text.
    await events.send(fields(result(engine, body, options, outcome, 0, ""), body.response_fields))
    return await events.end()


def result(engine: CompatEngine, body: LlamaOptions, options: RequestOptions, outcome: Outcome, index: int,
           content: str) -> LlamaResult:
    """The final object of completion `index` (its candidates carry the first one's figures)."""
    t = outcome.timings
    settings = GenerationSettings(outcome.max_tokens, options.temperature, list(options.stop), body.n_indent,
                                  body.t_max_predict_ms, -1 if options.seed is None else options.seed, body.stream)
    return LlamaResult(
        index=index, content=content, id_slot=max(0, body.id_slot), stop=True, model=engine.model_name,
        tokens_predicted=t.generated_tokens, tokens_evaluated=t.prompt_tokens, generation_settings=settings,
        has_new_line="\n" in (outcome.text if index == 0 else content), truncated=outcome.truncated,
        stop_type=STOP_TYPES.get(outcome.reason, "limit"), stopping_word="",
        tokens_cached=t.prompt_tokens + t.generated_tokens, timings=LlamaTimings.of(t))


def fields(value: LlamaResult, paths: list[str] | None) -> LlamaResult | dict:
    """llama.cpp's `response_fields`: only these paths, each under its own
    name ("timings/prompt_n" as a key, not nested); a path that leads
    nowhere is left out (llama.vim's warm-ups ask for [""], so get {})."""
    if not paths:
        return value
    whole, out = msgspec.to_builtins(value), {}
    for path in paths:
        node = whole
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


async def health(request: web.Request) -> web.Response:
    request.app[ENGINE].check_ready()  # 503 "Loading model" until then, as llama.cpp answers
    return json_response(Health("ok"))


async def props(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.check_ready()
    config, target = engine.config, engine.service.target
    defaults = GenerationSettings(config.request.max_tokens, 0.0, [], 0, 0.0, -1, False)
    return json_response(Props(
        default_generation_settings=DefaultSettings(config.model.context_tokens, defaults),
        total_slots=config.engine.max_running, model_alias=target.name, model_path=str(target.directory),
        modalities={"vision": False, "video": False, "audio": False}, build_info=f"completer/{__version__}"))
