"""One iteration of the engine, single-threaded, as vLLM v1 and nano-vllm
read: the scheduler plans the step (`schedule() -> SchedulerOutput`), the
executor runs its passes and returns their outputs, `update(plan, outputs)`
applies them and returns the events. `engine.Engine` runs it on a thread and
talks asyncio.

The pieces, each in its own module: `scheduler` (queues, the registry of live
requests, admission, the plan), `executor` (passes, drafts, chosen tokens),
`update` (K/V progress, text, statuses), `kv_cache_manager` (blocks of every
pool), `model_runner` (a model and its pool), `speculator` + `proposers`
(drafts), `spec_policy` (how far to speculate), `output_processor` (text and
events), `candidates` (a request's `n`), `kv_connector` (K/V computed
elsewhere). A step has at most two passes of its own, prefill then verify;
between them the first tokens go out and cancels come in.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from completer.engine.attention import PassInterrupted
from completer.engine.block_manager import BlockManager
from completer.engine.candidates import Candidates
from completer.config import EngineConfig, SpecConfig
from completer.engine.executor import Executor
from completer.engine.fused_cpu import fused_layers_for
from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.kv_connector import KVConnector
from completer.engine.model_runner import ModelRunner
from completer.engine.output_processor import OutputProcessor
from completer.engine.paged_kv import KV_DTYPES, KVPool, pool_blocks
from completer.engine.proposers import DraftModelProposer, NgramProposer
from completer.engine.request import EngineError, Event, Request
from completer.engine.sampler import Sampler
from completer.engine.scheduler import Scheduler
from completer.engine.sequence import Sequence, Status
from completer.engine.spec_policy import SpecPolicy
from completer.engine.speculator import Speculator
from completer.engine.stopping import OutputText
from completer.engine.update import Updater
from completer.healing import TokenHealer
from completer.model import Transformer
from completer.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


class EngineLoop(Protocol):
    """What a step asks of the loop that runs it (`engine.Engine`)."""

    def between_passes(self, events: list[Event]) -> list[str]:
        """Deliver the events so far; the ids whose cancel came meanwhile."""

    def cancel_waiting(self, request_ids: list[str]) -> bool:
        """Whether a cancel waits for every one of these requests."""

    def arrivals(self) -> list[Request]:
        """The requests waiting to come in (a bulk pass stops for those that go first)."""


class EngineCore:
    def __init__(self, runners: dict[str, ModelRunner], kv: KVCacheManager, tokenizer: TextTokenizer,
                 stop_ids: list[int], config: EngineConfig = EngineConfig(), spec: SpecConfig = SpecConfig(),
                 connector: KVConnector | None = None):
        """runners: "target", and "draft" when the drafter is in use (the one place that says so).
        connector: where K/V may be computed elsewhere (prefill workers), if anywhere."""
        self.runners = runners
        self.target, self.draft = runners["target"], runners.get("draft")
        self.kv = kv
        self.tokenizer = tokenizer
        self.config, self.spec = config, spec
        self.connector = connector
        if connector is not None:
            connector.bind(kv, self.target.pool, config.prefill_chunk)
        self.scheduler = Scheduler(config, kv, connector, spec.defer_draft_prefill)
        stop = set(stop_ids)
        self.candidates = Candidates(self.scheduler, self._sequence)
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
        self.executor = Executor(runners, kv, self.sampler, self.speculator, stop, config.interrupt_superseded,
                                 config.batch_prefill)
        self.executor.goes_first = self._bulk_goes_first
        if connector is not None:
            self.executor.observe_prefill = connector.observe_prefill
        self.updater = Updater(kv, self.scheduler, self.output, self.candidates, self.speculator, self.executor,
                               connector)
        self.update = self.updater.update
        self.passes_interrupted = 0
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
              num_blocks: dict[str, int] | None = None, connector: KVConnector | None = None) -> "EngineCore":
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
        kv = KVCacheManager(pools, spec.k_max + 1, moved_kv=config.reuse_moved_kv and connector is None)
        return cls(runners, kv, tokenizer, stop_ids, config, spec, connector)

    # -- requests -----------------------------------------------------------

    def add(self, request: Request, submitted: float | None = None) -> None:
        """submitted: time.perf_counter() when the engine was handed the request
        (the timeline's end of `prepare_ms`, start of `wait_ms`)."""
        self.uncached.pop(request.id, None)  # (estimated while it waited in the inbox)
        if request.id in self.scheduler.requests:
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
        self.updater.drop(room)

    def _sequence(self, request: Request) -> Sequence:
        p = request.params
        output = OutputText(self.tokenizer.token_bytes, p.mode, p.stop, request.cursor_line, request.suffix,
                            request.heal, request.next_line, p.confidence, p.report_probs)
        return Sequence(request, output, self.kv.roles, self.policy.new_state())

    def abort(self, request_id: str) -> None:
        """End a request now (`cancelled`), wherever it is, and its candidates;
        their blocks return at once."""
        if (seq := self.scheduler.requests.get(request_id)) is not None:
            self.updater.finish(seq, "cancelled")
        self.scheduler.cancel_forks(request_id)
        for candidate in self.candidates.of_ended(request_id):  # it ended, they ran on
            self.updater.finish(candidate, "cancelled")

    @property
    def releasing(self) -> bool:
        """Blocks of ended requests still held by their aborted jobs: a step must
        take in the jobs' close to free them, even with nothing else to do
        (else the last cancel mid-transfer held its blocks until the next
        request came: found at 100 requests of prefill workers, issue #32)."""
        return self.connector is not None and self.connector.releasing

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
        self.executor.interrupted = self._interrupted if loop is not None else None
        try:
            return self._step()
        except PassInterrupted:  # every running request was cancelled mid-pass: they end now
            self.passes_interrupted += 1
            for request_id in loop.between_passes(self.output.drain()):
                self.abort(request_id)
            return self.output.drain()
        finally:
            self.loop = self.executor.interrupted = None

    def _step(self) -> list[Event]:
        self.take_closed_jobs()
        plan = self.scheduler.schedule(time.perf_counter())
        self.update(plan, None)
        if plan.expired:  # their answers go out now, not after this step's (maybe long) passes
            return self.output.drain()
        if plan.prefill:
            torch.set_num_threads(1 if self.fused else self.prefill_threads)
            self.executor.slice_until = plan.slice_until
            prefilled = self.executor.prefill(plan)
            self.update(plan, prefilled)
            if prefilled.paused:  # work that goes first came: it runs next step, this pass goes on after it
                return self.output.drain()
            self.updater.expire(time.perf_counter())  # a long prefill must not carry others past their deadline
            if self.loop is not None and self.config.between_passes:
                # A keystroke's first token is out a decode pass sooner; one superseded meanwhile
                # does not take a place in that pass.
                for request_id in self.loop.between_passes(self.output.drain()):
                    self.abort(request_id)
        if decoding := [s for s in plan.decode if s.status is Status.DECODE]:
            torch.set_num_threads(1 if self.fused else self.decode_threads)
            self.update(plan, self.executor.decode(decoding))
            self.updater.expire(time.perf_counter())  # nor wait for the next step to end
        return self.output.drain()

    def take_closed_jobs(self) -> list[Event]:
        """The connector's closed jobs: their sequences decode, prefill here or
        end with reason `deadline` (their worker lost, too little time left to
        prefill here: an outcome the deadline allows, not a server fault), and
        the blocks of those whose requests ended first return."""
        if self.connector is None:
            return []
        jobs = self.connector.poll(self.scheduler.running)
        first = [self.executor.first_token(seq, logits) for seq, logits in jobs.ready if not seq.params.priming]
        return self.update(None, (jobs, first))  # (delivered with the step's, or the loop's drain)

    def _interrupted(self) -> bool:
        """Before each layer of a pass: whether every running request has a
        cancel waiting (a newer keystroke superseded them), so the pass is
        work nobody will see. Only all of them: a pass is never half-given-up.
        (Warming is never in such a pass, and nobody cancels it: not counted.)"""
        return self.loop is not None and self.loop.cancel_waiting(
            [s.id for s in self.scheduler.running if not s.request.warm])

    def _bulk_goes_first(self) -> bool:
        """Before each layer of a bulk pass: a request waiting to come in goes first."""
        return self.loop is not None and any(self.goes_first(r, *self.executor.bulk_running)
                                             for r in self.loop.arrivals())

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

    def fail_running(self, message: str) -> list[tuple[str, object]]:
        """After step() raised: the running requests end with an `internal`
        error and give back their blocks (K/V past `computed` is never
        published, so nothing half-written is reused); the waiting ones keep
        their place. Returns the events to deliver, the step's deltas first."""
        for seq in self.scheduler.waiting:  # the one being admitted may hold blocks
            self.kv.free(seq)
        failed = [s for s in self.scheduler.running if s.candidate_of is None]
        for seq in failed:
            self.updater.drop(seq)
        for candidate in list(self.scheduler.running):  # a request that ended before them then has its answer
            self.updater.finish(candidate, "cancelled")
        return [(e.id, e) for e in self.output.drain()] + \
            [(s.id, EngineError("internal", message)) for s in failed]
