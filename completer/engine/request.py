"""What goes into the engine and what comes out: torch-free msgspec Structs,
so the wire schema (`protocol.py`) and clients import them without the model."""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from completer.config import Mode

# Below this a temperature is greedy: 1/t overflows float32 near 1e-38 (and
# 5e-324 is 0.0 in float32), and far above it the draw is already an argmax.
GREEDY_BELOW = 1e-5


class Confidence(msgspec.Struct, frozen=True):
    """How sure the model must be of each token (its probability, at
    temperature 1, among the tokens allowed there) for it to be shown; 0 is
    no rule. `line` and `block` modes only (`stopping.OutputText`)."""

    first: float = 0.0  # up to the first visible token: below it, no suggestion at all
    token: float = 0.0  # later, on the first line: the suggestion ends before a token below it
    line: float = 0.0  # block mode, the lines after the first: the block ends before the first line with one below it

    @property
    def on(self) -> bool:
        return self.first > 0 or self.token > 0 or self.line > 0


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 64  # 0: prefill the prompt into the prefix cache and end (`length`), nothing generated
    temperature: float = 0.0
    mode: Mode = "line"
    stop: tuple[str, ...] = ()
    deadline_s: float | None = None  # seconds from the request's arrival
    seed: int | None = None
    # Completions wanted: the others begin with the 2nd..nth most likely first
    # token and share the prompt's cached K/V (`engine.candidates`).
    n: int = 1
    confidence: Confidence = Confidence()
    report_probs: bool = False  # Finished.probs: each generated token's text and probability

    @property
    def wants_probs(self) -> bool:
        return self.confidence.on or self.report_probs

    @property
    def greedy(self) -> bool:
        return not self.temperature >= GREEDY_BELOW  # NaN is greedy too

    @property
    def priming(self) -> bool:
        """Only prefill the prompt into the prefix cache (llama.vim's extra-context priming)."""
        return self.max_tokens == 0


class Request(msgspec.Struct, frozen=True):
    id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    cursor_line: str = ""  # the prefix's last line (block mode's indentation)
    suffix: str = ""  # text after the cursor (trims what it already has)
    # The first non-blank line after the cursor's, stripped: a completion line
    # equal to it repeats the file, and the completion ends before it.
    next_line: str = ""
    heal: bytes = b""  # token healing: bytes backed off the prompt, to be re-spelled first
    cache_salt: str = ""  # prefix-cache blocks are shared only among requests with the same salt
    # time.perf_counter() when the request arrived (a frame read off the
    # socket): queueing, TTFT, total time and the deadline count from here.
    arrival: float = msgspec.field(default_factory=time.perf_counter)
    # The backed-off token itself (token healing): the prefill pass runs it as a
    # one-token draft, so when the healed first token is that same token the
    # pass has already computed the next one. -1: none.
    heal_token: int = -1
    # Warming (max_tokens 0): the window an open document's next jump may
    # take, prefilled while nothing else waits; the last of all bulk work.
    warm: bool = False
    # Who sent it (a connection; Engine.submit sets it from its `affinity`):
    # admission and prefill share the engine between clients (scheduler.py).
    client: str = ""


class Timings(msgspec.Struct):
    """The protocol's `done.timings`, measured by the engine from the request's arrival."""

    queue_ms: float = 0.0  # arrival to admission
    ttft_ms: float = 0.0  # arrival to the first delta
    total_ms: float = 0.0  # arrival to the end
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rounds: int = 0  # extension: verification passes that checked a proposal
    prefill: Literal["local", "remote"] = "local"
    # Extensions (a KV connector's prefill workers): why the prompt was
    # prefilled where it was (the connector's decision, or "worker_lost":
    # recomputed here after its worker failed), and the K/V shipped from a worker.
    prefill_reason: str = ""
    kv_transfer_bytes: int = 0
    kv_transfer_ms: float = 0.0
    # Extensions: where a keystroke's time went (the critical path). From the
    # arrival: `prepare_ms` building the prompt (document update, tokenizing)
    # until the engine has it; `wait_ms` then until the engine thread takes
    # it (a pass already running); then `queue_ms` ends at admission. Passes:
    # the target's prefill passes this request was in (`prefill_ms`), the
    # drafter's passes for it (catching up on the prompt, drafting: `draft_ms`),
    # the target's decode and verify passes (`decode_passes`, `decode_ms`), and
    # how many target passes came before the first delta (`first_token_passes`).
    moved_tokens: int = 0  # prompt tokens whose K/V were copied from where a recent prompt had them
    prepare_ms: float = 0.0
    wait_ms: float = 0.0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    decode_ms: float = 0.0
    decode_passes: int = 0
    first_token_passes: int = 0


class Delta(msgspec.Struct, frozen=True):
    id: str
    text: str


FinishReason = Literal["stop", "length", "eos", "cancelled", "deadline"]


class Finished(msgspec.Struct, frozen=True):
    id: str
    reason: FinishReason
    text: str
    timings: Timings
    candidates: tuple[str, ...] = ()  # with params.n > 1: the other completions' texts
    cut: str = ""  # the confidence rule that ended the text ("first", "token", "line"), if one did
    probs: tuple[tuple[str, float], ...] = ()  # with params.report_probs: (text, probability) per token taken


class Failed(msgspec.Struct, frozen=True):
    """A request the engine could not finish (the stream raises it as an EngineError)."""

    id: str
    code: str
    message: str


Event = Delta | Finished | Failed


class EngineError(Exception):
    """A request the engine refuses or could not finish; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
