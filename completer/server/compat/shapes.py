"""The compatible routes' bodies as msgspec Structs: what llama.cpp's server
and OpenAI's completions API take and answer (docs/compat_api.md has the
field-by-field reading). Unknown request fields are ignored, as both servers
do; a known one of the wrong type is a 400 that names it.

Everything is encoded with msgspec's compact JSON (`"content":"..."`, no
space: llama.vim matches its answers with a regex that wants exactly that),
and no float here may be NaN or infinite (Vim's json_decode rejects them).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from completer.engine.request import Timings
from completer.protocol import MAX_CANDIDATES, MAX_CONTEXT_ITEMS, MAX_STOP_CHARS, MAX_URI_CHARS

# More than the protocol's 16: Continue sends its template's stop tokens and
# the language's stop words in one list. Still bounded: each string costs the
# stop logic a regex alternative and its heads in a set, per request.
MAX_STOP_STRINGS = 64
MAX_RESPONSE_FIELDS = 64

Stop = Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_CHARS)]], Meta(max_length=MAX_STOP_STRINGS)]
Candidates = Annotated[int, Meta(ge=1, le=MAX_CANDIDATES)]


# -- llama.cpp: POST /infill and /completion ---------------------------------

class ExtraChunk(msgspec.Struct, frozen=True):
    """An `input_extra` chunk: another file's text (llama.vim's ring buffer,
    llama.vscode's extra context). Clients add fields of their own (`time`)."""

    text: str
    filename: Annotated[str, Meta(max_length=MAX_URI_CHARS)] = ""


class LlamaOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What /infill and /completion read besides the text. Accepted and left
    to the engine's defaults: `cache_prompt` (the prefix cache is always on),
    `t_max_prompt_ms` (llama.cpp does not implement it either), `samplers`,
    `top_k`, `top_p`, `min_p` and the penalties (the engine samples greedily,
    or at `temperature`)."""

    n_predict: int | None = None  # -1 or absent: request.max_tokens; 0: prefill only, keep it cached
    max_tokens: int | None = None  # llama.cpp reads it when n_predict is absent
    temperature: float | None = None  # absent: greedy (llama.cpp's 0.8 would scatter completions)
    stop: Stop | str = []
    stream: bool = False
    n_indent: int = 0  # a later line indented less than this ends the completion
    t_max_predict_ms: float = 0.0  # past this since generation began, the next newline ends it (0: off)
    id_slot: int = -1  # names the client's prompt state (with its address)
    n_cmpl: Candidates | None = None  # completions wanted; llama.cpp also reads `n`
    n: Candidates | None = None
    seed: int | None = None  # negative: unseeded
    response_fields: Annotated[list[str], Meta(max_length=MAX_RESPONSE_FIELDS)] | None = None


class InfillRequest(LlamaOptions, frozen=True, kw_only=True):
    input_prefix: str
    input_suffix: str
    input_extra: Annotated[list[ExtraChunk], Meta(max_length=MAX_CONTEXT_ITEMS)] = []
    prompt: str = ""  # the text typed since the prefix's end: goes right after it


class CompletionRequest(LlamaOptions, frozen=True, kw_only=True):
    prompt: str  # a FIM template rendered as text, or plain text to continue (docs/compat_api.md)


class LlamaTimings(msgspec.Struct):
    cache_n: int  # prompt tokens whose K/V came from the prefix cache
    prompt_n: int  # prompt tokens computed for this request
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float

    @classmethod
    def of(cls, t: Timings) -> "LlamaTimings":
        """llama.cpp's figures from the engine's: the prompt's time is arrival
        to first token less the queue, the prediction's is the rest."""
        prompt_n = max(0, t.prompt_tokens - t.cached_tokens)
        prompt_ms = max(0.0, t.ttft_ms - t.queue_ms)
        predicted_ms = max(0.0, t.total_ms - t.ttft_ms) if t.generated_tokens else 0.0
        return cls(t.cached_tokens, prompt_n, prompt_ms, _ratio(prompt_ms, prompt_n),
                   _ratio(1000.0 * prompt_n, prompt_ms), t.generated_tokens, predicted_ms,
                   _ratio(predicted_ms, t.generated_tokens), _ratio(1000.0 * t.generated_tokens, predicted_ms))


def _ratio(a: float, b: float) -> float:
    """a / b, 0.0 where b is 0 (llama.cpp writes null there; Vim's json_decode takes neither NaN nor null)."""
    return a / b if b else 0.0


class GenerationSettings(msgspec.Struct):
    n_predict: int
    temperature: float
    stop: list[str]
    n_indent: int
    t_max_predict_ms: float
    seed: int
    stream: bool


class LlamaResult(msgspec.Struct):
    """The final object: the whole answer, or the last stream event (its `content` then is "")."""

    index: int
    content: str
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: GenerationSettings
    has_new_line: bool
    truncated: bool  # the prompt window left out part of the document
    stop_type: str  # "eos", "word" (a stop string) or "limit" (n_predict, n_indent, a time budget)
    stopping_word: str
    tokens_cached: int  # as llama.cpp: the K/V the server holds after it (prompt and completion)
    timings: LlamaTimings
    tokens: list[int] = []


class LlamaPartial(msgspec.Struct):
    """A stream event before the last: a piece of text. Tabby reads `content` and `stop` from every one."""

    index: int
    content: str
    id_slot: int
    stop: bool = False
    tokens: list[int] = []


class Health(msgspec.Struct):
    status: str


class ModelMeta(msgspec.Struct):
    n_ctx: int  # llama.vscode reads the context size here
    n_vocab: int


class DefaultSettings(msgspec.Struct):
    n_ctx: int  # llama.vscode reads the context size here
    params: GenerationSettings


class Props(msgspec.Struct):
    """GET /props: the part of llama.cpp's that clients read."""

    default_generation_settings: DefaultSettings
    total_slots: int
    model_alias: str
    model_path: str
    modalities: dict[str, bool]
    build_info: str
    is_sleeping: bool = False
    endpoint_slots: bool = False
    endpoint_props: bool = True
    endpoint_metrics: bool = False  # /metrics is on the main port


# -- OpenAI: POST /v1/completions, GET /v1/models --------------------------

class CompletionsRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Accepted and ignored: `top_p`, the penalties, `logit_bias`, `user`
    (Continue and Tabby send them, some as null), `stream_options` (usage
    comes on the last chunk always, as llama.cpp sends it)."""

    prompt: str | list[str]
    model: str = ""
    suffix: str | None = None  # Tabby sends null when it has none
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    stop: Stop | str | None = None
    stream: bool = False
    n: Candidates = 1
    seed: int | None = None
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None


class Choice(msgspec.Struct):
    text: str
    index: int
    finish_reason: str | None  # "stop" or "length"; null in stream chunks before the last
    logprobs: None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(msgspec.Struct):
    """The answer, and each stream chunk (then without usage until the last: UNSET fields are left out)."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    object: str = "text_completion"
    usage: Usage | UnsetType = UNSET
    timings: LlamaTimings | UnsetType = UNSET  # an extension, as llama.cpp adds


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    meta: ModelMeta
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# -- errors ----------------------------------------------------------------

class ErrorBody(msgspec.Struct):
    """llama.cpp's error object (`code` the HTTP status) and OpenAI's (`param`) in one."""

    code: int
    message: str
    type: str
    param: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody
