"""How long a client should wait after a keystroke before it asks: the
`done.hold_ms` a server sends (issue #48).

A warm keystroke costs the engine a few tokens and a pass, and a superseded
request is cancelled at once, so the clients ask at once on every key (as
llama.vim does) and wait only when the server says so. It says so when it is
shared and loaded: while other clients' requests finished too in the last
HOLD_WINDOW_S, and those requests waited for the engine (`queue_ms -
prepare_ms`: a pass in progress, then admission) HOLD_FROM_MS or more at the
median, a request sent now would wait about as long, and a key typed
meanwhile would cancel it: a client loses little by waiting that long itself,
and the engine is spared the requests it would have cancelled. A client
alone is never held back: what its requests wait for is its own superseded
work, which the next keystroke reuses or cancels. Primes are bulk work that
waits by design and are left out.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from completer.engine.request import Timings

HOLD_WINDOW_S = 2.0  # requests finished this recently describe the load now
HOLD_KEEP = 64  # at most this many of them
HOLD_FROM_MS = 25.0  # below this median wait the server is not loaded: hold 0
HOLD_MOST_MS = 300.0  # never ask a client to wait longer


class ClientHold:
    def __init__(self) -> None:
        self.waits: deque[tuple[float, str, float]] = deque(maxlen=HOLD_KEEP)  # (finished at, client, waited ms)

    def observe(self, now: float, client: str, timings: Timings) -> None:
        """An interactive request of `client` finished at `now` (monotonic seconds)."""
        self.waits.append((now, client, max(0.0, timings.queue_ms - timings.prepare_ms)))

    def hold_ms(self, now: float, client: str) -> float:
        """What `client` is told to wait after a keystroke."""
        while self.waits and now - self.waits[0][0] > HOLD_WINDOW_S:
            self.waits.popleft()
        if all(c == client for _, c, _ in self.waits):  # alone (or nothing seen): ask at once
            return 0.0
        waited = median(w for _, _, w in self.waits)
        return 0.0 if waited < HOLD_FROM_MS else round(min(waited, HOLD_MOST_MS), 1)
