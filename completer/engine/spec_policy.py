"""How far to speculate, per sequence and step.

A proposal of k tokens, each accepted with probability a (while the ones
before it were), yields 1 + a + ... + a^k tokens per verifying pass. The pass
costs more than a plain one (k more tokens through the target, plus k drafter
steps unless the proposal came from n-gram lookup). Both sides are measured as
the engine runs: acceptance per sequence and proposal source, pass times per
batch size and width. The policy picks the k (0 = plain decoding) with the most
tokens per unit of time, so a drafter that does not pay for itself is turned
down instead of slowing decoding. With `spec.adaptive = false` every step
proposes `k_init` tokens.
"""

from __future__ import annotations

import math
from typing import Literal

Source = Literal["ngram", "draft"]

PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before any evidence
PRIOR_WIDTH_COST = 0.08  # extra target time per verified token, relative to a 1-token pass
PRIOR_DRAFT_COST = 0.1  # one drafter step, relative to a 1-token target pass
PROBE_EVERY = 8  # plain steps in a row before a sequence probes with k = 1 again
EMA = 0.2  # weight of a new time measurement


class Acceptance:
    """Per-token acceptance as decayed counts. A round that accepts a of L
    drafts is a hits and, if a < L, one miss (the tokens after a miss are
    never judged)."""

    __slots__ = ("hits", "misses", "decay")

    def __init__(self, rate: float = PRIOR_ACCEPTANCE, weight: float = 4.0, decay: float = 0.9):
        self.hits, self.misses, self.decay = rate * weight, (1 - rate) * weight, decay

    @property
    def rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, proposed: int, accepted: int) -> None:
        self.hits = self.hits * self.decay + accepted
        self.misses = self.misses * self.decay + (accepted < proposed)


class PassCosts:
    """Seconds of a target pass by (batch, width) and of a drafter step by
    batch, as moving averages."""

    def __init__(self) -> None:
        self.target: dict[tuple[int, int], float] = {}
        self.draft: dict[int, float] = {}
        self._nearest: dict[int, list[int]] = {}  # asked per step and row: cached

    def observe_target(self, batch: int, width: int, seconds: float) -> None:
        if width == 1 and (batch, 1) not in self.target:
            self._nearest.clear()
        _update(self.target, (batch, width), seconds)

    def observe_draft(self, batch: int, seconds: float) -> None:
        _update(self.draft, batch, seconds)

    def _nearest_batches(self, batch: int) -> list[int]:
        """Batch sizes with a measured 1-token pass, nearest (in ratio) first."""
        if batch not in self._nearest:
            sizes = {b for b, w in self.target if w == 1}
            self._nearest[batch] = sorted(sizes, key=lambda b: abs(math.log(b / batch)))
        return self._nearest[batch]

    def verify_ratio(self, batch: int, width: int) -> float:
        """A pass of `width` tokens per row over a 1-token pass, at the nearest
        batch size where both were measured."""
        for b in self._nearest_batches(batch):
            if (b, width) in self.target:
                return self.target[(b, width)] / self.target[(b, 1)]
        return 1 + PRIOR_WIDTH_COST * (width - 1)

    def draft_ratio(self, batch: int) -> float:
        for b in self._nearest_batches(batch):
            if b in self.draft:
                return self.draft[b] / self.target[(b, 1)]
        return PRIOR_DRAFT_COST


def _update(table: dict, key, seconds: float) -> None:
    old = table.get(key)
    table[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verifying pass yields: the accepted drafts plus the target's own."""
    return sum(rate ** i for i in range(k + 1))


class SpecState:
    """One sequence's speculation: acceptance per proposal source, and how long it has gone without."""

    __slots__ = ("acceptance", "plain_steps")

    def __init__(self, ngram_rate: float, draft_rate: float):
        self.acceptance = {"ngram": Acceptance(ngram_rate), "draft": Acceptance(draft_rate)}
        self.plain_steps = 0


class SpecPolicy:
    def __init__(self, k_init: int, k_max: int, adaptive: bool = True):
        self.k_init, self.k_max, self.adaptive = k_init, k_max, adaptive
        self.costs = PassCosts()
        # Engine-wide acceptance: where new sequences start.
        self.overall = {s: Acceptance(decay=0.98) for s in ("ngram", "draft")}

    def new_state(self) -> SpecState:
        return SpecState(self.overall["ngram"].rate, self.overall["draft"].rate)

    def gain(self, rate: float, k: int, batch: int, drafted: bool) -> float:
        """Tokens per unit of time relative to plain decoding (1.0)."""
        cost = self.costs.verify_ratio(batch, k + 1) + (k * self.costs.draft_ratio(batch) if drafted else 0)
        return expected_tokens(rate, k) / cost

    def choose(self, state: SpecState, batch: int, offers: dict[Source, int],
               budget: int) -> tuple[Source | None, int]:
        """The source and draft length for this step; (None, 0) = plain decoding.
        offers: how many tokens each available source could propose, in order
        of preference."""
        if budget <= 0 or not offers:
            return None, 0
        if not self.adaptive:
            source = next(iter(offers))
            return source, min(offers[source], self.k_init, budget)
        best: tuple[float, Source | None, int] = (1.0, None, 0)
        options = [(source, min(n, self.k_max, budget)) for source, n in offers.items()]
        for source, longest in options:
            rate = state.acceptance[source].rate
            for k in range(1, longest + 1):
                gain = self.gain(rate, k, batch, drafted=source == "draft")
                if gain > best[0]:
                    best = (gain, source, k)
        _, source, k = best
        if source is not None:
            state.plain_steps = 0
        else:
            state.plain_steps += 1
            if state.plain_steps >= PROBE_EVERY:  # fresh evidence: acceptance changes along a file
                state.plain_steps = 0
                return options[0][0], 1
        return source, k

    def batch_pays(self, picks: list[tuple[SpecState, Source, int]], batch: int) -> bool:
        """Rows of one pass are padded to the widest, and every drafted row waits
        for the longest draft: speculate only if the whole batch gains."""
        if batch == 1 or not self.adaptive:
            return True
        widest = max(k for _, _, k in picks) + 1
        drafted = max((k for _, source, k in picks if source == "draft"), default=0)
        cost = self.costs.verify_ratio(batch, widest) + drafted * self.costs.draft_ratio(batch)
        gained = sum(expected_tokens(state.acceptance[source].rate, k) - 1 for state, source, k in picks)
        return (batch + gained) / cost > batch

    def observe(self, state: SpecState, source: Source, proposed: int, accepted: int) -> None:
        state.acceptance[source].observe(proposed, accepted)
        self.overall[source].observe(proposed, accepted)
