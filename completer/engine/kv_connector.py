"""The engine's plug-in point for K/V computed elsewhere (as vLLM's KV
connector): disaggregated prefill, where a separate worker prefills a long
uncached prompt and ships its K/V into this engine's blocks, implements it
(`completer/disagg/connector.py`). The engine imports nothing of the
implementation: `completer serve` builds one and hands it to `Engine.build`.

Who owns what: the scheduler asks `admit` whether a prompt goes out (the
sequence then waits in Status.REMOTE, its destination blocks reserved); each
step the core takes in the closed jobs (`poll`); a sequence that ends while a
worker may still write its blocks is handed over (`hand_over`), and the
connector releases those blocks when the job closes (`releasing` says some
are still held, so the engine steps until then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import Sequence


class ClosedJobs(NamedTuple):
    """What `poll` found since the last step."""
    ready: list[tuple[Sequence, torch.Tensor]]  # target K/V of the whole prompt arrived; the last token's logits
    here: list[Sequence]  # the worker was lost: prefill here (the deadline leaves time)
    late: list[Sequence]  # the worker was lost and a prefill here would end past the deadline


class KVConnector(Protocol):
    wake: Callable[[], None]  # set by the engine: there is something to poll

    def bind(self, kv: KVCacheManager, pool: KVPool, prefill_chunk: int) -> None:
        """The engine's block managers and its target pool (which workers write into)."""

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """On admission: True if a worker now prefills the target K/V (status REMOTE)."""

    def poll(self, running: list[Sequence]) -> ClosedJobs:
        """The jobs that closed; `running`: the scheduler's, where their sequences are."""

    def hand_over(self, seq: Sequence) -> None:
        """`seq` ends while its job may still write its blocks: the job keeps them until it closes."""

    @property
    def releasing(self) -> bool:
        """Blocks of ended requests still held by their jobs."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A local target prefill pass (this engine's prefill rate)."""

    def observe_decode_pass(self, seconds: float) -> None:
        """A verify pass (what a local chunk would also wait for)."""

    def set_prefill_rate(self, tokens_s: float) -> None:
        """This engine's prefill rate, measured at its start (`calibration`)."""

    @property
    def workers_up(self) -> int:
        """Workers connected now."""

    def close(self) -> None:
        """The engine stops."""
