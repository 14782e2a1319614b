"""The wait after a keystroke before a replayed editor asks (issue #48), as
the plugins decide it, so the keystroke bench can put the rules side by side:

- `server` (what both clients do now; debounce.lua and debounce.ts): ask at
  once, unless the server's last `done.hold_ms`, received within
  HOLD_FRESH_S, says to wait (within [0, 200] ms, the Neovim plugin's bounds);
- `rhythm` (the Neovim plugin's rule before): the recent latency (send to
  done, a moving average) but at most 1.5 of the typist's usual gap, within
  [10, 200] ms, the middle of them before anything is known;
- `none`: every key at once, whatever the server says (llama.vim's rule).

A key whose wait the next key cuts short sends nothing.
"""

from __future__ import annotations

PAUSE_S = 1.0  # gaps longer than this are pauses, not the typing rhythm
ALPHA = 0.3
GAP_FACTOR = 1.5
HOLD_FRESH_S = 3.0
MIN_S, MAX_S = 0.0, 0.2  # the Neovim plugin's bounds (debounce_min_ms, debounce_max_ms)
RHYTHM_MIN_S = 0.01  # the rule before: its lower bound


class ClientWait:
    def __init__(self, rule: str) -> None:
        assert rule in ("server", "rhythm", "none"), rule
        self.rule = rule
        self.gap: float | None = None
        self.last_key: float | None = None
        self.latency: float | None = None
        self.held: tuple[float, float] | None = None  # (seconds, when)

    def keystroke(self, now: float) -> None:
        if self.last_key is not None and 0 < now - self.last_key <= PAUSE_S:
            gap = now - self.last_key
            self.gap = gap if self.gap is None else ALPHA * gap + (1 - ALPHA) * self.gap
        self.last_key = now

    def answered(self, done_s: float, hold_ms: float | None, now: float) -> None:
        """A request ended (not cancelled) `done_s` after it was sent, its `done` saying `hold_ms`."""
        self.latency = done_s if self.latency is None else ALPHA * done_s + (1 - ALPHA) * self.latency
        if hold_ms is not None:
            self.held = (hold_ms / 1000, now)

    def delay(self, now: float) -> float:
        """Seconds to wait after the keystroke at `now`."""
        if self.rule == "none":
            return 0.0
        if self.rule == "rhythm":
            if self.latency is None:
                return (RHYTHM_MIN_S + MAX_S) / 2
            wanted = self.latency if self.gap is None else min(self.latency, GAP_FACTOR * self.gap)
            return min(MAX_S, max(RHYTHM_MIN_S, wanted))
        wanted = self.held[0] if self.held and now - self.held[1] <= HOLD_FRESH_S else 0.0
        return min(MAX_S, max(MIN_S, wanted))
