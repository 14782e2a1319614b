"""A request as the engine sees it: its tokens, its blocks in each cache, its
output state and its timings."""

from __future__ import annotations

import enum
import time
from typing import Literal

import msgspec
import torch

from completer.generate import Mode
from completer.engine.spec_policy import SpecState
from completer.engine.speculative import NgramIndex
from completer.engine.stopping import OutputText



class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 64
    temperature: float = 0.0
    mode: Mode = "line"
    stop: tuple[str, ...] = ()
    deadline_s: float | None = None  # seconds from submission
    seed: int | None = None


class Timings(msgspec.Struct):
    """The protocol's `done.timings`."""

    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rounds: int = 0  # extension: verification passes that checked a proposal
    prefill: Literal["local", "remote"] = "local"


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class CacheState:
    """A sequence's place in one model's paged cache."""

    __slots__ = ("table", "computed", "hashes")

    def __init__(self) -> None:
        self.table: list[int] = []  # block ids
        self.computed = 0  # tokens whose K/V is in the cache
        self.hashes: list[int] = []  # chained hashes of the full computed blocks


class Sequence:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 output: OutputText, stop_ids: set[int]):
        self.id = request_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.params = params
        self.output = output
        self.stop_ids = stop_ids
        self.status = Status.WAITING
        self.target = CacheState()
        self.draft = CacheState()
        self.finish_reason: str | None = None
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.deadline = None if params.deadline_s is None else self.submitted + params.deadline_s
        self.first_token_at: float | None = None
        self.timings = Timings(prompt_tokens=len(prompt))
        self.spec: SpecState | None = None  # acceptance per proposal source
        self.ngram: NgramIndex | None = None  # built on first use
        self.generator: torch.Generator | None = None  # seeded sampling

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        """len(generated) without copying it (checked per token)."""
        return len(self.tokens) - self.prompt_len
