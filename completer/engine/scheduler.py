"""Which sequences run this step, and how much of each prompt is prefilled.

Interactive work first (`engine.interactive_first`): a sequence is *bulk* when
it primes (max_tokens 0) or has more than `bulk_tokens` prompt tokens left to
compute when admitted (another editor's cold file, a far jump at a large
window); every other sequence is interactive. A step prefills interactive
chunks (at most `prefill_chunk` tokens over all of them) and decodes; a bulk
prompt gets a chunk of `bulk_chunk` tokens only in a step with no interactive
prefill or decode to do (the bulk prompt with the least left first), and its
pass stops between layers as soon as an interactive request arrives (the
executor keeps it and goes on from that layer later). So a keystroke waits
behind bulk work for at most one layer of one bulk pass, except when
interactive work has kept bulk work waiting `bulk_starve_ms`: then the
oldest bulk prompt runs a slice of `bulk_slice_ms` however busy the engine
is, so no flood of keystrokes starves it. Warming (`Request.warm`: the
windows a document's next jump may take) comes after all other bulk work,
one warm prompt admitted at a time, and is never given a starved slice.

Requests are admitted while their worst case fits in every pool beside the
running sequences' (so decoding never runs out of blocks) and fewer than
`max_running` run: in turns across clients (the one holding fewest running
first), in arrival order within a client's; with interactive_first a
request that does not fit does not hold back the ones behind it. Interactive
prefill is planned in turns across clients too, the shortest first within a
turn: one client's flood never takes another's keystroke's place. Sequences past
their deadline are handed back to be finished, here and between a step's
passes. With interactive_first off: first come, first served, `prefill_chunk`
tokens a step over every prompt.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, NamedTuple

from completer.config import EngineConfig
from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.moved_kv import MovedRun
from completer.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from completer.engine.kv_connector import KVConnector


BULK_CONTEXT = 2048  # context up to which a bulk pass takes `bulk_chunk` tokens (fewer past it)
BULK_MIN_CHUNK = 32


class PrefillChunk(NamedTuple):
    """Prompt tokens [start, start + n) of a sequence, computed in one pool this step."""
    seq: Sequence
    role: str
    start: int
    n: int
    heal: bool = False  # the backed-off token rides along, verified as a draft (its first token too)


class Fork(NamedTuple):
    """A request's candidates (`n`) that join running this step, admitted;
    none where they would not be cheap now (`candidates.py`)."""
    seq: Sequence
    candidates: list[Sequence]


class SchedulerOutput(NamedTuple):
    """The whole step: who ends, whose candidates join, what is prefilled
    where, which moved K/V is copied in first, and who decodes. Every block
    the step writes is allocated: the prefill chunks', the copies', and each
    decoding sequence's verify step's (`KVCacheManager.grow_ahead`)."""
    expired: list[Sequence]  # past their deadline: finish them
    prefill: list[PrefillChunk]
    copies: list[tuple[Sequence, MovedRun, list[int]]] = []  # (sequence, its moved run, destination slots)
    # Decoding now, or from the first token this step's prefill gives them (the
    # executor leaves out those a cancel or an end took meanwhile).
    decode: list[Sequence] = []
    forks: list[Fork] = []
    # With a starved bulk chunk (prefill holds it alone): its pass stops at this
    # perf_counter() time (else at the arrival of work that goes first).
    slice_until: float | None = None


def by_turns(seqs: list[Sequence], held: Counter | None = None, key=None) -> list[Sequence]:
    """`seqs` in turns across their clients (`Request.client`): every
    client's first before any client's second, a client counted as already
    holding `held[client]` turns; within a turn by `key` (else in order). So
    one client's flood of prompts, however early, never comes before another
    client's one keystroke."""
    turn, ranked = Counter(held or ()), []
    for i, seq in enumerate(seqs):
        client = seq.request.client
        ranked.append((turn[client], key(seq) if key else 0, i, seq))
        turn[client] += 1
    return [seq for *_, seq in sorted(ranked, key=lambda r: r[:3])]


class Scheduler:
    """The queues, the registry of live requests (`requests`: waiting,
    running and their candidates, by id), and the one place a sequence's
    status changes: WAITING -> PREFILL (admitted; or REMOTE, a connector's
    worker prefills it, then PREFILL) -> DECODE (its first token) -> FINISHED.
    A request's candidates (`n`), asked for at its first token (`fork`),
    join running in PREFILL at the next plan."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, connector: KVConnector | None = None,
                 defer_draft_prefill: bool = False):
        self.config = config
        self.kv = kv
        self.connector = connector
        self.defer_draft_prefill = defer_draft_prefill  # the drafter takes a prompt in when it first drafts
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.forking: list[tuple[Sequence, list[Sequence]]] = []  # candidates asked for, by request
        self.bulk_waits_since: float | None = None  # bulk work ready and made no progress since

    def is_bulk(self, uncached: int, priming: bool, warm: bool = False) -> bool:
        """Whether a prompt with this many tokens left to compute is bulk work (warming always is)."""
        return warm or self.config.interactive_first and (priming or uncached > self.config.bulk_tokens)

    def bulk_progressed(self) -> None:
        """A bulk pass ran at least one layer: the starvation clock starts again."""
        self.bulk_waits_since = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.forking)

    @property
    def queue_full(self) -> bool:
        return len(self.waiting) >= self.config.max_queue

    def crowding(self, client: str) -> Sequence | None:
        """With the queue full: the newest waiting request of the client that
        holds most of it, if that client would still hold more than `client`
        once it joined (it gives way); else None (`client` is refused)."""
        counts = Counter(s.request.client for s in self.waiting)
        top, most = counts.most_common(1)[0] if counts else (client, 0)
        if top == client or most <= counts[client] + 1:
            return None
        return next(s for s in reversed(self.waiting) if s.request.client == top)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.requests[seq.id] = seq

    def fork(self, seq: Sequence, candidates: list[Sequence]) -> None:
        """`seq` chose its first token: its candidates ask to join (the next plan decides)."""
        self.forking.append((seq, candidates))

    def _fork(self) -> list[Fork]:
        """The candidates asked for join where that is cheap: room in the batch
        (`candidates_max_batch`), no request waiting to be admitted, their
        worst case fits beside the running, and the prompt's target K/V still
        cached (a candidate prefills at most its last partial block)."""
        forks, self.forking = self.forking, []
        return [Fork(seq, self._join(seq, candidates)) for seq, candidates in forks]

    def _join(self, seq: Sequence, candidates: list[Sequence]) -> list[Sequence]:
        group, joined = seq.candidates, []
        group.forking = False
        if not group.wanted or (seq.status is Status.FINISHED and group.first is None) \
                or any(not s.request.warm for s in self.waiting):  # (no `first`: it failed)
            return joined
        room = min(self.config.candidates_max_batch, self.config.max_running) - len(self.running)
        for candidate in candidates:
            if len(joined) >= room:
                break
            if candidate.id in self.requests:
                continue  # (no editor names a request so; one that did keeps its name)
            if not self.kv.admit(candidate, self.running):
                break  # the rest would not fit either
            if candidate.prompt_len - candidate.kv["target"].computed > self.kv.block_size:
                self.kv.free(candidate)  # the target's K/V of the prompt left the cache: no longer cheap
                break
            candidate.status = Status.PREFILL
            candidate.timings.queue_ms = seq.timings.queue_ms
            self.running.append(candidate)
            self.requests[candidate.id] = candidate
            group.running.append(candidate)
            joined.append(candidate)
        return joined

    def cancel_forks(self, request_id: str) -> None:
        """A request that ended is cancelled before its candidates joined: they never will."""
        for seq, _ in self.forking:
            if seq.id == request_id:
                seq.candidates.cancelled = True

    def start_decoding(self, seq: Sequence) -> None:
        seq.status = Status.DECODE

    def prefill_here(self, seq: Sequence) -> None:
        """A worker's job closed: its K/V arrived (the first token is next), or
        it was lost and the prompt is prefilled here."""
        seq.status = Status.PREFILL

    def remove(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if self.requests.get(seq.id) is seq:
            del self.requests[seq.id]
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

    def schedule(self, now: float) -> SchedulerOutput:
        expired = self.expire(now)
        forks = self._fork()
        self._admit(now)
        budget, prefill = self.config.prefill_chunk, []
        ready = [s for s in self.running if s.status in (Status.PREFILL, Status.REMOTE) and s.prefill_left
                 and not s.bulk]
        for seq in by_turns(ready, key=lambda s: s.prefill_left):
            if budget <= 0:
                break
            prefill.append((seq, budget))  # the drafter keeps pace within the same budget
            budget -= min(budget, seq.prefill_left)
        plan = self._plan(expired, prefill) if prefill else self._bulk_plan(now, expired)
        return plan._replace(forks=forks)

    def _bulk_plan(self, now: float, expired: list[Sequence]) -> SchedulerOutput:
        """A bulk prompt's next chunk when interactive work lets it run: the
        one with the least left (a cold file the user types in before another
        editor's long open); when it starved, a slice for the oldest."""
        ready = [s for s in self.running if s.bulk and s.status is Status.PREFILL and s.prefill_left]
        bulk = [s for s in ready if not s.request.warm]
        if not bulk:
            self.bulk_waits_since = None
        elif self.bulk_waits_since is None:
            self.bulk_waits_since = now
        if not ready:
            return self._plan(expired, [])
        if not any(not s.bulk for s in self.decoding()):
            shortest = min(ready, key=lambda s: (s.request.warm, s.prefill_left))
            return self._plan(expired, [(shortest, self.bulk_chunk(shortest))])
        if not bulk or (now - self.bulk_waits_since) * 1000 < self.config.bulk_starve_ms:
            return self._plan(expired, [])
        return self._plan(expired, [(bulk[0], self.bulk_chunk(bulk[0]))],
                          slice_until=now + self.config.bulk_slice_ms / 1000)

    def _plan(self, expired: list[Sequence], budgets: list[tuple[Sequence, int]],
              slice_until: float | None = None) -> SchedulerOutput:
        """Each sequence's budget as chunks per pool (a moved run copied in
        first, the target's prefill going on after it), their blocks
        allocated; and who decodes: those decoding now and those whose
        prompt the target completes this step (priming requests end instead)."""
        chunks, copies = [], []
        for seq, budget in budgets:
            moved, target = seq.moved, seq.kv["target"]
            if moved is not None and target.computed == moved.at:
                copies.append((seq, *self.kv.moved_slots(seq)))
            for role in seq.local_roles():
                if role == "draft" and self.defer_draft_prefill and not seq.params.priming:
                    continue
                start = seq.kv[role].computed + (moved.length if role == "target" and copies
                                                 and copies[-1][0] is seq else 0)
                end = moved.at if role == "target" and moved is not None and start < moved.at else seq.prompt_len
                if (n := min(budget, end - start)) > 0:
                    chunks.append(PrefillChunk(seq, role, start, n, self._heals(seq, role, start + n)))
        for c in chunks:
            self.kv.grow(c.seq, c.role, c.start + c.n + c.heal)
        decode = self.decoding() + [c.seq for c in chunks if c.role == "target" and c.start + c.n == c.seq.prompt_len
                                    and not c.seq.params.priming]
        for seq in decode:
            self.kv.grow_ahead(seq, starting=seq.status is not Status.DECODE)
        return SchedulerOutput(expired, chunks, copies, decode, slice_until=slice_until)

    def _heals(self, seq: Sequence, role: str, end: int) -> bool:
        """Whether a chunk ending at `end` ends the prompt and the backed-off
        token rides along as a draft (the first token is then verified in the same pass)."""
        return (role == "target" and self.config.heal_in_prefill and seq.request.heal_token >= 0
                and bool(seq.output.heal) and seq.first_token is None and seq.params.max_tokens >= 2
                and end == seq.prompt_len)

    def bulk_chunk(self, seq: Sequence) -> int:
        """`bulk_chunk` tokens while the context is short, fewer past
        BULK_CONTEXT: a layer's attention grows with tokens x context, and a
        keystroke may wait for one layer (measured on 2 cores, SmolLM2 at int4:
        a 256-token layer took ~14 ms at 1k of context, ~35-70 ms at 5-7k;
        attention's time is linear in the tokens, so smaller chunks cost
        little throughput). A function of the context, so a stopped pass's
        chunk is planned again the same."""
        context = seq.kv["target"].computed
        return min(self.config.bulk_chunk, max(BULK_MIN_CHUNK, self.config.bulk_chunk * BULK_CONTEXT // max(1, context)))

    @property
    def only_transfers(self) -> bool:
        """Every running sequence waits for a worker's K/V: nothing to compute now."""
        return bool(self.running) and all(s.status is Status.REMOTE for s in self.running)

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.status is Status.DECODE]

    def _admit(self, now: float) -> None:
        warming = any(s.request.warm for s in self.running)
        if len(self.running) >= self.config.max_running or not self.waiting:
            return
        turns = by_turns(list(self.waiting), Counter(s.request.client for s in self.running))
        for seq in sorted(turns, key=lambda s: s.request.warm):  # (stable: warming after everyone's turns)
            if len(self.running) >= self.config.max_running:
                return
            if seq.request.warm and warming:
                continue  # one at a time: an admitted warm prompt reserves its blocks until it has run
            if not self.kv.admit(seq, self.running):
                if self.config.interactive_first or seq.request.warm:
                    continue  # a smaller request behind it may fit (nothing ever waits for warming)
                return
            self.waiting.remove(seq)
            seq.status = Status.PREFILL
            seq.timings.queue_ms = (now - seq.arrival) * 1000
            target = seq.kv["target"]
            seq.timings.cached_tokens = target.computed
            moved = seq.moved.length if seq.moved is not None else 0
            seq.bulk = self.is_bulk(seq.prompt_len - target.computed - moved, seq.params.priming, seq.request.warm)
            warming |= seq.request.warm
            self.running.append(seq)
            if self.connector is not None and self.connector.admit(seq, self.running):
                seq.status = Status.REMOTE
