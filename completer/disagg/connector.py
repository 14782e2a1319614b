"""Disaggregated prefill as the engine's KV connector
(`completer.engine.kv_connector.KVConnector`): on admission, route a prompt
to a worker (reserving its destination blocks first); each step, take in the
jobs that closed (K/V complete: the sequence joins the decode batch; lost:
prefill here if the deadline allows, else the request ends with reason
`deadline`); when a request ends while a worker may still write its blocks,
hand the blocks to the job until it closes (`disagg.remote` says who owns
what)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from completer.disagg.remote import Closed, RemotePrefill
from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.kv_connector import ClosedJobs
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


class RemotePrefillConnector:
    def __init__(self, remote: RemotePrefill):
        self.remote = remote
        self.kv: KVCacheManager | None = None
        self.prefill_chunk = 0
        self.held_by_jobs: dict[int, list[int]] = {}  # job -> target blocks of a request that ended first
        self.decode_pass_s = 0.0  # the last decode pass: what each local chunk also waits for

    @property
    def wake(self) -> Callable[[], None]:
        return self.remote.wake

    @wake.setter
    def wake(self, wake: Callable[[], None]) -> None:
        self.remote.wake = wake

    def bind(self, kv: KVCacheManager, pool: KVPool, prefill_chunk: int) -> None:
        self.kv, self.prefill_chunk = kv, prefill_chunk
        self.remote.register(pool)

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """On admission: this prompt's uncached part to a worker (True), or not (`disagg.decision`)."""
        state = seq.kv["target"]
        local_queued = sum(s.prefill_left for s in running if s.status is Status.PREFILL and s is not seq)
        pass_s = self.decode_pass_s if any(s.status is Status.DECODE for s in running) else 0.0
        decision = self.remote.choose(seq.prompt_len - state.computed, self.prefill_chunk, pass_s, local_queued)
        seq.timings.prefill_reason = decision.reason
        if not decision.remote:
            return False
        self.kv.grow(seq, "target", seq.prompt_len)  # the destination, reserved first
        job = self.remote.start_job(seq.tokens, state.computed, list(state.table), seq.cache_salt)
        if job is None:  # every worker went down meanwhile; the blocks serve the local prefill
            seq.timings.prefill_reason = "no_worker"
            return False
        seq.remote_job = job
        return True

    def hand_over(self, seq: Sequence) -> None:
        """`seq` ends while its job may still write its target blocks: they
        stay the job's (released when it closes), and the job is aborted."""
        job, seq.remote_job = seq.remote_job, None
        self.held_by_jobs[job] = self.kv.detach(seq, "target")
        self.remote.abort(job)

    @property
    def releasing(self) -> bool:
        return bool(self.held_by_jobs)

    def poll(self, running: list[Sequence]) -> ClosedJobs:
        """The jobs that closed since the last step."""
        out = ClosedJobs([], [], [])
        by_job = {s.remote_job: s for s in running if s.remote_job is not None}
        for closed in self.remote.poll():
            if (table := self.held_by_jobs.pop(closed.job, None)) is not None:
                self.kv.pools["target"].release(table)
                continue
            seq = by_job[closed.job]
            seq.remote_job = None
            seq.timings.kv_transfer_bytes += closed.bytes
            seq.timings.kv_transfer_ms += closed.transfer_s * 1000
            if closed.outcome == "done":
                self.kv.remote_done(seq)
                seq.timings.prefill = "remote"
                out.ready.append((seq, closed.logits))
            elif self._recompute_here(seq, closed):
                out.here.append(seq)
            else:
                out.late.append(seq)
        return out

    def _recompute_here(self, seq: Sequence, closed: Closed) -> bool:
        """A job lost (its worker died, stalled or failed): prefill here if the
        deadline leaves time for it (True); else the request is out of time
        (False): not a fault of the server's, an outcome a deadline allows."""
        state = seq.kv["target"]  # (K/V a worker left past `computed`, maybe partial, is written over here)
        seq.timings.prefill_reason = "worker_lost"
        need_s = (seq.prompt_len - state.computed) / self.remote.local_tokens_s
        left_s = math.inf if seq.deadline is None else seq.deadline - time.perf_counter()
        if need_s > left_s:
            log.warning("request %s: prefill worker lost (%s) and %.1f s left of its deadline is too little "
                        "to prefill here (~%.1f s): it ends now with reason deadline", seq.id, closed.why,
                        left_s, need_s)
            return False
        log.warning("request %s: %s (%s); prefilling it here instead", seq.id, closed.why,
                    "mid-transfer" if closed.mid_transfer else "before any K/V arrived")
        return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.remote.observe_local(tokens, seconds)

    def observe_decode_pass(self, seconds: float) -> None:
        self.decode_pass_s = seconds

    def set_prefill_rate(self, tokens_s: float) -> None:
        self.remote.local_tokens_s = tokens_s

    @property
    def workers_up(self) -> int:
        return self.remote.workers_up

    def close(self) -> None:
        self.remote.close()
