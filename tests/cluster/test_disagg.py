"""Conditional disaggregation: the routing decision, and real prefill worker
processes (the embedded model) shipping K/V into an engine in this process:
identical output, cancellation, a worker killed or stalled mid-transfer, and
no block left held on either side."""

from __future__ import annotations

import msgspec
import asyncio
import logging
import os
import random
import signal
import threading
import time
from collections import Counter

import pytest

from completer.config import load_config
from completer.disagg.connector import RemotePrefillConnector
from completer.disagg.decision import Estimates, PoolState, decide
from completer.disagg.local_workers import LocalWorker
from completer.disagg.remote import RemotePrefill
from completer.disagg.worker import model_shape
from completer.engine.engine import Engine, run_in_passing_thread
from completer.engine.paged_kv import KVPool
from completer.engine.request import EngineError, Finished
from completer.engine.sequence import Status
from completer.evaluate import heldout_files
from completer.loading import load_models
from completer.pipeline import CompletionPipeline, RequestOptions
from completer.protocol import Document

TOKEN = "test-token-1234567890"

# -- the decision ---------------------------------------------------------------

EST = Estimates(local_tokens_s=1000.0, remote_tokens_s=1000.0, link_bytes_s=1e9, kv_bytes_per_token=46_080,
                decode_pass_s=0.02, local_queued_tokens=0)
UP = PoolState(workers_up=1, least_queued_tokens=0)


def route(uncached, pool=UP, est=EST, threshold=1024, max_queue=8192, slack=1.5):
    return decide(uncached, threshold, max_queue, slack, 512, pool, est)


def test_a_prompt_at_the_threshold_stays_local_and_one_token_more_goes_remote():
    assert route(1024) == (False, "short", 0.0, 0.0)
    decision = route(1025)
    assert decision.remote and decision.reason == "long"


def test_no_worker_up_keeps_every_prompt_local():
    assert route(6000, pool=PoolState(0, 0)).reason == "no_worker"
    assert not route(6000, pool=PoolState(0, 0)).remote


def test_a_worker_queue_at_its_limit_takes_no_more():
    # (a large slack: the queue's wait alone would make local faster)
    assert route(2000, pool=PoolState(1, 6192), slack=100).remote  # 6,192 + 2,000 = the limit
    assert route(2001, pool=PoolState(1, 6192), slack=100)[:2] == (False, "queue_full")


def test_remote_is_chosen_only_within_the_slack_of_the_local_estimate():
    idle = EST._replace(decode_pass_s=0.0)  # nothing decoding: local is the prefill alone
    slow_worker = idle._replace(remote_tokens_s=500.0)  # twice the local time, past a 1.5x slack
    assert route(4000, est=slow_worker).reason == "local_faster"
    assert route(4000, est=slow_worker, slack=2.5).remote
    # A busy decode engine: each local chunk also waits for a decode pass, which the remote path skips.
    busy = slow_worker._replace(decode_pass_s=0.5)
    assert route(4000, est=busy).remote


# -- real workers ---------------------------------------------------------------


def config_of(*overrides: str):
    """The tests' settings. A worker silent `disagg.timeout_s` is declared down: 30 s here, since on a
    loaded machine a healthy worker process can go unscheduled past a second (issue #32: a test fell
    back to local prefill); the tests of a stalled worker set 1 s themselves."""
    return load_config(None, ['model.target="embedded"', "disagg.enabled=true", "disagg.threshold_tokens=64",
                              "disagg.remote_slack=1000", "disagg.timeout_s=30", "model.context_tokens=1024",
                              "engine.kv_cache_mb=96", "engine.prefill_chunk=128", "spec.draft_model=false",
                              "spec.ngram=false", "request.deadline_ms=60000", *overrides])


CONFIG = config_of()


@pytest.fixture(scope="module")
def target():
    m = CONFIG.model
    loaded, _ = run_in_passing_thread(load_models, m.target, "", m.precision)
    return loaded


@pytest.fixture(scope="module")
def worker():
    w = LocalWorker(CONFIG, TOKEN, 0, [])
    w.start()
    yield w
    w.stop()


def remote_for(target, worker: LocalWorker, config=CONFIG, **shape_changes) -> RemotePrefill:
    cfg, e = target.model.config, config.engine
    shape = model_shape(target.name, cfg, target.precision, e.block_size, e.prefill_chunk)
    shape = type(shape)(**{**{f: getattr(shape, f) for f in shape.__struct_fields__}, **shape_changes})
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    remote = RemotePrefill([worker.address], shape, TOKEN, config.disagg, kv_bytes, [worker.resolve])
    remote.start(wait_s=2.0)
    return remote


def documents(n: int, seed: int, chars: tuple[int, int] = (600, 2400)) -> list[Document]:
    """Cursors in held-out files, each a different document (nothing shared but the template)."""
    _, files = heldout_files()
    rng = random.Random(seed)
    texts = [f.text for f in files if len(f.text) > chars[1] + 200]
    out = []
    for i in range(n):
        text = rng.choice(texts)
        start = rng.randrange(0, len(text) - chars[1] - 100)
        cut = start + rng.randrange(*chars)
        out.append(Document(f"file:///doc{seed}-{i}.py", f"# {seed}-{i}\n" + text[start:cut], text[cut:cut + 200]))
    return out


async def complete(engine: Engine, pipeline: CompletionPipeline, request_id: str, doc: Document,
                   options: RequestOptions = RequestOptions(mode="free", max_tokens=16)) -> Finished:
    return await engine.submit(pipeline.request(request_id, doc, options=options)).finished()


def engine_with(target, remote: RemotePrefill | None, config=CONFIG) -> Engine:
    return Engine.build(target, None, config.engine, config.spec,
                        connector=RemotePrefillConnector(remote) if remote is not None else None)


def blocks_referenced(engine: Engine) -> int:
    return sum(p.num_blocks - 1 - p.num_free for p in engine.core.kv.pools.values())


def test_a_disaggregated_completion_is_token_for_token_the_local_one(target, worker):
    """Greedy, 50 prompts (speculation off: its verify widths vary with timing,
    which changes the arithmetic between any two runs, local or not)."""
    pipeline = CompletionPipeline(target, CONFIG)

    async def main():
        remote = remote_for(target, worker)
        # Locally as a worker's prefill is taken in: no heal token riding the prefill pass, no moved K/V.
        same_path = msgspec.structs.replace(CONFIG, engine=msgspec.structs.replace(
            CONFIG.engine, heal_in_prefill=False, reuse_moved_kv=False))
        disagg, local = engine_with(target, remote), engine_with(target, None, same_path)
        disagg.start()
        local.start()
        try:
            pairs = []
            for i, doc in enumerate(documents(50, seed=1)):
                pairs.append((await complete(disagg, pipeline, f"d{i}", doc),
                              await complete(local, pipeline, f"l{i}", doc)))
            return pairs
        finally:
            disagg.stop()
            local.stop()

    pairs = asyncio.run(main())
    assert [a.timings.prefill for a, _ in pairs] == ["remote"] * 50
    assert all(a.timings.kv_transfer_bytes > 0 for a, _ in pairs)
    assert [a.text for a, _ in pairs] == [b.text for _, b in pairs]
    assert [a.reason for a, _ in pairs] == [b.reason for _, b in pairs]


def test_a_short_prompt_never_leaves_the_decode_engine(target, worker):
    config = config_of("disagg.threshold_tokens=900")
    pipeline = CompletionPipeline(target, config)

    async def main():
        remote = remote_for(target, worker, config)
        engine = engine_with(target, remote, config)
        engine.start()
        try:
            return [await complete(engine, pipeline, f"s{i}", doc) for i, doc in enumerate(documents(5, seed=2))]
        finally:
            engine.stop()

    done = asyncio.run(main())
    assert {(d.timings.prefill, d.timings.prefill_reason, d.timings.kv_transfer_bytes) for d in done} == \
        {("local", "short", 0)}


def test_a_worker_serving_other_kv_is_refused_and_prompts_stay_local(target, worker):
    pipeline = CompletionPipeline(target, CONFIG)

    async def main():
        remote = remote_for(target, worker, block_size=32)  # K/V laid out differently: must not be mixed
        engine = engine_with(target, remote)
        engine.start()
        try:
            return remote.workers_up, await complete(engine, pipeline, "r", documents(1, seed=3)[0])
        finally:
            engine.stop()

    up, done = asyncio.run(main())
    assert up == 0
    assert (done.timings.prefill, done.timings.prefill_reason) == ("local", "no_worker")


def interrupted_mid_transfer(target, how: signal.Signals,
                             local_tokens_s: float | None = None) -> tuple[Finished | EngineError, Finished, float]:
    """A long prompt on its own worker, which gets `how` once the first K/V
    group of the job has arrived; (that completion or its error, the same
    one computed locally, seconds from the signal to the end).
    local_tokens_s: what the engine believes its own prefill rate is."""
    config = config_of("engine.prefill_chunk=32", "model.context_tokens=2048", "engine.kv_cache_mb=256",
                       "disagg.timeout_s=1.0")
    pipeline = CompletionPipeline(target, config)
    victim = LocalWorker(config, TOKEN, 9, [])
    victim.start()
    doc = documents(1, seed=4, chars=(5000, 6000))[0]

    async def main():
        remote = remote_for(target, victim, config)
        engine, local = engine_with(target, remote, config), engine_with(target, None, config)
        engine.start()  # measures the engine's own prefill rate
        local.start()
        if local_tokens_s is not None:
            remote.local_tokens_s = local_tokens_s
        try:
            stream = engine.submit(pipeline.request("victim", doc, options=RequestOptions(mode="free", max_tokens=16)))
            link = remote.links[0]
            while not any(job.groups for job in list(link.jobs.values())):
                await asyncio.sleep(0.001)
            os.kill(victim.proc.pid, how)
            signalled = time.perf_counter()
            try:
                done = await stream.finished()
            except EngineError as e:
                done = e
            ended = time.perf_counter() - signalled
            assert blocks_referenced(engine) == 0 and not engine.core.connector.held_by_jobs
            return done, await complete(local, pipeline, "local", doc), ended
        finally:
            engine.stop()
            local.stop()

    try:
        return asyncio.run(main())
    finally:
        if how == signal.SIGSTOP:
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()


def test_a_worker_killed_mid_transfer_leaves_its_request_completed_here(target):
    done, local, _ = interrupted_mid_transfer(target, signal.SIGKILL)
    assert (done.timings.prefill, done.timings.prefill_reason) == ("local", "worker_lost")
    assert done.timings.kv_transfer_bytes > 0  # some K/V had crossed before the worker died
    assert (done.text, done.reason) == (local.text, local.reason)


def test_a_stalled_worker_is_declared_down_within_its_timeout_and_its_request_completes_here(target):
    done, local, ended = interrupted_mid_transfer(target, signal.SIGSTOP)
    assert (done.timings.prefill, done.timings.prefill_reason) == ("local", "worker_lost")
    assert (done.text, done.reason) == (local.text, local.reason)
    assert ended < 1.0 + 0.5 + 10  # disagg.timeout_s, the supervisor's tick, then the local prefill


def test_a_job_lost_mid_transfer_with_too_little_deadline_left_to_prefill_here_ends_with_reason_deadline(
        target, caplog):
    """Out of time, not a server fault: a `done` with reason `deadline` (no
    `internal` error, which the soak counts as a bug), at once, its timings
    saying why (its worker lost), and one warning line with the figures."""
    with caplog.at_level(logging.WARNING, logger="completer.engine.remote_prefill"):
        done, _, ended = interrupted_mid_transfer(target, signal.SIGKILL, local_tokens_s=1.0)
    assert isinstance(done, Finished), done
    assert (done.reason, done.text) == ("deadline", "")
    assert (done.timings.prefill, done.timings.prefill_reason) == ("local", "worker_lost")
    assert done.timings.kv_transfer_bytes > 0  # some K/V had crossed before the worker died
    assert ended < 5.0  # at once, not at the deadline (60 s)
    assert "prefill worker lost" in caplog.text and "too little to prefill here" in caplog.text


def test_a_hundred_requests_with_a_third_cancelled_mid_transfer_leave_no_block_held_on_either_side(target, worker):
    """The property of what was a thousand requests (642 s under load), at a tenth of the size."""
    config = CONFIG  # the shared worker's: a worker serves engines whose K/V layout and chunks are its own
    pipeline = CompletionPipeline(target, config)
    docs = documents(40, seed=5, chars=(400, 1200))
    rng = random.Random(5)
    total = 100

    async def main():
        remote = remote_for(target, worker, config)
        engine = engine_with(target, remote, config)
        terminal = Counter()
        dispatch = engine._dispatch

        def counting(events):  # every answer the engine gives, before the streams see them
            terminal.update(i for i, e in events if isinstance(e, (Finished, EngineError)))
            dispatch(events)

        engine._dispatch = counting
        engine.start()
        cancelled_mid_transfer = 0
        outcomes = Counter()
        cancels = []

        async def one(i: int):
            nonlocal cancelled_mid_transfer
            request = pipeline.request(f"k{i}", docs[i % len(docs)],
                                       options=RequestOptions(mode="free", max_tokens=4, cache_salt=str(i)))
            stream = engine.submit(request)
            if rng.random() < 0.3:
                cancels.append(i)
                seq = None
                waited = time.monotonic() + 60  # a loaded machine is slow to start the transfer: no timing here
                while time.monotonic() < waited:  # until its K/V is on the way (or it is over)
                    seq = engine.core.scheduler.requests.get(request.id)
                    job = seq.remote_job if seq is not None else None
                    link_jobs = remote.links[0].jobs
                    if job is not None and job in link_jobs and link_jobs[job].groups:
                        break
                    if seq is None and (stream.result is not None or not stream.queue.empty()):
                        break  # over before its K/V crossed
                    await asyncio.sleep(0.0005)
                if seq is not None and seq.status is Status.REMOTE:
                    cancelled_mid_transfer += 1
                engine.cancel(request.id)
            try:
                outcomes[(await stream.finished()).reason] += 1
            except EngineError as e:
                outcomes[e.code] += 1

        try:
            for start in range(0, total, 8):
                await asyncio.gather(*(one(i) for i in range(start, min(start + 8, total))))
            patience = time.monotonic() + 120  # the last aborts' answers: slow on a loaded machine
            while time.monotonic() < patience:
                if not engine.core.connector.held_by_jobs and remote.worker_blocks_held.get(worker.address) == 0:
                    break
                await asyncio.sleep(0.05)
            return (terminal, outcomes, len(cancels), cancelled_mid_transfer, blocks_referenced(engine),
                    dict(engine.core.connector.held_by_jobs), remote.worker_blocks_held.get(worker.address),
                    remote.workers_up)
        finally:
            engine.stop()

    terminal, outcomes, cancels, mid, decode_held, jobs_held, worker_held, up = asyncio.run(main())
    assert len(terminal) == total and set(terminal.values()) == {1}  # none lost, none answered twice
    assert sum(outcomes.values()) == total and cancels >= 25 and outcomes["cancelled"] >= cancels // 2
    assert mid >= cancels // 2  # most cancels hit a job whose K/V was crossing
    assert (decode_held, jobs_held, worker_held) == (0, {}, 0)
    assert up == 1  # aborts answered in time: the worker was never declared down


def test_blocks_held_by_jobs_whose_requests_ended_return_when_the_stalled_worker_is_declared_down(target):
    """Six long prompts on a worker that stops mid-transfer: each answers at
    its deadline (its blocks handed to its job), the link is declared down
    (the jobs close as lost), and the blocks return then, with nothing else
    arriving to wake the engine."""
    config = config_of("engine.prefill_chunk=32", "model.context_tokens=2048", "engine.kv_cache_mb=256",
                       "disagg.timeout_s=2.0", "request.deadline_ms=1500")
    pipeline = CompletionPipeline(target, config)
    victim = LocalWorker(config, TOKEN, 8, [])
    victim.start()
    docs = documents(6, seed=6, chars=(5000, 6000))

    async def main():
        remote = remote_for(target, victim, config)
        engine = engine_with(target, remote, config)
        engine.start()
        try:
            streams = [engine.submit(pipeline.request(f"long{i}", doc, options=RequestOptions(mode="free",
                                                                                            max_tokens=16)))
                       for i, doc in enumerate(docs)]
            link = remote.links[0]
            while not any(job.groups for job in list(link.jobs.values())):
                await asyncio.sleep(0.001)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            reasons = [(await s.finished()).reason for s in streams]
            held = blocks_referenced(engine)
            for _ in range(100):  # the link's timeout, then the supervisor's tick
                if not remote.workers_up and blocks_referenced(engine) == 0:
                    break
                await asyncio.sleep(0.1)
            return reasons, held, remote.workers_up, blocks_referenced(engine), dict(engine.core.connector.held_by_jobs)
        finally:
            engine.stop()

    try:
        reasons, held_at_deadline, up, held_after, jobs = asyncio.run(main())
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()
    assert reasons == ["deadline"] * 6
    assert held_at_deadline > 0  # the jobs held them: the worker might still have written
    assert up == 0
    assert (held_after, jobs) == (0, {})


LINK_THREADS = ("prefill-link", "link-store", "link-store-peer")  # a link's reader, its store's acceptor and peer


def link_threads() -> int:
    return sum(t.name in LINK_THREADS for t in threading.enumerate())


def process_threads() -> int:
    import psutil

    return psutil.Process().num_threads()


def settled(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_a_closed_link_store_ends_its_threads_and_stops_listening_though_its_peer_never_closes():
    """(Closing alone left its acceptor blocked in accept() for good, the
    port still listening under it, and a stopped worker's peer thread in recv.)"""
    import socket

    from completer.disagg.link_store import LinkStore, RemoteStore

    before = link_threads()
    store = LinkStore("127.0.0.1")
    peer = RemoteStore("127.0.0.1", store.port, store.secret)  # left open, as a stopped worker's is
    try:
        peer.set("key", b"value")
        assert settled(lambda: link_threads() == before + 2)  # the acceptor, the peer's
        store.close()
        assert settled(lambda: link_threads() == before, 5), [t.name for t in threading.enumerate()]
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
    finally:
        peer.close()


def test_lost_links_release_their_threads_and_the_link_comes_back_after_each(target):
    """Issue #31's soak: every lost link left a thread behind, and so did
    every failed attempt to reach a stopped worker (the link store's acceptor
    blocked in accept() on a socket closed under it, which Linux does not
    wake; the stopped worker's store peer, likewise in recv), so a server
    faulted every few minutes grew a thread or more each time. Here
    three faults in a row, each with a job mid-transfer: a worker killed;
    stopped until declared down (the supervisor trying it meanwhile), then
    continued; stopped, then killed. While it is down and after each, the
    link's threads are back to what one link has, and a job is done over
    the link again."""
    config = config_of("engine.prefill_chunk=32", "model.context_tokens=2048", "disagg.timeout_s=1.0",
                       "disagg.retry_max_s=0.5")
    cfg, bs = target.model.config, config.engine.block_size
    others = link_threads()  # (an earlier test's links, if any are left)
    victim = LocalWorker(config, TOKEN, 10, [])
    victim.start()
    remote = remote_for(target, victim, config)
    remote.register(KVPool(cfg, 1600 // bs + 2, bs))
    link = remote.links[0]
    rng = random.Random(10)

    def job(n_tokens: int, salt: str) -> int:
        job_id = remote.start_job([rng.randrange(10, cfg.vocab_size - 10) for _ in range(n_tokens)], 0,
                                  list(range(1, n_tokens // bs + 2)), salt)
        assert job_id is not None, "no worker up"
        return job_id

    def outcome(job_id: int) -> str:
        closed = []
        assert settled(lambda: closed.extend(remote.poll()) or closed, 60), f"job {job_id} never closed"
        assert [c.job for c in closed] == [job_id]
        return closed[0].outcome

    stopped = False
    try:
        assert remote.workers_up == 1
        assert outcome(job(256, "warm")) == "done"
        one_link, threads = link_threads(), process_threads()
        assert one_link - others == 3  # its reader, its store's acceptor and the worker's peer there
        for fault in ("kill", "stop-cont", "stop-kill"):
            lost = job(1500, fault)
            assert settled(lambda: (j := link.jobs.get(lost)) is not None and j.groups > 0, 60)
            pid = victim.proc.pid
            os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            stopped = fault != "kill"
            assert outcome(lost) == "lost"
            if stopped:
                assert settled(lambda: not link.up)
                time.sleep(1.5)  # attempts to reach the stopped worker time out meanwhile
                # The lost link's threads end; at most an attempt's store is waiting for the stopped worker.
                assert settled(lambda: link_threads() <= others + 1, 5), [t.name for t in threading.enumerate()]
                assert process_threads() <= threads
                os.kill(pid, signal.SIGCONT if fault == "stop-cont" else signal.SIGKILL)
                stopped = False
            assert settled(lambda: remote.workers_up == 1, 60), f"{fault}: not up again"
            assert outcome(job(256, f"after-{fault}")) == "done", fault
            assert settled(lambda: link_threads() <= one_link, 5), \
                f"{fault}: {[t.name for t in threading.enumerate()]}"
            assert settled(lambda: process_threads() <= threads + 1, 5), (fault, process_threads(), threads)
    finally:
        remote.close()
        if stopped:
            os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()


class _Work:
    def __init__(self, error: str):
        self.error = error

    def wait(self):
        if self.error:
            raise RuntimeError(self.error)


class _Pair:
    """A K/V pair whose sends fail as gloo's do once the peer is gone (or not at all)."""

    def __init__(self, error: str = ""):
        self.error = error

    def send(self, tensor, tag):
        return _Work(self.error)


class _Channel:
    def __init__(self, closed_at_group: bool = False):
        self.closed_at_group, self.sent = closed_at_group, []

    def send(self, message):
        from completer.disagg.messages import Group
        from completer.disagg.transport import ChannelClosed

        if self.closed_at_group and isinstance(message, Group):
            raise ChannelClosed("send failed: [Errno 9] Bad file descriptor")
        self.sent.append(message)


@pytest.mark.parametrize("how", ["pair", "channel", "compute"])
def test_a_worker_says_in_one_warning_line_that_a_jobs_link_is_gone_and_keeps_tracebacks_for_its_own_faults(
        target, how, caplog, monkeypatch):
    """The soak's worker logged a traceback at ERROR for each job whose
    decode engine went away mid-transfer (a send on the pair or the control
    channel failing): expected, one WARNING line. A failure of its own still
    gets its traceback."""
    import logging

    from completer.disagg.messages import Failed, Job
    from completer.disagg.worker import Link, PrefillWorker, WorkerJob

    e = CONFIG.engine
    worker = PrefillWorker(target.model, target.name, target.precision, e.block_size, e.prefill_chunk, 8.0, 2,
                           TOKEN, 1.0)
    channel = _Channel(closed_at_group=how == "channel")
    pair = _Pair("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26031. "
                 "This is typically caused by a remote worker crashing.\nmore" if how == "pair" else "")
    if how == "compute":
        monkeypatch.setattr(worker.runner, "execute", lambda *a, **k: 1 / 0)
    link = Link(channel, pair, "127.0.0.1:4242")
    job = WorkerJob(link, Job(7, list(range(10, 210)), 0))
    worker.by_id[(id(link), 7)] = job
    worker.queued_tokens += 200
    with caplog.at_level(logging.INFO, logger="completer.disagg.worker"):
        worker._run(job)
    records = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    if how == "compute":
        assert [(level, tb) for level, _, tb in records] == [("ERROR", True)]
    else:
        assert len(records) == 1 and records[0][0] == "WARNING" and not records[0][2], records
        assert "job 7 of 127.0.0.1:4242" in records[0][1] and "\n" not in records[0][1]
    assert isinstance(channel.sent[-1], Failed)
    assert worker.by_id == {} and worker.queued_tokens == 0 and worker.blocks_held == 0


def listening_addresses() -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"}


def test_the_links_store_admits_only_its_worker_on_the_links_address_and_bounds_what_it_stores(target, worker):
    """The K/V pair's rendezvous store (once a TCPStore on every interface,
    open to any local process): bound to the link's address, closed to a
    client without the link's secret, and bounded for one with it."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    from completer.disagg.link_store import MAX_BYTES, MAX_VALUE, RemoteStore

    before = listening_addresses()
    remote = remote_for(target, worker)
    try:
        assert remote.workers_up == 1
        link = remote.links[0]
        opened = listening_addresses() - before
        # The store's, and gloo's own for the pair: on the link's address, none on 0.0.0.0 or ::.
        assert ("127.0.0.1", link.store.port) in opened and {ip for ip, _ in opened} == {"127.0.0.1"}, opened
        port = link.store.port
        # torch's own client, as the local process used it: no key count, no write.
        with pytest.raises(Exception):
            TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3)).num_keys()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # a wrong secret: closed
            sock.sendall(b"x" * 32)
            assert sock.recv(1) == b""
        with pytest.raises(ConnectionError):
            RemoteStore("127.0.0.1", port, b"\0" * 32)
        keys = link.store.store.num_keys()
        # The worker's own secret admits it; it still cannot grow this process's memory.
        peer = RemoteStore("127.0.0.1", port, link.store.secret)
        with pytest.raises(RuntimeError):  # 8 MB, as the forty writes: not read, the peer dropped
            peer.set("big", b"\0" * (8 << 20))
        peer = RemoteStore("127.0.0.1", port, link.store.secret)  # refused: that connection was closed
        with pytest.raises(RuntimeError, match="full"):
            for i in range(MAX_BYTES // MAX_VALUE + 2):
                peer.set(f"k{i}", b"\0" * MAX_VALUE)
        peer.close()
        assert link.store.store.num_keys() <= keys + MAX_BYTES // MAX_VALUE
    finally:
        remote.close()
    assert ("127.0.0.1", port) not in listening_addresses()  # closed with its link


def test_a_worker_on_the_engines_cores_is_not_used_while_the_engine_makes_way_for_keystrokes(target, worker):
    from completer.disagg.decision import shares_cores

    assert shares_cores([], [1]) and shares_cores([0], []) and shares_cores([0, 1], [1])
    assert not shares_cores([0], [1])
    assert route(6000, pool=PoolState(0, 0, sharing_cores=1))[:2] == (False, "shared_cores")
    assert route(6000, pool=PoolState(1, 0, sharing_cores=1)).remote  # one of its own is used
    pipeline = CompletionPipeline(target, CONFIG)

    async def main(local_yields: bool):
        cfg, e = target.model.config, CONFIG.engine
        shape = model_shape(target.name, cfg, target.precision, e.block_size, e.prefill_chunk)
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
        remote = RemotePrefill([worker.address], shape, TOKEN, CONFIG.disagg, kv_bytes, [worker.resolve],
                               shared=[True], local_yields=local_yields)
        remote.start(wait_s=2.0)
        engine = engine_with(target, remote)
        engine.start()
        try:
            return await complete(engine, pipeline, "s", documents(1, seed=3)[0])
        finally:
            engine.stop()

    assert asyncio.run(main(True)).timings.prefill_reason == "shared_cores"
    assert asyncio.run(main(False)).timings.prefill == "remote"
