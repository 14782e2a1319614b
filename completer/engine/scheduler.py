"""Which sequences run this step, and how much of each prompt is prefilled.

Requests wait in arrival order; the oldest starts as soon as its worst case
fits in every pool beside the running sequences' (so decoding never runs out
of blocks) and fewer than `max_running` run. Prompts are prefilled in chunks:
at most `prefill_chunk` prompt tokens a step over all sequences, so one long
prompt cannot stall the others' decoding. Sequences past their deadline are
handed back to be finished, here and between a step's passes.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Protocol

from completer.engine.config import EngineConfig
from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.sequence import Sequence, Status


class StepPlan(NamedTuple):
    expired: list[Sequence]  # past their deadline: finish them
    prefill: list[tuple[Sequence, int]]  # (sequence, prompt tokens it may prefill this step)


def padded_groups(chunks: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
    """(sequence, new tokens) chunks grouped into passes: rows of a pass are
    padded to its longest, so a group takes chunks, shortest first, while the
    padded size stays within twice the tokens it holds. A pass has a fixed
    cost (every layer's weights read once), so a dozen warm keystrokes of
    ~30 tokens cost about what two of them cost in passes of their own."""
    groups: list[list[tuple[Sequence, int]]] = []
    total = 0
    for seq, n in sorted(chunks, key=lambda c: c[1]):
        if groups and (len(groups[-1]) + 1) * n <= 2 * (total + n):
            groups[-1].append((seq, n))
            total += n
        else:
            groups.append([(seq, n)])
            total = n
    return groups


class PrefillConnector(Protocol):
    """Where an admitted prompt may be prefilled instead of here (disaggregation:
    `remote_prefill.RemotePrefillSteps`)."""

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """On admission, before its prefill is planned: True if a worker now
        prefills its target K/V (the sequence waits in Status.REMOTE)."""


class Scheduler:
    """The queues, and the one place a sequence's status changes:
    WAITING -> PREFILL (admitted; or REMOTE, a worker prefills it, then PREFILL)
    -> DECODE (its first token) -> FINISHED. A request's candidates (`n`)
    join running in PREFILL through `add_forked`."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, connector: PrefillConnector | None = None):
        self.config = config
        self.kv = kv
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queue_full(self) -> bool:
        return len(self.waiting) >= self.config.max_queue

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_forked(self, seq: Sequence) -> None:
        """A candidate forked from a running request (its blocks already admitted)."""
        seq.status = Status.PREFILL
        self.running.append(seq)

    def start_decoding(self, seq: Sequence) -> None:
        seq.status = Status.DECODE

    def prefill_here(self, seq: Sequence) -> None:
        """A worker's job closed: its K/V arrived (the first token is next), or
        it was lost and the prompt is prefilled here."""
        seq.status = Status.PREFILL

    def remove(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def expire(self, now: float) -> list[Sequence]:
        """The sequences past their deadline, taken out of the queues."""
        expired = [s for s in (*self.waiting, *self.running) if s.deadline is not None and now > s.deadline]
        for seq in expired:
            self.remove(seq)
        return expired

    def schedule(self, now: float) -> StepPlan:
        expired = self.expire(now)
        self._admit(now)
        budget, prefill = self.config.prefill_chunk, []
        for seq in self.running:
            if seq.status not in (Status.PREFILL, Status.REMOTE) or not (left := seq.prefill_left):
                continue
            if budget <= 0:
                break
            prefill.append((seq, budget))  # the drafter keeps pace within the same budget
            budget -= min(budget, left)
        return StepPlan(expired, prefill)

    @property
    def only_transfers(self) -> bool:
        """Every running sequence waits for a worker's K/V: nothing to compute now."""
        return bool(self.running) and all(s.status is Status.REMOTE for s in self.running)

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.status is Status.DECODE]

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if not self.kv.admit(seq, self.running):
                break
            self.waiting.popleft()
            seq.status = Status.PREFILL
            seq.timings.queue_ms = (now - seq.arrival) * 1000
            seq.timings.cached_tokens = seq.kv["target"].computed
            self.running.append(seq)
            if self.connector is not None and self.connector.admit(seq, self.running):
                seq.status = Status.REMOTE
