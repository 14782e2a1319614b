"""From accepted tokens to the engine's events: text deltas as they become
safe to send, and one `Finished` per request with its timings (the stop rules
themselves are `stopping.OutputText`'s). A request's candidates send nothing
of their own: their texts go into its `Finished` (`candidates`)."""

from __future__ import annotations

import time

from typing import TYPE_CHECKING

from completer.engine.request import Delta, Event, Failed, FinishReason, Finished
from completer.engine.sequence import Sequence

if TYPE_CHECKING:
    from completer.engine.candidates import Candidates


class OutputProcessor:
    def __init__(self, stop_ids: set[int], candidates: Candidates | None = None):
        """candidates: where a request's and its candidates' ends are collected (None: no `n`)."""
        self.stop_ids = stop_ids
        self.events: list[Event] = []
        self.candidates = candidates

    def append(self, seq: Sequence, tokens: list[int], probs: list[float] | None = None) -> FinishReason | None:
        """Take accepted tokens in order, streaming their text; returns why the
        sequence ended, if it did (the tokens after that are dropped). `probs`:
        each token's probability, for the request's confidence rules."""
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                return "eos"
            if probs is not None and seq.output.unsure(probs[i]):
                return "stop"  # (the text ends before this token, or at the last sure line)
            seq.tokens.append(token)
            delta, ended = seq.output.add(token, probs[i] if probs is not None else None)
            self.emit(seq, delta)
            if ended:
                return "stop"
            if seq.num_generated >= seq.params.max_tokens:
                return "length"
        return None

    def emit(self, seq: Sequence, text: str) -> None:
        if not text or seq.candidate_of is not None:
            return
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            seq.timings.first_token_passes = seq.target_passes
        self.events.append(Delta(seq.id, text))

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """The last delta (text held back that survives the final trim) and `Finished`."""
        if reason != "cancelled":
            self.emit(seq, seq.output.finish())
        now = time.perf_counter()
        t = seq.timings
        t.total_ms = (now - seq.arrival) * 1000
        t.ttft_ms = ((seq.first_token_at or now) - seq.arrival) * 1000
        t.generated_tokens = seq.num_generated
        finished: Finished | None = Finished(seq.id, reason, seq.output.text[: seq.output.emitted], t,
                                             cut=seq.output.cut, probs=tuple(seq.output.pieces or ()))
        if self.candidates is not None:
            if seq.candidate_of is not None:
                finished = self.candidates.candidate_ended(seq, reason, finished.text)
            else:
                finished = self.candidates.first_ended(seq, finished)
        if finished is not None:
            self.events.append(finished)

    def fail(self, seq: Sequence, code: str, message: str) -> None:
        self.events.append(Failed(seq.id, code, message))

    def drain(self) -> list[Event]:
        events, self.events = self.events, []
        return events
