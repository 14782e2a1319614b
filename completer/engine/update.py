"""The update half of a step: a step's outputs applied to its requests (vLLM
v1's `update_from_output`). K/V progress advances here (`kv_cache_manager`),
accepted tokens become text and events (`output_processor`), K/V of rejected
drafts is rolled back and full blocks published, and statuses change through
the scheduler. Nothing here runs a model."""

from __future__ import annotations

from completer.engine.candidates import Candidates
from completer.engine.executor import DecodeOutput, Executor, FirstToken, PrefillOutput
from completer.engine.kv_cache_manager import KVCacheManager, advance
from completer.engine.kv_connector import ClosedJobs, KVConnector
from completer.engine.output_processor import OutputProcessor
from completer.engine.request import Event, FinishReason
from completer.engine.scheduler import Scheduler, SchedulerOutput
from completer.engine.sequence import Sequence, Status
from completer.engine.speculator import Speculator


class Updater:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, output: OutputProcessor, candidates: Candidates,
                 speculator: Speculator, executor: Executor, connector: KVConnector | None):
        self.kv, self.scheduler, self.output, self.candidates = kv, scheduler, output, candidates
        self.speculator, self.executor, self.connector = speculator, executor, connector

    def update(self, plan: SchedulerOutput | None,
               outputs: PrefillOutput | DecodeOutput | tuple[ClosedJobs, list[FirstToken]] | None) -> list[Event]:
        """Apply what a step computed: nothing yet (the plan alone: its
        expired end, and requests whose candidates did not join answer), its
        prefill passes, its verify pass, or the connector's closed jobs.
        Returns the events it made (they stay in the output processor until
        the step delivers them: a step that fails later still sends them)."""
        before = len(self.output.events)
        match outputs:
            case None:
                for seq in plan.expired:
                    self.finish(seq, "deadline")
                self._forked(plan)
            case PrefillOutput():
                self._prefilled(plan, outputs)
            case DecodeOutput():
                self._verified(outputs)
            case (ClosedJobs() as jobs, first):
                self._jobs_closed(jobs, first)
        return self.output.events[before:]

    def _forked(self, plan: SchedulerOutput) -> None:
        """A request that ended before its candidates were planned, and none
        joined: its `Finished`, held for them, goes out now."""
        for fork in plan.forks:
            if not fork.candidates and fork.seq.status is Status.FINISHED:
                if (finished := fork.seq.candidates.result()) is not None:
                    self.output.events.append(finished)

    def _prefilled(self, plan: SchedulerOutput, out: PrefillOutput) -> None:
        for seq, run, _ in plan.copies:
            self.kv.moved_done(seq)
            seq.timings.moved_tokens += run.length
        for chunk, took_ms in out.chunks:
            seq = chunk.seq
            self.kv.prefilled(seq, chunk.role, chunk.n + chunk.heal)  # (the heal token is not published)
            if chunk.role == "target":
                seq.timings.prefill_ms += took_ms
                seq.target_passes += 1
            else:
                seq.timings.draft_ms += took_ms
        if out.bulk_progressed:
            self.scheduler.bulk_progressed()
        for first in out.first:
            self.start_decoding(first)
        for chunk, _ in out.chunks:  # a priming request ends once every pool holds its prompt (blocks stay cached)
            seq = chunk.seq
            if seq.params.priming and seq.status is Status.PREFILL and seq.prefill_left == 0 \
                    and seq.kv["target"].computed >= seq.prompt_len:
                self.finish(seq, "length")

    def _jobs_closed(self, jobs: ClosedJobs, first: list[FirstToken]) -> None:
        """A worker's job closed: its K/V arrived (the first token is next), it
        was lost and the prompt is prefilled here, or it is out of time."""
        for seq in [s for s, _ in jobs.ready] + jobs.here:
            self.scheduler.prefill_here(seq)
        for f in first:
            self.start_decoding(f)
        for seq, _ in jobs.ready:
            if seq.params.priming and seq.prefill_left == 0:
                self.finish(seq, "length")
        for seq in jobs.late:
            self.finish(seq, "deadline")

    def start_decoding(self, first: FirstToken) -> None:
        """The first token, once the target holds the whole prompt (a lagging
        drafter catches up when it next proposes); the request's candidates fork from it."""
        seq = first.seq
        if seq.status is Status.FINISHED:  # ended meanwhile (a deadline between passes)
            return
        self.scheduler.start_decoding(seq)
        if candidates := self.candidates.build(seq, first.alternatives):
            self.scheduler.fork(seq, candidates)  # (they join at the next plan)
        self.accept(seq, first.tokens, first.probs)  # (a rejected heal token's K/V is rolled back there)

    def _verified(self, out: DecodeOutput) -> None:
        for row in out.rows:
            seq = row.seq
            advance([seq.kv["target"]], [row.width])  # (rolled back to the accepted tokens in `accept`)
            seq.timings.decode_ms += out.took_ms
            seq.timings.decode_passes += 1
            seq.target_passes += 1
            if row.proposal is not None:
                self.speculator.observe(seq, row.proposal, len(row.tokens) - 1)
        if self.connector is not None:
            self.connector.observe_decode_pass(out.took_ms / 1000)
        for row in out.rows:
            self.accept(row.seq, row.tokens, row.probs)

    def accept(self, seq: Sequence, tokens: list[int], probs: list[float] | None = None) -> None:
        """Stream accepted tokens and stop as the mode (and the confidence rules,
        given `probs`) says; else make every pool hold exactly the K/V of the
        accepted tokens but the last."""
        reason = self.output.append(seq, tokens, probs)
        if reason is not None:
            self.finish(seq, reason)
            return
        for role in self.kv.roles:
            self.kv.rollback(seq, role, len(seq.tokens) - 1)  # drop K/V of rejected drafts
            self.kv.publish(seq, role)

    def expire(self, now: float) -> None:
        for seq in self.scheduler.expire(now):
            self.finish(seq, "deadline")

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.drop(seq)
        self.output.finish(seq, reason)
        if (reason == "cancelled" or seq.output.cut == "first") and seq.candidates is not None:
            for candidate in list(seq.candidates.running):
                self.finish(candidate, "cancelled")

    def drop(self, seq: Sequence) -> None:
        self.executor.forget(seq)
        if seq.remote_job is not None:  # a worker may still write its blocks: its job keeps them
            self.connector.hand_over(seq)
        self.kv.free(seq)
        if seq.status is not Status.FINISHED:
            self.scheduler.remove(seq)
