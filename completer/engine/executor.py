"""The run half of a step: the passes a `SchedulerOutput` asks for, and the
tokens they choose. It returns what it computed (`PrefillOutput`,
`DecodeOutput`) and changes no request's K/V progress, text or status: the
core's `update` applies the outputs (vLLM v1's runner output and
`update_from_output`).

A decode or verify pass may be given up when everyone in it was superseded; a
prefill pass never is (the next keystroke's prompt mostly starts with the same
text and finds the K/V in the cache). A bulk sequence's pass may stop between
layers (`BulkPaused`) and goes on when the same chunk is planned again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import torch

from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.model_runner import ModelRunner, Pass
from completer.engine.proposers import Proposal
from completer.engine.rejection_sampler import accept_greedy, accept_sampled
from completer.engine.sampler import Sampler, token_probs
from completer.engine.scheduler import PrefillChunk, SchedulerOutput
from completer.engine.sequence import Sequence
from completer.engine.speculator import Speculator


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


class BulkPaused(Exception):
    """A bulk pass stopped between layers for interactive work (the executor keeps it)."""


class FirstToken(msgspec.Struct):
    """A sequence's first token(s), chosen once the target holds its whole prompt."""
    seq: Sequence
    tokens: list[int]  # two when the heal token verified in the prefill pass held
    probs: list[float] | None  # where the request wants them (confidence rules, reported)
    alternatives: list[int] = []  # its candidates' first tokens, most likely first (`n`)


class PrefillOutput(msgspec.Struct):
    chunks: list[tuple[PrefillChunk, float]]  # each chunk run, with its pass's milliseconds
    first: list[FirstToken]
    paused: bool = False  # a bulk pass stopped for work that goes first: the step ends
    bulk_progressed: bool = False  # a bulk pass ran at least one layer (the starvation clock restarts)


class Verified(msgspec.Struct):
    """One sequence's row of a verify pass."""
    seq: Sequence
    width: int  # tokens the pass wrote (its last token and the drafts)
    tokens: list[int]  # accepted drafts and the target's own next token
    probs: list[float] | None
    proposal: Proposal | None


class DecodeOutput(msgspec.Struct):
    rows: list[Verified]
    took_ms: float


class Executor:
    def __init__(self, runners: dict[str, ModelRunner], kv: KVCacheManager, sampler: Sampler,
                 speculator: Speculator, stop_ids: set[int], interrupt_superseded: bool, batch_prefill: bool):
        self.runners, self.kv, self.sampler, self.speculator = runners, kv, sampler, speculator
        self.stop_ids = stop_ids
        self.interrupt_superseded = interrupt_superseded
        self.batch_prefill = batch_prefill
        # Asked before each layer of a decode pass: everyone in it superseded (set by the core while a loop runs).
        self.interrupted: Callable[[], bool] | None = None
        self.goes_first: Callable[[], bool] = lambda: False  # before each layer of a bulk pass
        # Bulk passes stopped between layers, by (pool, sequence): (first position, tokens) and the pass.
        self.paused: dict[tuple[str, str], tuple[tuple[int, int], Pass]] = {}
        self.slice_until: float | None = None  # the running bulk pass's end, when it runs a starved slice
        self.bulk_running: tuple[Sequence, int] | None = None  # whose bulk pass runs now, up to where
        self.observe_prefill: Callable[[int, float], None] | None = None  # (tokens, seconds) of a target pass
        self.progressed = False  # this step's bulk pass ran a layer

    # -- prefill ------------------------------------------------------------

    def prefill(self, plan: SchedulerOutput) -> PrefillOutput:
        """The moved K/V copied in, then each pool's chunks (of similar length
        in one pass), then the first token of each sequence whose prompt the
        target now holds whole (priming requests choose none)."""
        for seq, run, slots in plan.copies:
            self.runners["target"].copy_moved(run.src_slots, slots, run.shift)
        done: list[tuple[PrefillChunk, float]] = []
        self.progressed = False
        last_logits: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for role in self.kv.roles:
            chunks = [c for c in plan.prefill if c.role == role]
            groups = padded_groups([(c, c.n) for c in chunks]) if self.batch_prefill else [[(c, c.n)] for c in chunks]
            for group in groups:
                group = [c for c, _ in group]
                rows = [c.seq.tokens[c.start: c.start + c.n] + ([c.seq.request.heal_token] if c.heal else [])
                        for c in group]
                started = time.perf_counter()
                try:
                    logits = self._run(group, rows, last=2 if any(c.heal for c in group) else 1)
                except BulkPaused:
                    return PrefillOutput(done, [], paused=True, bulk_progressed=self.progressed)
                took_ms = (time.perf_counter() - started) * 1000
                done += [(c, took_ms) for c in group]
                for b, c in enumerate(group):
                    if role == "target" and c.start + c.n >= c.seq.prompt_len:
                        last_logits[c.seq.id] = (logits[b, 0], logits[b, 1]) if c.heal else (logits[b, -1], None)
                if role == "target" and self.observe_prefill is not None:
                    self.observe_prefill(sum(map(len, rows)), took_ms / 1000)
        first = [self.first_token(c.seq, *last_logits[c.seq.id]) for c in plan.prefill  # (in the plan's order)
                 if c.role == "target" and c.seq.id in last_logits and not c.seq.params.priming]
        return PrefillOutput(done, first, bulk_progressed=self.progressed)

    def first_token(self, seq: Sequence, logits: torch.Tensor, after_heal: torch.Tensor | None = None) -> FirstToken:
        """The first token from the logits after the prompt; with the heal token
        verified in the same pass and chosen, the one after it too."""
        sure = seq.params.wants_probs
        if seq.first_token is not None:  # a candidate: its first token was chosen when it was forked
            return FirstToken(seq, [seq.first_token], [1.0] if sure else None)  # (no confidence rule for it)
        logits = self.sampler.constrain(seq, logits)
        tokens = [self.sampler.sample(seq, logits, heal=False)[0]]
        probs = token_probs(logits, tokens) if sure else None
        alternatives = self._alternatives(logits, tokens[0], seq.params.n - 1) if seq.params.n > 1 else []
        if after_heal is not None and tokens[0] == seq.request.heal_token:
            # The draft held: that token spells all the backed-off bytes, so the next is unconstrained.
            tokens.append(self.sampler.sample(seq, after_heal, heal=False)[0])
            if sure:
                probs = probs + token_probs(after_heal, tokens[1:])
        return FirstToken(seq, tokens, probs, alternatives)

    def _alternatives(self, logits: torch.Tensor, chosen: int, count: int) -> list[int]:
        """The `count` most likely first tokens after `chosen`'s: allowed (healing) and not an end of text."""
        stop = self.stop_ids
        ranked = torch.topk(logits.float(), min(logits.shape[-1], count + 1 + len(stop)))
        tokens = [int(t) for v, t in zip(ranked.values.tolist(), ranked.indices.tolist())
                  if v != float("-inf") and t != chosen and t not in stop]
        return tokens[:count]

    def _run(self, chunks: list[PrefillChunk], rows: list[list[int]], last: int) -> torch.Tensor:
        role = chunks[0].role
        if len(chunks) == 1 and chunks[0].seq.bulk:
            return self._run_bulk(chunks[0], rows[0], last)
        return self.runners[role].execute([c.seq.kv[role] for c in chunks], rows, last=last,
                                          starts=[c.start for c in chunks])

    def _run_bulk(self, chunk: PrefillChunk, row: list[int], last: int) -> torch.Tensor:
        seq, role = chunk.seq, chunk.role
        key = (chunk.start, len(row))
        paused = self.paused.pop((role, seq.id), None)
        if paused is not None and paused[0] == key:
            run = paused[1]
        else:  # (a stale one belonged to a chunk planned otherwise: its blocks are the sequence's)
            run = self.runners[role].start([seq.kv[role]], [row], last=last, starts=[chunk.start])
        self.bulk_running = seq, chunk.start + len(row)
        try:
            logits = run.run(self._bulk_pause)
        finally:
            self.bulk_running = None
        self.progressed |= run.layers_run > 0
        if logits is None:
            self.paused[role, seq.id] = (key, run)
            raise BulkPaused
        return logits

    def _bulk_pause(self) -> bool:
        """Before each layer of a bulk pass: stop it for a request that goes
        first, or at its starved slice's end. (Not for a cancel: a bulk pass
        whose request was superseded runs to its end, as a prefill pass does,
        since the next keystroke's prompt reuses its K/V.)"""
        if self.slice_until is not None:
            return time.perf_counter() > self.slice_until
        return self.goes_first()

    def forget(self, seq: Sequence) -> None:
        """A sequence ended: its stopped passes would write blocks it gave back."""
        for role in self.kv.roles:
            self.paused.pop((role, seq.id), None)

    # -- decode -------------------------------------------------------------

    def decode(self, seqs: list[Sequence]) -> DecodeOutput:
        """Drafts proposed, then one target pass over `[last token] + drafts` per
        sequence; the tokens each keeps (the accepted drafts and the target's
        own next one)."""
        proposals = self.speculator.propose(seqs)
        rows = [[s.tokens[-1]] + (proposals[s.id].tokens if s.id in proposals else []) for s in seqs]
        started = time.perf_counter()
        self.kv.check_room("target", seqs, rows)  # (planned: `grow_ahead`)
        logits = self.runners["target"].execute([s.kv["target"] for s in seqs], rows,
                                                interrupted=self.interrupted if self.interrupt_superseded else None)
        out = []
        for b, (seq, row) in enumerate(zip(seqs, rows)):
            proposal = proposals.get(seq.id)
            drafts = proposal.tokens if proposal else []
            scores = logits[b] if drafts else self.sampler.constrain(seq, logits[b])  # no drafts while healing
            if seq.params.greedy:
                tokens = accept_greedy(drafts, scores)
            else:
                tokens = accept_sampled(drafts, proposal.probs if proposal else None, scores,
                                        seq.params.temperature, seq.generator)
            out.append(Verified(seq, len(row), tokens, token_probs(scores, tokens) if seq.params.wants_probs
                                else None, proposal))
        # Timed up to here: choosing the tokens waits for the pass to finish (on a GPU too).
        took = time.perf_counter() - started
        self.speculator.policy.costs.observe_target(len(seqs), max(map(len, rows)), took)
        return DecodeOutput(out, took * 1000)
