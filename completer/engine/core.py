"""The engine loop's one iteration, single-threaded: admit, prefill a bounded
chunk, then one decode (or speculate-and-verify) step for every running sequence.
`engine.Engine` runs it on a thread and talks asyncio."""

from __future__ import annotations

import time
from collections import deque

import msgspec
import torch

from completer.engine.config import EngineConfig, SpecConfig
from completer.engine.model_runner import CachedModel
from completer.engine.sequence import SamplingParams, Sequence, Status, Timings
from completer.engine.spec_policy import SpecPolicy
from completer.engine.speculative import NgramIndex, accept_greedy, accept_sampled
from completer.engine.stopping import OutputText
from completer.healing import TokenHealer
from completer.prompt import Prompt
from completer.tokenizer import TextTokenizer


class Request(msgspec.Struct, frozen=True):
    id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    cursor_line: str = ""  # the prefix's last line (block mode's indentation)
    suffix: str = ""  # text after the cursor (trims what it already has)
    heal: bytes = b""  # token healing: bytes backed off the prompt, to be re-spelled first


SUFFIX_FOR_TRIMMING = 256  # chars after the cursor the stop logic looks at


def request_for(request_id: str, prompt: Prompt, prefix: str, suffix: str, params: SamplingParams,
                healer: TokenHealer, order: str) -> Request:
    """The engine request for a built prompt. When the prompt ends with the
    prefix (SPM, or the prefix template), token healing backs off its last
    token, to be re-spelled."""
    tokens, heal = prompt.tokens, b""
    if order != "psm":
        tokens, heal = healer.back_off(prompt.tokens, prompt.prefix_tokens)
    return Request(request_id, tokens, params, cursor_line=prefix[prefix.rfind("\n") + 1:],
                   suffix=suffix[:SUFFIX_FOR_TRIMMING], heal=heal)


class Delta(msgspec.Struct, frozen=True):
    id: str
    text: str


class Finished(msgspec.Struct, frozen=True):
    id: str
    reason: str  # stop | length | eos | cancelled | deadline
    text: str
    timings: Timings


class EngineError(Exception):
    """A request the engine refuses; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


Event = Delta | Finished


class EngineCore:
    def __init__(self, target: CachedModel, draft: CachedModel | None, tokenizer: TextTokenizer,
                 stop_ids: list[int], config: EngineConfig = EngineConfig(),
                 spec: SpecConfig = SpecConfig()):
        self.target, self.draft = target, draft
        self.tokenizer = tokenizer
        self.healer = TokenHealer(tokenizer)
        self.stop_ids = set(stop_ids)
        self.config, self.spec = config, spec
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.events: list[Event] = []
        self.policy = SpecPolicy(spec.k_init, spec.k_max, spec.adaptive)
        # CPU threads per phase (torch's setting is per calling thread; switching costs ~0.1 us).
        self.prefill_threads = config.threads or torch.get_num_threads()
        self.decode_threads = config.decode_threads or self.prefill_threads

    # -- requests -----------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.id in self.by_id:
            raise EngineError("bad_request", f"request id {request.id!r} is already in flight")
        if len(self.waiting) >= self.config.max_queue:
            raise EngineError("overloaded", f"{len(self.waiting)} requests already waiting")
        if not request.prompt:
            raise EngineError("bad_request", "empty prompt")
        worst = self._blocks_for(len(request.prompt), request.params)
        for cache in (self.target, self.draft if self.spec.draft_model else None):
            if cache is not None and worst > cache.blocks.num_blocks - 1:
                raise EngineError("too_large", f"prompt of {len(request.prompt)} tokens does not fit "
                                               f"the KV cache ({cache.blocks.num_blocks - 1} blocks)")
        output = OutputText(self.tokenizer.token_bytes, request.params.mode, request.params.stop,
                            request.cursor_line, request.suffix, request.heal)
        seq = Sequence(request.id, request.prompt, request.params, output, self.stop_ids)
        seq.spec = self.policy.new_state()
        if request.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(request.params.seed)
        self.waiting.append(seq)
        self.by_id[request.id] = seq

    def cancel(self, request_id: str) -> None:
        if (seq := self.by_id.get(request_id)) is not None:
            seq.cancelled = True

    def calibrate(self, context: int = 256, reps: int = 3, batches: tuple[int, ...] = (1, 4)) -> None:
        """Time target passes of every width (and drafter steps) at a few batch
        sizes once at start, so speculation decides from this machine's costs
        from the first request on; the policy keeps refining them as it runs."""
        previous = torch.get_num_threads()
        torch.set_num_threads(self.decode_threads)
        try:
            for batch in batches:
                self._time_passes(batch, context, reps)
        finally:
            torch.set_num_threads(previous)

    def _time_passes(self, batch: int, context: int, reps: int) -> None:
        widths = list(range(1, self.spec.k_max + 2))
        for cache in (self.target, self.draft if self.spec.draft_model else None):
            if cache is None:
                continue
            timed = cache.time_passes(batch, widths if cache is self.target else [1], context, reps)
            for width, seconds in timed.items():
                if cache is self.target:
                    self.policy.costs.observe_target(batch, width, seconds)
                else:
                    self.policy.costs.observe_draft(batch, seconds)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the iteration ------------------------------------------------------

    def step(self) -> list[Event]:
        now = time.perf_counter()
        for seq in [*self.waiting, *self.running]:
            if seq.cancelled:
                self._finish(seq, "cancelled")
            elif seq.deadline is not None and now > seq.deadline:
                self._finish(seq, "deadline")
        self._admit()
        if any(s.status is Status.PREFILL for s in self.running):
            torch.set_num_threads(self.prefill_threads)
            self._prefill()
        decoding = [s for s in self.running if s.status is Status.DECODE]
        if decoding:
            torch.set_num_threads(self.decode_threads)
            self._decode(decoding)
        events, self.events = self.events, []
        return events

    def _blocks_for(self, prompt_len: int, params: SamplingParams) -> int:
        tokens = prompt_len + params.max_tokens + self.spec.k_max + 1
        return -(-tokens // self.target.block_size)

    def _caches(self, seq: Sequence):
        yield self.target, seq.target
        if self.draft is not None and self.spec.draft_model:
            yield self.draft, seq.draft

    def _reserved(self, cache: CachedModel) -> int:
        """Blocks the running sequences may still claim in `cache` (worst case)."""
        total = 0
        for seq in self.running:
            state = seq.target if cache is self.target else seq.draft
            total += max(0, self._blocks_for(seq.prompt_len, seq.params) - len(state.table))
        return total

    def _admit(self) -> None:
        """Start waiting requests, oldest first, while their worst case fits
        beside the running ones' (so decoding never runs out of blocks)."""
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            worst = self._blocks_for(seq.prompt_len, seq.params)
            fits = True
            for cache, state in self._caches(seq):
                cache.attach(state, seq.tokens)
                fits &= worst - len(state.table) <= cache.blocks.num_free - self._reserved(cache)
            if not fits:
                for cache, state in self._caches(seq):
                    cache.release(state)
                break
            self.waiting.popleft()
            seq.status = Status.PREFILL
            seq.timings.queue_ms = (time.perf_counter() - seq.submitted) * 1000
            seq.timings.cached_tokens = seq.target.computed
            self.running.append(seq)

    def _prefill(self) -> None:
        """Up to `prefill_chunk` prompt tokens this iteration (the drafter keeps
        pace within the same budget), so one long prompt cannot stall decoding."""
        budget = self.config.prefill_chunk
        for seq in [s for s in self.running if s.status is Status.PREFILL]:
            if budget <= 0:
                break
            spent, last = 0, None
            for cache, state in self._caches(seq):
                n = min(budget, seq.prompt_len - state.computed)
                if n > 0:
                    logits = cache.forward([state], [seq.tokens[state.computed: state.computed + n]],
                                           last_only=True)
                    cache.publish(state, seq.tokens)
                    if cache is self.target:
                        spent, last = n, logits[0]
            budget -= spent
            if last is not None and seq.target.computed == seq.prompt_len:
                seq.status = Status.DECODE
                self._append(seq, [self._sample(seq, last)])

    def _healed(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """While token healing is pending, only tokens that re-spell it may follow."""
        if not seq.output.heal:
            return logits
        return self.healer.constrain(logits, self.healer.allowed(seq.output.heal, logits.shape[-1]))

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        logits = self._healed(seq, logits)
        if seq.params.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / seq.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _propose(self, seqs: list[Sequence]) -> tuple[dict[str, tuple[list[int], torch.Tensor | None]],
                                                      dict[str, str]]:
        """Each sequence's proposal for this step (n-gram lookup or drafter, of
        the length the policy picks), with its source; none above `max_batch`."""
        proposals: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        sources: dict[str, str] = {}
        if len(seqs) > self.spec.max_batch:
            return proposals, sources
        draft_ok = self.draft is not None and self.spec.draft_model
        picks = []
        for seq in seqs:
            budget = seq.params.max_tokens - seq.num_generated - 1
            if budget <= 0 or seq.output.heal:  # no drafts until healing is done
                continue
            found: list[int] = []
            if self.spec.ngram:
                if seq.ngram is None:
                    seq.ngram = NgramIndex(self.spec.ngram_min, self.spec.ngram_max)
                found = seq.ngram.propose(seq.tokens, min(self.spec.k_max, budget))
            source, k = self.policy.choose(seq.spec, len(seqs), len(found), draft_ok, budget)
            if source is not None:
                picks.append((seq, source, k, found))
        if picks and not self.policy.batch_pays([(s.spec, src, k) for s, src, k, _ in picks], len(seqs)):
            return proposals, sources
        needs_draft = []
        for seq, source, k, found in picks:
            sources[seq.id] = source
            if source == "ngram":
                proposals[seq.id] = (found[:k], None)
            else:
                needs_draft.append((seq, k))
        if needs_draft:
            proposals.update(self._draft(needs_draft))
        return proposals, sources

    def _decode(self, seqs: list[Sequence]) -> None:
        proposals, sources = self._propose(seqs)
        rows = [[s.tokens[-1]] + proposals.get(s.id, ([], None))[0] for s in seqs]
        started = time.perf_counter()
        logits = self.target.forward([s.target for s in seqs], rows)
        winners = []
        for b, seq in enumerate(seqs):
            proposal, q = proposals.get(seq.id, ([], None))
            row = logits[b] if proposal else self._healed(seq, logits[b])
            if seq.params.temperature <= 0:
                accepted = accept_greedy(proposal, row)
            else:
                accepted = accept_sampled(proposal, q, row, seq.params.temperature, seq.generator)
            winners.append(accepted)
        # Timed up to here: choosing the tokens waits for the pass to finish (on a GPU too).
        self.policy.costs.observe_target(len(seqs), max(map(len, rows)), time.perf_counter() - started)
        for seq, accepted in zip(seqs, winners):
            proposal = proposals.get(seq.id, ([], None))[0]
            if proposal:
                seq.timings.draft_proposed += len(proposal)
                seq.timings.draft_accepted += len(accepted) - 1
                seq.timings.draft_rounds += 1
                self.policy.observe(seq.spec, sources[seq.id], len(proposal), len(accepted) - 1)
            self._append(seq, accepted)

    def _draft(self, work: list[tuple[Sequence, int]]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """k tokens from the drafter for each sequence, batched, each feeding
        first whatever accepted tokens its cache has not seen."""
        rows = {s.id: s.tokens[s.draft.computed:] for s, _ in work}
        drafted: dict[str, list[int]] = {s.id: [] for s, _ in work}
        probs: dict[str, list[torch.Tensor]] = {s.id: [] for s, _ in work}
        active = list(work)
        while active:
            started = time.perf_counter()
            logits = self.draft.forward([s.draft for s, _ in active], [rows[s.id] for s, _ in active],
                                        last_only=True)
            for b, (seq, _) in enumerate(active):
                if seq.params.temperature <= 0:
                    token = int(logits[b].argmax())
                else:
                    q = torch.softmax(logits[b].float() / seq.params.temperature, dim=-1)
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[seq.id].append(q)
                drafted[seq.id].append(token)
                rows[seq.id] = [token]
            self.policy.costs.observe_draft(len(active), time.perf_counter() - started)
            active = [(s, k) for s, k in active if len(drafted[s.id]) < k]
        return {sid: (toks, torch.stack(probs[sid]) if probs[sid] else None)
                for sid, toks in drafted.items()}

    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Accepted tokens: stream them, stop as the mode says, and make the
        caches hold exactly the K/V of the accepted tokens but the last."""
        reason = None
        for token in tokens:
            if token in self.stop_ids:
                reason = "eos"
                break
            seq.tokens.append(token)
            delta, ended = seq.output.add(token)
            self._emit(seq, delta)
            if ended:
                reason = "stop"
                break
            if seq.num_generated >= seq.params.max_tokens:
                reason = "length"
                break
        if reason is not None:
            self._finish(seq, reason)
            return
        for cache, state in self._caches(seq):
            cache.rollback(state, len(seq.tokens) - 1)  # drop K/V of rejected drafts
            cache.publish(state, seq.tokens)

    def _emit(self, seq: Sequence, text: str) -> None:
        if not text:
            return
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        self.events.append(Delta(seq.id, text))

    def _finish(self, seq: Sequence, reason: str) -> None:
        if reason != "cancelled":
            self._emit(seq, seq.output.finish())
        text = seq.output.text[: seq.output.emitted]
        now = time.perf_counter()
        t = seq.timings
        t.total_ms = (now - seq.submitted) * 1000
        t.ttft_ms = ((seq.first_token_at or now) - seq.submitted) * 1000
        t.generated_tokens = seq.num_generated
        self._drop(seq)
        self.events.append(Finished(seq.id, reason, text, t))

    def _drop(self, seq: Sequence) -> None:
        for cache, state in self._caches(seq):
            cache.release(state)
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        del self.by_id[seq.id]

    def fail_running(self, message: str) -> list[tuple[str, Delta | EngineError]]:
        """After step() raised: the running requests end with an `internal`
        error and give back their blocks (K/V past `computed` is never
        published, so nothing half-written is reused); the waiting ones keep
        their place. Returns the events to deliver, the step's deltas first."""
        for seq in self.waiting:  # the one being admitted may hold blocks
            for cache, state in self._caches(seq):
                cache.release(state)
        failed = list(self.running)
        for seq in failed:
            self._drop(seq)
        events, self.events = self.events, []
        return [(e.id, e) for e in events] + [(s.id, EngineError("internal", message)) for s in failed]
