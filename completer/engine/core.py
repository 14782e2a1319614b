"""One iteration of the engine, single-threaded: plan (scheduler), run the
prefill chunks, propose drafts, run the target over every decoding sequence,
verify, post-process. `engine.Engine` runs it on a thread and talks asyncio.

The pieces, each in its own module: `scheduler` (queues, admission, prefill
budget), `kv_cache_manager` (blocks of every pool), `model_runner` (a model
and its pool), `speculator` + `proposers` (drafts), `spec_policy` (how far to
speculate), `sampler` and `rejection_sampler` (choosing tokens),
`output_processor` (text and events), `candidates` (a request's `n`).

The step contract: `scheduler.schedule()` returns the plan (expired,
prefill chunks; decoding follows from the scheduler's statuses after the
prefill), the runners' passes produce logits, and `_postprocess` turns the
accepted tokens into events; only the scheduler changes a request's status.
Over ~300 lines because the step's phases (prefill, first token, verify,
post-process) share the sequences' pass state and timings; apart, they
would hand the core to each other.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import torch

from completer.engine.attention import PassInterrupted
from completer.engine.block_manager import BlockManager
from completer.engine.candidates import Candidates
from completer.config import EngineConfig, SpecConfig
from completer.engine.fused_cpu import fused_layers_for
from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.model_runner import ModelRunner, Pass
from completer.engine.output_processor import OutputProcessor
from completer.engine.paged_kv import KV_DTYPES, KVPool, pool_blocks
from completer.engine.remote_prefill import RemotePrefillSteps
from completer.engine.proposers import DraftModelProposer, NgramProposer, Proposal
from completer.engine.rejection_sampler import accept_greedy, accept_sampled
from completer.engine.request import EngineError, Event, FinishReason, Request
from completer.engine.sampler import Sampler, token_probs
from completer.engine.scheduler import Scheduler, padded_groups
from completer.engine.sequence import Sequence, Status
from completer.engine.spec_policy import SpecPolicy
from completer.engine.speculator import Speculator
from completer.engine.stopping import OutputText
from completer.healing import TokenHealer
from completer.model import Transformer
from completer.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from completer.disagg.remote import RemotePrefill


class EngineLoop(Protocol):
    """What a step asks of the loop that runs it (`engine.Engine`)."""

    def between_passes(self, events: list[Event]) -> list[str]:
        """Deliver the events so far; the ids whose cancel came meanwhile."""

    def cancel_waiting(self, request_ids: list[str]) -> bool:
        """Whether a cancel waits for every one of these requests."""

    def arrivals(self) -> list[Request]:
        """The requests waiting to come in (a bulk pass stops for those that go first)."""


class BulkPaused(Exception):
    """A bulk pass stopped between layers for interactive work (the core keeps it)."""


class EngineCore:
    def __init__(self, runners: dict[str, ModelRunner], kv: KVCacheManager, tokenizer: TextTokenizer,
                 stop_ids: list[int], config: EngineConfig = EngineConfig(), spec: SpecConfig = SpecConfig(),
                 remote: RemotePrefill | None = None):
        """runners: "target", and "draft" when the drafter is in use (the one place that says so).
        remote: prefill workers (disaggregation), if any."""
        self.runners = runners
        self.target, self.draft = runners["target"], runners.get("draft")
        self.kv = kv
        self.tokenizer = tokenizer
        self.config, self.spec = config, spec
        self.disagg: RemotePrefillSteps | None = None  # the scheduler's connector to prefill workers
        if remote is not None:
            remote.register(self.target.pool)
            self.disagg = RemotePrefillSteps(remote, kv, config.prefill_chunk)
        self.scheduler = Scheduler(config, kv, self.disagg)
        self.by_id: dict[str, Sequence] = {}  # requests and their candidates
        stop = set(stop_ids)
        self.candidates = Candidates(kv, self.scheduler, stop, config.candidates_max_batch, self.by_id,
                                     self._sequence)
        self.output = OutputProcessor(stop, self.candidates)
        self.loop: EngineLoop | None = None  # the loop running the current step, if any
        self.sampler = Sampler(TokenHealer(tokenizer))
        self.policy = SpecPolicy(spec.k_init, spec.k_max, spec.adaptive)
        proposers = []
        if spec.ngram:
            proposers.append(NgramProposer(spec.ngram_min, spec.ngram_max))
        if self.draft is not None:
            drafter = DraftModelProposer(self.draft, kv, self.sampler, self.policy.costs)
            if config.interrupt_superseded:
                drafter.interrupted = self._interrupted
            proposers.append(drafter)
        self.speculator = Speculator(proposers, self.policy, spec.max_batch)
        self.passes_interrupted = 0
        # Bulk passes stopped between layers, by (pool, sequence): (first position, tokens) and the pass.
        self.paused: dict[tuple[str, str], tuple[tuple[int, int], Pass]] = {}
        self.bulk_slice_until: float | None = None  # the running bulk pass's end, when it runs a starved slice
        self.bulk_running: tuple[Sequence, int] | None = None  # whose bulk pass runs now, up to where
        self.uncached: dict[str, int] = {}  # arrivals' prompt tokens not in the prefix cache, estimated once
        # CPU threads per phase (torch's setting is per calling thread; switching costs ~0.1 us).
        self.prefill_threads = config.threads or torch.get_num_threads()
        self.decode_threads = config.decode_threads or self.prefill_threads
        # With the fused CPU layer, torch's own ops between passes (logits, sampling,
        # healing's mask) run on one thread: an OpenMP team of two beside the layer's
        # spinning workers waited up to ~15 ms for a core; its passes through torch's
        # ops take `prefill_threads` from the runner.
        self.fused = any(runner.fused is not None for runner in runners.values())
        if self.fused:
            for runner in runners.values():
                runner.torch_threads = self.prefill_threads

    @classmethod
    def build(cls, target: Transformer, draft: Transformer | None, tokenizer: TextTokenizer,
              stop_ids: list[int], config: EngineConfig = EngineConfig(), spec: SpecConfig = SpecConfig(),
              num_blocks: dict[str, int] | None = None, remote: RemotePrefill | None = None) -> "EngineCore":
        """Pools, runners and block managers for the models. num_blocks: per
        role (default: `kv_cache_mb` split by `spec.draft_share`)."""
        models = {"target": target}
        if draft is not None and spec.draft_model:
            models["draft"] = draft
        share = {"target": 1 - spec.draft_share, "draft": spec.draft_share} if len(models) == 2 else {"target": 1}
        runners, pools = {}, {}
        dtype = KV_DTYPES[config.kv_dtype]
        for role, model in models.items():
            n = (num_blocks or {}).get(role) or pool_blocks(model.config, config.kv_cache_mb * share[role],
                                                            config.block_size, dtype)
            pool = KVPool(model.config, n, config.block_size, next(model.parameters()).device, dtype)
            attention = config.paged_attention
            if attention == "auto":
                attention = "triton" if pool.device.type == "cuda" else "torch"
            fused = None
            if config.fused_cpu and pool.device.type == "cpu":
                fused = fused_layers_for(model, config.fused_cpu_q8, config.decode_threads or config.threads)
            runners[role] = ModelRunner(model, pool, attention, config.cuda_graphs, fused)
            pools[role] = BlockManager(n, config.block_size, config.prefix_cache)
        kv = KVCacheManager(pools, spec.k_max + 1, moved_kv=config.reuse_moved_kv and remote is None)
        return cls(runners, kv, tokenizer, stop_ids, config, spec, remote)

    # -- requests -----------------------------------------------------------

    def add(self, request: Request, submitted: float | None = None) -> None:
        """submitted: time.perf_counter() when the engine was handed the request
        (the timeline's end of `prepare_ms`, start of `wait_ms`)."""
        self.uncached.pop(request.id, None)  # (estimated while it waited in the inbox)
        if request.id in self.by_id:
            raise EngineError("bad_request", f"request id {request.id!r} is already in flight")
        if not request.prompt:
            raise EngineError("bad_request", "empty prompt")
        if (problem := self.kv.too_large(len(request.prompt), request.params.max_tokens)) is not None:
            raise EngineError("too_large", problem)
        if request.warm and (cached := self.kv.pools["target"].cached_tokens(request.prompt, request.cache_salt)) \
                >= (len(request.prompt) - 1) // self.kv.block_size * self.kv.block_size:
            seq = self._sequence(request)  # warm already: nothing to compute (not even its last token)
            seq.timings.cached_tokens = cached
            self.output.finish(seq, "length")
            return
        if self.scheduler.queue_full:
            self._make_room(request)
        seq = self._sequence(request)
        if submitted is not None:
            seq.timings.prepare_ms = (submitted - request.arrival) * 1000
            seq.timings.wait_ms = (time.perf_counter() - submitted) * 1000
        self.scheduler.add(seq)
        self.by_id[request.id] = seq

    def _make_room(self, request: Request) -> None:
        """A full queue: warming gives way first (and is refused itself); then
        one client's flood does not keep another out: the newest waiting
        request of the client holding most of the queue makes room. Else the
        request is refused (`overloaded`)."""
        waiting = self.scheduler.waiting
        full = f"{len(waiting)} requests already waiting"
        if request.warm:
            raise EngineError("overloaded", full)
        if (room := next((s for s in reversed(waiting) if s.request.warm), None)) is None:
            if (room := self.scheduler.crowding(request.client)) is None:
                raise EngineError("overloaded", full)
            self.output.fail(room, "overloaded", f"{full} (most of them this client's; another client's took "
                             "this one's place)")
        else:
            self.output.finish(room, "cancelled")  # (optional work: a keystroke came)
        self._drop(room)

    def _sequence(self, request: Request) -> Sequence:
        p = request.params
        output = OutputText(self.tokenizer.token_bytes, p.mode, p.stop, request.cursor_line, request.suffix,
                            request.heal, request.next_line, p.confidence, p.report_probs)
        return Sequence(request, output, self.kv.roles, self.policy.new_state())

    def abort(self, request_id: str) -> None:
        """End a request now (`cancelled`), wherever it is, and its candidates;
        their blocks return at once."""
        if (seq := self.by_id.get(request_id)) is not None:
            self._finish(seq, "cancelled")
        for candidate in self.candidates.of_ended(request_id):  # it ended, they ran on
            self._finish(candidate, "cancelled")

    @property
    def releasing(self) -> bool:
        """Blocks of ended requests still held by their aborted jobs: a step must
        take in the jobs' close to free them, even with nothing else to do
        (else the last cancel mid-transfer held its blocks until the next
        request came: found by test_disagg at 100 requests, issue #32)."""
        return self.disagg is not None and bool(self.disagg.held_by_jobs)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.releasing

    @property
    def only_transfers(self) -> bool:
        """Nothing to compute until a worker's K/V arrives or a job closes (or a deadline passes)."""
        return self.scheduler.only_transfers or (not self.scheduler.has_work and self.releasing)

    # -- the iteration ------------------------------------------------------

    def step(self, loop: EngineLoop | None = None) -> list[Event]:
        """loop: the engine loop running it (first tokens go out between passes,
        superseded passes are given up); None runs the step alone (tests)."""
        self.loop = loop
        try:
            return self._step()
        except PassInterrupted:  # every running request was cancelled mid-pass: they end now
            self.passes_interrupted += 1
            for request_id in loop.between_passes(self.output.drain()):
                self.abort(request_id)
            return self.output.drain()
        finally:
            self.loop = None

    def _interrupted(self) -> bool:
        """Before each layer of a pass: whether every running request has a
        cancel waiting (a newer keystroke superseded them), so the pass is
        work nobody will see. Only all of them: a pass is never half-given-up.
        (Warming is never in such a pass, and nobody cancels it: not counted.)"""
        return self.loop is not None and self.loop.cancel_waiting(
            [s.id for s in self.scheduler.running if not s.request.warm])

    def take_closed_jobs(self) -> None:
        """The prefill jobs that closed: their sequences decode, prefill here or
        end with reason `deadline` (their worker lost, too little time left to
        prefill here: an outcome the deadline allows, not a server fault), and
        the blocks of those whose requests ended first return."""
        if self.disagg is None:
            return
        ready, here, late = self.disagg.poll()
        for seq in ready + here:
            self.scheduler.prefill_here(seq)
        for seq in ready:
            self._start_decoding(seq)
        for seq in late:
            self._finish(seq, "deadline")

    def goes_first(self, request: Request, bulk: Sequence, end: int) -> bool:
        """Whether a request coming in goes before a running bulk pass (which
        computes `bulk`'s prompt up to `end`): it is interactive work, or bulk
        work with less left (its uncached prompt estimated from the target's
        prefix cache, no reference taken), or anything but warming before a
        warming pass; unless its prompt starts with what
        the pass computes (a keystroke after the prime of its position), since
        then the pass is its own prefill."""
        if request.warm:
            return False
        if (uncached := self.uncached.get(request.id)) is None:
            cached = self.kv.pools["target"].cached_tokens(request.prompt, request.cache_salt)
            uncached = self.uncached[request.id] = len(request.prompt) - cached
        first = bulk.request.warm or not self.scheduler.is_bulk(uncached, request.params.priming) \
            or uncached < bulk.prefill_left
        return first and not (request.cache_salt == bulk.cache_salt and len(request.prompt) > end
                              and request.prompt[:end] == bulk.tokens[:end])

    def _step(self) -> list[Event]:
        self.take_closed_jobs()
        plan = self.scheduler.schedule(time.perf_counter())
        for seq in plan.expired:
            self._finish(seq, "deadline")
        if plan.expired:  # their answers go out now, not after this step's (maybe long) passes
            return self.output.drain()
        if plan.prefill:
            torch.set_num_threads(1 if self.fused else self.prefill_threads)
            self.bulk_slice_until = plan.slice_until
            try:
                self._prefill(plan.prefill)
            except BulkPaused:  # work that goes first came: it runs next step, this pass goes on after it
                return self.output.drain()
            self._expire()  # a long prefill must not carry others past their deadline into a pass
            if self.loop is not None and self.config.between_passes:
                # A keystroke's first token is out a decode pass sooner; one superseded meanwhile
                # does not take a place in that pass.
                for request_id in self.loop.between_passes(self.output.drain()):
                    self.abort(request_id)
        decoding = self.scheduler.decoding()
        if decoding:
            torch.set_num_threads(1 if self.fused else self.decode_threads)
            proposals = self.speculator.propose(decoding)
            accepted = self._verify(decoding, proposals)
            for seq, (tokens, probs) in zip(decoding, accepted):
                self._postprocess(seq, tokens, probs)
            self._expire()  # nor wait for the next step to end
        return self.output.drain()

    def _expire(self) -> None:
        for seq in self.scheduler.expire(time.perf_counter()):
            self._finish(seq, "deadline")

    def _run(self, role: str, seqs: list[Sequence], rows: list[list[int]], last_only: bool = False, last: int = 0,
             prefill: bool = False):
        """One pass. A decode or verify pass may be given up when everyone in it
        was superseded; a prefill pass never is: the next keystroke's prompt
        mostly starts with the same text, and finds the K/V in the cache. A
        bulk sequence's pass may stop between layers (BulkPaused) and goes on
        when the same chunk is planned again."""
        if prefill and len(seqs) == 1 and seqs[0].bulk:
            return self._run_bulk(role, seqs[0], rows[0], last)
        self.kv.allocate(role, seqs, rows)
        interrupted = None
        if self.loop is not None and self.config.interrupt_superseded and not prefill:
            interrupted = self._interrupted
        return self.runners[role].execute([s.kv[role] for s in seqs], rows, last_only, last=last,
                                          interrupted=interrupted)

    def _run_bulk(self, role: str, seq: Sequence, row: list[int], last: int):
        key = (seq.kv[role].computed, len(row))
        paused = self.paused.pop((role, seq.id), None)
        if paused is not None and paused[0] == key:
            run = paused[1]
        else:  # (a stale one belonged to a chunk planned otherwise: its blocks are the sequence's)
            self.kv.allocate(role, [seq], [row])
            run = self.runners[role].start([seq.kv[role]], [row], last=last)
        self.bulk_running = seq, seq.kv[role].computed + len(row)
        try:
            logits = run.run(self._bulk_pause)
        finally:
            self.bulk_running = None
        if run.layers_run:
            self.scheduler.bulk_progressed()
        if logits is None:
            self.paused[role, seq.id] = (key, run)
            raise BulkPaused
        return logits

    def _bulk_pause(self) -> bool:
        """Before each layer of a bulk pass: stop it for a request that goes
        first, or at its starved slice's end. (Not for a cancel: a bulk pass
        whose request was superseded runs to its end, as a prefill pass does,
        since the next keystroke's prompt reuses its K/V.)"""
        if self.bulk_slice_until is not None:
            return time.perf_counter() > self.bulk_slice_until
        return self.loop is not None and any(self.goes_first(r, *self.bulk_running) for r in self.loop.arrivals())

    def _heals_in_prefill(self, seq: Sequence, role: str, n: int) -> bool:
        """Whether this chunk ends the prompt and the backed-off token rides
        along as a draft (the first token is then verified in the same pass)."""
        return (role == "target" and self.config.heal_in_prefill and seq.request.heal_token >= 0
                and bool(seq.output.heal) and seq.first_token is None and seq.params.max_tokens >= 2
                and seq.kv[role].computed + n == seq.prompt_len)

    def _prefills(self, seq: Sequence, role: str) -> bool:
        """Whether this step prefills the sequence's prompt in this pool: the
        drafter takes it in when it first drafts, unless priming (which
        fills every pool) or told otherwise (`spec.defer_draft_prefill`)."""
        return role in seq.local_roles() and (  # (a worker may prefill the target's)
            role == "target" or not self.spec.defer_draft_prefill or seq.params.priming)

    def _prefill(self, plan: list[tuple[Sequence, int]]) -> None:
        """Up to each sequence's budget more prompt tokens in every pool
        (chunks of similar length in one pass); a sequence's first token once
        the target has its whole prompt (kept as soon as it has it: a bulk
        drafter pass that stops after it must not lose them)."""
        for seq, _ in plan:
            if seq.moved is not None and seq.kv["target"].computed == seq.moved.at:
                self._copy_moved(seq)
        for role in self.kv.roles:
            chunks = [(seq, n) for seq, budget in plan if self._prefills(seq, role)
                      and (n := min(budget, self._prefill_end(seq, role) - seq.kv[role].computed)) > 0]
            groups = padded_groups(chunks) if self.config.batch_prefill else [[c] for c in chunks]
            for group in groups:
                seqs = [seq for seq, _ in group]
                heals = [self._heals_in_prefill(seq, role, n) for seq, n in group]
                rows = [seq.tokens[seq.kv[role].computed: seq.kv[role].computed + n]
                        + ([seq.request.heal_token] if heal else []) for (seq, n), heal in zip(group, heals)]
                started = time.perf_counter()
                logits = self._run(role, seqs, rows, last=2 if any(heals) else 1, prefill=True)
                took_ms = (time.perf_counter() - started) * 1000
                for b, seq in enumerate(seqs):
                    self.kv.publish(seq, role)  # (not the heal token: it is not in seq.tokens yet)
                    if role == "target":
                        seq.timings.prefill_ms += took_ms
                        seq.target_passes += 1
                        if seq.kv["target"].computed >= seq.prompt_len:
                            seq.first_logits = logits[b, 0] if heals[b] else logits[b, -1]
                        seq.after_heal_logits = logits[b, 1] if heals[b] else None
                    else:
                        seq.timings.draft_ms += took_ms
                if role == "target" and self.disagg is not None:
                    self.disagg.remote.observe_local(sum(map(len, rows)), took_ms / 1000)
        for seq, _ in plan:
            self._start_decoding(seq)

    @staticmethod
    def _prefill_end(seq: Sequence, role: str) -> int:
        """Prefill runs up to a moved run's start (copied in next), else the prompt's end."""
        if role == "target" and seq.moved is not None:
            return seq.moved.at
        return seq.prompt_len

    def _copy_moved(self, seq: Sequence) -> None:
        run, slots = self.kv.moved_slots(seq)
        self.target.copy_moved(run.src_slots, slots, run.shift)
        self.kv.moved_done(seq)
        seq.timings.moved_tokens += run.length

    def _start_decoding(self, seq: Sequence) -> None:
        """The first token, once the target holds the whole prompt (a lagging
        drafter catches up when it next proposes). A priming request
        (max_tokens 0) ends instead, once every pool holds the prompt: its
        blocks were published as they were computed, so they stay cached."""
        if seq.first_logits is None or seq.kv["target"].computed < seq.prompt_len:
            return
        if seq.params.priming:
            if seq.prefill_left == 0:
                seq.first_logits = None
                self._finish(seq, "length")
            return
        logits, seq.first_logits = seq.first_logits, None
        self.scheduler.start_decoding(seq)
        after_heal, seq.after_heal_logits = seq.after_heal_logits, None
        sure = seq.params.wants_probs
        if seq.first_token is not None:  # a candidate: its first token was chosen when it was forked
            tokens, probs = [seq.first_token], [1.0]  # (an alternative by choice: no confidence rule for it)
        else:
            logits = self.sampler.constrain(seq, logits)
            tokens = [self.sampler.sample(seq, logits, heal=False)[0]]
            probs = token_probs(logits, tokens) if sure else None
            self.candidates.fork(seq, logits, tokens[0])
        if after_heal is not None and tokens[0] == seq.request.heal_token:
            # The draft held: that token spells all the backed-off bytes, so the next is unconstrained.
            tokens.append(self.sampler.sample(seq, after_heal, heal=False)[0])
            if sure:
                probs = probs + token_probs(after_heal, tokens[1:])
        self._postprocess(seq, tokens, probs if sure else None)  # (a rejected heal token's K/V is rolled back there)

    def _verify(self, seqs: list[Sequence], proposals: dict[str, Proposal]) -> list[tuple[list[int], list[float] | None]]:
        """One target pass over `[last token] + proposal` per sequence; the
        tokens each keeps (the accepted drafts and the target's own next one),
        with their probabilities where the request wants them (confidence rules, reported)."""
        rows = [[s.tokens[-1]] + (proposals[s.id].tokens if s.id in proposals else []) for s in seqs]
        started = time.perf_counter()
        logits = self._run("target", seqs, rows)
        took_ms = (time.perf_counter() - started) * 1000
        for seq in seqs:
            seq.timings.decode_ms += took_ms
            seq.timings.decode_passes += 1
            seq.target_passes += 1
        out = []
        for b, seq in enumerate(seqs):
            proposal = proposals.get(seq.id)
            drafts = proposal.tokens if proposal else []
            row = logits[b] if drafts else self.sampler.constrain(seq, logits[b])  # no drafts while healing
            if seq.params.greedy:
                tokens = accept_greedy(drafts, row)
            else:
                probs = proposal.probs if proposal else None
                tokens = accept_sampled(drafts, probs, row, seq.params.temperature, seq.generator)
            out.append((tokens, token_probs(row, tokens) if seq.params.wants_probs else None))
        # Timed up to here: choosing the tokens waits for the pass to finish (on a GPU too).
        self.policy.costs.observe_target(len(seqs), max(map(len, rows)), time.perf_counter() - started)
        if self.disagg is not None:
            self.disagg.decode_pass_s = time.perf_counter() - started
        for seq, (tokens, _) in zip(seqs, out):
            if seq.id in proposals:
                self.speculator.observe(seq, proposals[seq.id], len(tokens) - 1)
        return out

    def _postprocess(self, seq: Sequence, tokens: list[int], probs: list[float] | None = None) -> None:
        """Stream accepted tokens and stop as the mode (and the confidence rules,
        given `probs`) says; else make every pool hold exactly the K/V of the
        accepted tokens but the last."""
        reason = self.output.append(seq, tokens, probs)
        if reason is not None:
            self._finish(seq, reason)
            return
        for role in self.kv.roles:
            self.kv.rollback(seq, role, len(seq.tokens) - 1)  # drop K/V of rejected drafts
            self.kv.publish(seq, role)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._drop(seq)
        self.output.finish(seq, reason)
        if (reason == "cancelled" or seq.output.cut == "first") and seq.candidates is not None:
            for candidate in list(seq.candidates.running):
                self._finish(candidate, "cancelled")

    def _drop(self, seq: Sequence) -> None:
        for role in self.kv.roles:  # its stopped pass would write blocks it gave back
            self.paused.pop((role, seq.id), None)
        if seq.remote_job is not None:  # a worker may still write its blocks: its job keeps them
            self.disagg.hand_over(seq)
        self.kv.free(seq)
        if seq.status is not Status.FINISHED:
            self.scheduler.remove(seq)
        del self.by_id[seq.id]

    def fail_running(self, message: str) -> list[tuple[str, object]]:
        """After step() raised: the running requests end with an `internal`
        error and give back their blocks (K/V past `computed` is never
        published, so nothing half-written is reused); the waiting ones keep
        their place. Returns the events to deliver, the step's deltas first."""
        for seq in self.scheduler.waiting:  # the one being admitted may hold blocks
            self.kv.free(seq)
        failed = [s for s in self.scheduler.running if s.candidate_of is None]
        for seq in failed:
            self._drop(seq)
        for candidate in list(self.scheduler.running):  # a request that ended before them then has its answer
            self._finish(candidate, "cancelled")
        return [(e.id, e) for e in self.output.drain()] + \
            [(s.id, EngineError("internal", message)) for s in failed]
