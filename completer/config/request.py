"""`[request]`: what a request leaves out, filled in the same way for every caller."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from completer.config.problem import ConfigProblem

# How a completion ends: at the line's end, the block's, or at max_tokens (the engine's `SamplingParams.mode`).
Mode = Literal["line", "block", "free"]


class RequestSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Defaults for what a request leaves out (every caller reads them here)."""

    max_tokens: int = 64
    deadline_ms: float = 2000.0
    # The first request of a document on a connection prefills the whole file cold, and no keystroke
    # races it: a keystroke's budget cut its suggestion mid-expression (issue #32).
    first_deadline_ms: float = 15000.0
    mode: Mode = "line"
    # The confidence rules (a token's probability, 0 to 1; 0: no rule; engine.request.Confidence), for
    # `line` and `block` completions: below min_first_prob up to the first visible token, nothing is shown;
    # below min_token_prob later on the first line, the suggestion ends before that token; below
    # min_line_prob on a later line of a block, the block ends before that line.
    # Chosen on the typist (BENCHMARKS.md, 2026-12-06): Tab saves ~10 points more keystrokes than without.
    min_first_prob: float = 0.4
    min_token_prob: float = 0.35
    min_line_prob: float = 0.7


def request_problems(r: RequestSection) -> list[ConfigProblem]:
    """Values of `[request]` that cannot work (against the window: `load.problems`)."""
    found = []
    if r.max_tokens < 1:
        found.append(ConfigProblem(("request.max_tokens",), f"request.max_tokens = {r.max_tokens}: must be at least 1"))
    for key in ("deadline_ms", "first_deadline_ms"):
        if not (getattr(r, key) > 0 and math.isfinite(getattr(r, key))):  # NaN fails too
            found.append(ConfigProblem((f"request.{key}",),
                                       f"request.{key} = {getattr(r, key)}: must be a positive number"))
    for key in ("min_first_prob", "min_token_prob", "min_line_prob"):
        if not 0 <= getattr(r, key) <= 1:  # NaN fails too
            found.append(ConfigProblem((f"request.{key}",), f"request.{key} = {getattr(r, key)}: must be a "
                                       "probability, 0 (no rule) to 1"))
    return found
