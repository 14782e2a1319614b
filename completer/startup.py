"""One progress display for a server's start: a named model's first
download, then loading the models and starting the engine, until `ready`.

The start is a few stages in order, each given a share of the whole; the
display says the stage and the whole's percent. On a terminal it is one rich
bar on stderr; otherwise (a pipe, a log, a test) one line per stage, plus a
line each quarter of a download. What it says is also what `/healthz` and a
refused WebSocket handshake say while the models load (`describe`)."""

from __future__ import annotations

import sys
import threading
import time

# The shares of the whole, measured on the default model on 2 cores: loading
# the weights is most of a start from the cache; on a first start the
# download (~90 MB) is about as long again.
CACHED = {"loading the model": (0.0, 0.85), "starting the engine": (0.85, 1.0)}
FIRST_START = {"downloading the model": (0.0, 0.45), "extracting the model": (0.45, 0.5),
               "loading the model": (0.5, 0.92), "starting the engine": (0.92, 1.0)}


class StartupProgress:
    """Thread-safe: the loading thread updates it, the event loop reads it."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.stages = dict(CACHED)
        self.stage = "starting"
        self.detail = ""
        self.fraction = 0.0  # of the whole start
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._last_quarter = -1
        self._bar = None
        self._task = None

    def first_start(self) -> None:
        """The model must be fetched first: the download gets its share."""
        self.stages = dict(FIRST_START)

    def enter(self, stage: str, detail: str = "") -> None:
        """The next stage begins (its start is where the whole stands)."""
        with self._lock:
            self.stage, self.detail = stage, detail
            self.fraction = max(self.fraction, self.stages.get(stage, (self.fraction,))[0])
            self._last_quarter = 0
        self._show(new_stage=True)

    def advance(self, done: float, detail: str = "") -> None:
        """`done` (0..1) of the current stage is behind us."""
        start, end = self.stages.get(self.stage, (self.fraction, self.fraction))
        with self._lock:
            self.fraction = max(self.fraction, start + (end - start) * min(max(done, 0.0), 1.0))
            self.detail = detail or self.detail
            quarter = int(done * 4)
            new_quarter = quarter > self._last_quarter
            self._last_quarter = max(quarter, self._last_quarter)
        self._show(new_stage=False, new_quarter=new_quarter)

    @property
    def percent(self) -> int:
        return int(self.fraction * 100)

    def describe(self) -> str:
        """`loading, 55%: loading the model (SmolLM2-135M-Instruct.Q4_1)`."""
        detail = f" ({self.detail})" if self.detail else ""
        return f"loading, {self.percent}%: {self.stage}{detail}"

    def done(self) -> None:
        """Ready: the bar ends at 100% (the caller prints the `ready` line)."""
        with self._lock:
            self.fraction, self.stage, self.detail = 1.0, "ready", ""
        if self._bar is not None:
            self._bar.update(self._task, completed=100, description="ready")
            self._bar.stop()
            self._bar = None

    def fail(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _show(self, new_stage: bool, new_quarter: bool = False) -> None:
        if not self.enabled:
            return
        if self.stream.isatty():
            self._show_bar()
        elif new_stage or new_quarter:  # a log gets few lines: the stages, and a download's quarters
            elapsed = time.monotonic() - self.started
            print(f"starting: {self.describe()} [{elapsed:.0f} s]", file=self.stream, flush=True)

    def _show_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        if self._bar is None:
            self._bar = Progress(TextColumn("starting: {task.description}"), BarColumn(),
                                 TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                                 console=Console(file=self.stream))
            self._task = self._bar.add_task(self.stage, total=100)
            self._bar.start()
        detail = f" ({self.detail})" if self.detail else ""
        self._bar.update(self._task, completed=self.percent, description=f"{self.stage}{detail}")
