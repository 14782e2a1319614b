"""Draft proposals for speculative decoding, behind one interface.

A proposer says how many tokens it could propose for a sequence now
(`offer`), and proposes k tokens for each of a batch of sequences
(`propose`); the speculator picks source and k per sequence with the policy.
- `NgramProposer`: prompt lookup. Code copies itself (names, call patterns),
  and a match costs no forward pass.
- `DraftModelProposer`: a small model with a paged cache of its own, run k
  steps, batched; sampling requests keep its distribution q for the
  rejection sampler.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Protocol

import torch

from completer.engine.kv_cache_manager import KVCacheManager, advance
from completer.engine.model_runner import ModelRunner
from completer.engine.sampler import Sampler
from completer.engine.sequence import Sequence
from completer.engine.spec_policy import PassCosts, Source


class Proposal(NamedTuple):
    source: Source
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V]: the drafter's q per token (sampling only)


class Proposer(Protocol):
    source: Source

    def offer(self, seq: Sequence, limit: int) -> int:
        """How many tokens (up to `limit`) it can propose for `seq` now; 0 = none."""
        ...

    def propose(self, work: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """k tokens for each (sequence, k), by sequence id."""
        ...


class NgramIndex:
    """Where each n-gram of a token list last ended."""

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are indexed
        self.found: list[int] = []  # the last lookup's continuation

    def update(self, tokens: list[int]) -> None:
        """Index n-grams ending at positions < len(tokens) - 1 (the current tail
        itself must not match itself)."""
        for end in range(max(self.indexed, self.n_min - 1), len(tokens) - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1: end + 1])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the tail."""
        self.update(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n:
                continue
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []


class NgramProposer:
    source: Source = "ngram"

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def offer(self, seq: Sequence, limit: int) -> int:
        if seq.ngram is None:
            seq.ngram = NgramIndex(self.n_min, self.n_max)
        seq.ngram.found = seq.ngram.propose(seq.tokens, limit)
        return len(seq.ngram.found)

    def propose(self, work: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        return {seq.id: Proposal(self.source, seq.ngram.found[:k]) for seq, k in work}


CATCH_UP_CHUNK = 256  # tokens a row in one catch-up pass (a deadline is checked between them)


class DraftModelProposer:
    source: Source = "draft"

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, sampler: Sampler, costs: PassCosts):
        self.runner, self.kv, self.sampler, self.costs = runner, kv, sampler, costs
        # Set by the core: gives a pass up when everyone in it was superseded (a catch-up
        # on a long prompt is a drafter pass as long as a prefill).
        self.interrupted: Callable[[], bool] | None = None

    def offer(self, seq: Sequence, limit: int) -> int:
        return 0 if seq.drafter_far_behind() else limit

    def _catch_up(self, seqs: list[Sequence], rows: dict[str, list[int]]) -> list[Sequence]:
        """Feed the drafter what it has not seen in passes of at most
        CATCH_UP_CHUNK tokens a row (a whole prompt in one pass would hold
        every request in it for as long), leaving out between passes the
        sequences past their deadline (they draft nothing; the core ends them
        after this step's verify pass). Returns the sequences that draft."""
        while long := [s for s in seqs if len(rows[s.id]) > CATCH_UP_CHUNK]:
            started = time.perf_counter()
            batch = [rows[s.id][:CATCH_UP_CHUNK] for s in long]
            self.kv.check_room("draft", long, batch)
            self.runner.execute([s.kv["draft"] for s in long], batch, last_only=True, interrupted=self.interrupted)
            advance([s.kv["draft"] for s in long], map(len, batch))
            took = time.perf_counter() - started
            for seq in long:
                rows[seq.id] = rows[seq.id][CATCH_UP_CHUNK:]
                seq.timings.draft_ms += took * 1000
            now = time.perf_counter()
            seqs = [s for s in seqs if s.deadline is None or now <= s.deadline]
        return seqs

    def propose(self, work: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """Each row first feeds whatever accepted tokens the drafter's cache has not seen."""
        rows = {s.id: s.tokens[s.kv["draft"].computed:] for s, _ in work}
        drafted: dict[str, list[int]] = {s.id: [] for s, _ in work}
        probs: dict[str, list[torch.Tensor]] = {s.id: [] for s, _ in work}
        active = self._catch_up([s for s, _ in work], rows)
        want = {s.id: k for s, k in work}
        while active:
            started = time.perf_counter()
            batch = [rows[s.id] for s in active]
            self.kv.check_room("draft", active, batch)
            logits = self.runner.execute([s.kv["draft"] for s in active], batch, last_only=True,
                                         interrupted=self.interrupted)
            advance([s.kv["draft"] for s in active], map(len, batch))
            for b, seq in enumerate(active):
                token, q = self.sampler.sample(seq, logits[b], heal=False)
                if q is not None:
                    probs[seq.id].append(q)
                drafted[seq.id].append(token)
                rows[seq.id] = [token]
            took = time.perf_counter() - started
            self.costs.observe_draft(len(active), took)
            for seq in active:
                seq.timings.draft_ms += took * 1000
            active = [s for s in active if len(drafted[s.id]) < want[s.id]]
        return {sid: Proposal(self.source, tokens, torch.stack(probs[sid]) if probs[sid] else None)
                for sid, tokens in drafted.items()}
