"""The one way in: (document, context, request options, config) -> the
engine's request. The server's sessions, `completer complete`, `completer
evaluate` and the benchmarks all build their requests here, from the same
config sections, so what is measured is what is served.

`LocalCompleter` bundles the pipeline with an engine in this process (the
CLI, evaluation and benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

import msgspec

from completer.config import Config, Mode
from completer.document import DocumentPrompt
from completer.engine.engine import Engine
from completer.engine.streams import RequestStream
from completer.engine.request import Confidence, Request, SamplingParams
from completer.engine.stopping import next_nonblank_line
from completer.healing import back_off
from completer.loading import LoadedModel
from completer.prompt import Snippet
from completer.protocol import ContextItem, Document
from completer.retrieval import WindowCache

SUFFIX_FOR_TRIMMING = 256  # chars after the cursor the stop logic looks at
DISPLAY_PATH_CHARS = 160


class RequestOptions(msgspec.Struct, frozen=True):
    """What a request may set; None takes the config's `[request]` default."""

    mode: Mode | None = None
    max_tokens: int | None = None  # 0: only prefill the prompt into the cache
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    deadline_ms: float | None = None
    seed: int | None = None
    cache_salt: str = ""  # who may share this request's cached prefix (see server.prefix_cache_scope)
    n: int = 1  # completions wanted (the engine may return fewer)
    min_first_prob: float | None = None  # the confidence rules (engine.request.Confidence)
    min_token_prob: float | None = None
    min_line_prob: float | None = None
    report_probs: bool = False  # Finished.probs: each token's text and probability

    @property
    def priming(self) -> bool:
        return self.max_tokens == 0  # as SamplingParams.priming, before the defaults apply


def display_path(uri: str) -> str | None:
    """`file:///home/me/app/models.py` -> `app/models.py` (the prompt's file
    header); None for a document without a name (no header). Any string is a
    name: one that does not parse as a URI is taken as a path, and only the
    last DISPLAY_PATH_CHARS chars are kept."""
    if not uri:
        return None
    try:
        path = unquote(urlsplit(uri).path) or uri
    except ValueError:  # "http://[": not a URI, still a name
        path = uri
    return "/".join(path.rstrip("/").split("/")[-2:])[-DISPLAY_PATH_CHARS:]


class CompletionPipeline:
    def __init__(self, target: LoadedModel, config: Config):
        self.target = target
        self.defaults = config.request
        self.window = config.model.context_tokens  # prompt and completion
        self.budget = self.window - config.request.max_tokens  # prompt tokens
        self.retrieval = config.model.retrieval
        self.retrieval_hold, self.window_grid = config.model.retrieval_hold, config.model.window_grid
        self.token_healing = config.model.token_healing
        # (The server's own defaults are never cut: a config may set them past the cap.)
        self.max_deadline_ms = max(config.server.max_deadline_ms, self.defaults.deadline_ms,
                                   self.defaults.first_deadline_ms)

    def document(self, retrieval: bool | None = None, windows: WindowCache | None = None) -> DocumentPrompt:
        """Prompt state for one document: keystrokes re-tokenize only what changed.
        `retrieval`: choose context windows (None: model.retrieval), from the
        files cut in `windows` (the client's; None: the document's own)."""
        retrieval = self.retrieval if retrieval is None else retrieval
        return DocumentPrompt(self.target.prompt_builder(self.budget, self.window_grid), retrieval, windows,
                              hold_context=self.retrieval_hold)

    def request(self, request_id: str, document: Document, context: Iterable[ContextItem] = (),
                options: RequestOptions = RequestOptions(), state: DocumentPrompt | None = None,
                arrival: float | None = None) -> Request:
        """The engine request. `state`: the document's prompt state (a fresh one
        if None); `arrival`: when the request arrived (default: now). When the
        prompt ends with the prefix (SPM, the prefix template), token healing
        backs off its last token, to be re-spelled (`model.token_healing`)."""
        arrival = time.perf_counter() if arrival is None else arrival
        state = state or self.document()
        snippets = [Snippet(display_path(c.uri) or "", c.text, c.kind) for c in context]
        prompt = state.update(document.prefix, document.suffix, display_path(document.uri), snippets)
        tokens, heal = prompt.tokens, b""
        if self.token_healing and state.builder.template.order != "psm":
            tokens, heal = back_off(self.target.tokenizer, prompt.tokens, prompt.prefix_tokens)
        heal_token = prompt.tokens[-1] if heal else -1
        d = self.defaults
        deadline_ms = min(d.deadline_ms if options.deadline_ms is None else options.deadline_ms, self.max_deadline_ms)
        # A request may ask for more than the default; the window still bounds prompt + completion.
        wanted = d.max_tokens if options.max_tokens is None else options.max_tokens
        max_tokens = min(wanted, self.window - len(tokens))
        confidence = Confidence(*(getattr(d if getattr(options, k) is None else options, k)
                                  for k in ("min_first_prob", "min_token_prob", "min_line_prob")))
        params = SamplingParams(max_tokens=max_tokens, temperature=options.temperature,
                                mode=options.mode or d.mode, stop=options.stop, deadline_s=deadline_ms / 1000,
                                seed=options.seed, n=options.n, confidence=confidence,
                                report_probs=options.report_probs)
        prefix = document.prefix
        return Request(request_id, tokens, params, cursor_line=prefix[prefix.rfind("\n") + 1:],
                       suffix=document.suffix[:SUFFIX_FOR_TRIMMING], next_line=next_nonblank_line(document.suffix),
                       heal=heal, heal_token=heal_token, arrival=arrival, cache_salt=options.cache_salt)


class LocalCompleter:
    """An engine and its pipeline in this process; `async with` starts and stops the engine."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, config: Config):
        self.pipeline = CompletionPipeline(target, config)
        self.engine = Engine.build(target, draft, config.engine, config.spec)
        self.count = 0

    async def __aenter__(self) -> "LocalCompleter":
        self.engine.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.engine.stop()

    def stream(self, document: Document, context: Iterable[ContextItem] = (),
               options: RequestOptions = RequestOptions(), state: DocumentPrompt | None = None,
               request_id: str | None = None) -> RequestStream:
        """Submit one completion; iterate the stream for deltas, `await .finished()` for the end."""
        self.count += 1
        request = self.pipeline.request(request_id or f"local-{self.count}", document, context, options, state)
        return self.engine.submit(request)
