"""The decode engine's side of disaggregated prefill: links to workers, jobs,
and who owns the blocks being written.

Ownership. The engine reserves a job's destination blocks before the job is
sent; from then until the job *closes* only the link's reader thread writes
them (under the link's lock, and only while the job is open). A job closes
exactly once: `Done` (its K/V complete), `Aborted` (the worker's answer to
an abort), `Failed`, or the link going down (a dead, silent or refusing
worker). The engine learns of it through `poll()`, and only then may it
free, reuse or read the blocks. A cancelled request therefore hands its
blocks to the job; they come back when the worker answers the abort, or
within `timeout_s` when it does not, since the link is then declared down.

Past ~300 lines: the links, their jobs and the blocks the jobs own change
together (a link that goes down ends its jobs and hands back their blocks).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Callable, Literal, NamedTuple

import torch

from completer.config import DisaggConfig
from completer.disagg.decision import Decision, Estimates, PoolState, decide
from completer.disagg.messages import (PROTOCOL, Abort, Aborted, Done, Failed, Group, Heartbeat, Hello, Job,
                                       ModelShape, Welcome)
from completer.disagg.link_store import LinkStore
from completer.disagg.transport import FrameChannel, KVPair
from completer.engine.paged_kv import KVPool

log = logging.getLogger(__name__)
# Priors until measured (this CPU: ~1,000 prompt tokens/s per core, loopback ~1.3 GB/s).
PRIOR_TOKENS_S = 1000.0
PRIOR_LINK_BYTES_S = 1e9
EWMA = 0.3


class Closed(NamedTuple):
    """A job's end, as `poll()` reports it."""

    job: int
    outcome: Literal["done", "aborted", "lost"]
    logits: torch.Tensor | None = None  # "done": the prompt's last token's
    why: str = ""  # "lost": what happened
    mid_transfer: bool = False  # "lost": some of its K/V had arrived
    bytes: int = 0
    transfer_s: float = 0.0  # time spent receiving its K/V
    computed: int = 0  # tokens the worker ran (the rest came from its cache)


class TransferJob:
    def __init__(self, job_id: int, tokens: list[int], have: int, table: list[int], salt: str):
        self.id, self.tokens, self.have, self.salt = job_id, tokens, have, salt
        self.table = torch.tensor(table, dtype=torch.long)  # destination blocks (a copy: the engine's may change)
        self.groups = 0
        self.bytes = 0
        self.recv_s = 0.0
        self.aborted_at: float | None = None

    @property
    def uncached(self) -> int:
        return len(self.tokens) - self.have


class WorkerLink:
    """One worker: its connection, its open jobs, its health."""

    def __init__(self, address: str, remote: "RemotePrefill", resolve: Callable[[], str] | None = None,
                 shares_cores: bool = False):
        self.address = address
        self.shares_cores = shares_cores  # a local worker on the engine's cores (`decision`: shared_cores)
        self.resolve = resolve  # a local worker: (re)start it if it exited; its current address
        self.remote = remote
        self.lock = threading.Lock()
        self.up = False
        self.jobs: dict[int, TransferJob] = {}
        self.channel: FrameChannel | None = None
        self.pair: KVPair | None = None
        self.store: LinkStore | None = None
        self.last_heard = 0.0
        self.retry_at = 0.0
        self.backoff = 0.25
        self.generation = 0
        self.tokens_s = PRIOR_TOKENS_S  # its prefill rate: from its welcome, then from its jobs

    @property
    def queued_tokens(self) -> int:
        return sum(job.uncached for job in list(self.jobs.values()))

    def connect(self) -> None:
        r = self.remote
        if self.resolve is not None:
            self.address = self.resolve()
        host, _, port = self.address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=r.config.timeout_s)
        channel = FrameChannel.to_worker(sock)
        self.generation += 1
        store = None
        try:
            local = sock.getsockname()[0]
            store = LinkStore(local)  # on the address the worker reaches this side by, and no other
            channel.send(Hello(r.token, PROTOCOL, r.shape, local, store.port, self.generation, store.secret))
            welcome = channel.recv()
            if not isinstance(welcome, Welcome) or welcome.error:
                raise ConnectionRefusedError(getattr(welcome, "error", "") or f"unexpected {welcome!r}")
            pair = KVPair(store.store, self.generation, KVPair.DECODE, local, r.config.timeout_s, r.device)
            if welcome.tokens_s > 0:
                self.tokens_s = welcome.tokens_s
        except BaseException:
            channel.close()
            if store is not None:
                store.close()
            raise
        sock.settimeout(None)
        with self.lock:
            self.channel, self.pair, self.store = channel, pair, store
            self.up = True
            self.last_heard = time.monotonic()
            self.backoff = 0.25
        threading.Thread(target=self._read_loop, args=(channel, pair, self.generation), name="prefill-link",
                         daemon=True).start()
        log.info("prefill worker %s is up", self.address)

    def fail(self, why: str, level: int = logging.WARNING, generation: int | None = None) -> None:
        """Down: every open job closes as lost; reconnects with backoff.
        generation: the connection that failed (a reader of an earlier one,
        waking late, must not take down the next)."""
        with self.lock:
            if not self.up or generation not in (None, self.generation):
                return
            self.up = False
            jobs, self.jobs = list(self.jobs.values()), {}
            channel, pair, store = self.channel, self.pair, self.store
            self.pair = self.store = None  # released now, not when the next connection replaces them
            self.retry_at = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, self.remote.config.retry_max_s)
        log.log(level, "prefill worker %s is down (%s); %d job(s) lost, retrying in %.1f s",
                self.address, why, len(jobs), self.retry_at - time.monotonic())
        channel.close()
        pair.close()
        store.close()
        for job in jobs:
            self.remote.closed(job, "lost", why=f"prefill worker {self.address}: {why}",
                               mid_transfer=job.groups > 0)

    def submit(self, job: TransferJob) -> bool:
        with self.lock:
            if not self.up:
                return False
            self.jobs[job.id] = job
            channel = self.channel
        try:
            channel.send(Job(job.id, job.tokens, job.have, job.salt))
        except ConnectionError as e:
            self.fail(f"cannot send a job: {e}")
        return True

    def abort(self, job: TransferJob) -> None:
        job.aborted_at = time.monotonic()
        try:
            self.channel.send(Abort(job.id))
        except ConnectionError as e:
            self.fail(f"cannot send an abort: {e}")

    def _read_loop(self, channel: FrameChannel, pair: KVPair, generation: int) -> None:
        torch.set_num_threads(1)  # copies only: no OpenMP team beside the engine's
        try:
            while True:
                msg = channel.recv()
                self.last_heard = time.monotonic()
                if isinstance(msg, Group):
                    self._receive(msg, pair, self.remote.pool)
                elif isinstance(msg, (Done, Failed, Aborted)):
                    with self.lock:
                        job = self.jobs.pop(msg.id, None) if self.up else None
                    if job is None:
                        continue
                    if isinstance(msg, Done):
                        if msg.computed >= 64 and msg.compute_s > 0:
                            self.tokens_s += EWMA * (msg.computed / msg.compute_s - self.tokens_s)
                        logits = torch.frombuffer(bytearray(msg.logits), dtype=torch.float32).to(self.remote.device)
                        self.remote.closed(job, "done", logits=logits, computed=msg.computed)
                    elif isinstance(msg, Failed):
                        self.remote.closed(job, "lost", why=msg.message, mid_transfer=job.groups > 0)
                    else:
                        self.remote.closed(job, "aborted")
                elif isinstance(msg, Heartbeat):
                    self.remote.worker_blocks_held[self.address] = msg.blocks_held
        except Exception as e:  # a closed socket, a broken pair: the link is down
            self.fail(str(e) or type(e).__name__, generation=generation)

    def _receive(self, msg: Group, pair: KVPair, pool: KVPool) -> None:
        """The announced K/V, then into the job's blocks if it is still open
        (an aborted job's arrive anyway, and are dropped)."""
        layers = msg.layer_hi - msg.layer_lo
        buf = torch.empty((2, layers, msg.count, pool.k.shape[2], pool.k.shape[3]), dtype=torch.float32,
                          device=pool.device)  # (the wire's dtype; the pool's may be narrower)
        started = time.perf_counter()
        pair.recv(buf, msg.tag, self.remote.config.timeout_s)
        seconds = time.perf_counter() - started
        with self.lock:
            job = self.jobs.get(msg.id) if self.up else None
            if job is None or job.aborted_at is not None:
                return
            bs = pool.block_size
            positions = torch.arange(msg.start, msg.start + msg.count)
            slots = (job.table[positions // bs] * bs + positions % bs).to(pool.device)
            pool.k[msg.layer_lo:msg.layer_hi].index_copy_(1, slots, buf[0].to(pool.k.dtype))
            pool.v[msg.layer_lo:msg.layer_hi].index_copy_(1, slots, buf[1].to(pool.v.dtype))
            job.groups += 1
            job.bytes += buf.numel() * buf.element_size()
            job.recv_s += seconds


class RemotePrefill:
    """Every worker link, the jobs' events for the engine, and the estimates
    behind each decision. The engine thread calls `choose`, `start`, `abort`
    and `poll`; link threads and the supervisor do the rest."""

    def __init__(self, addresses: list[str], shape: ModelShape, token: str, config: DisaggConfig,
                 kv_bytes_per_token: int, resolvers: list[Callable[[], str] | None] | None = None,
                 device: str = "cpu", shared: list[bool] | None = None, local_yields: bool = False):
        """device: the target's (its K/V pool's): gloo between CPU pools, NCCL between GPU ones.
        shared: per address, a worker on the engine's cores; local_yields: the engine's own
        prefill makes way for keystrokes (`engine.interactive_first`), so such workers are not used."""
        self.local_yields = local_yields
        self.shape, self.token, self.config = shape, token, config
        self.device = torch.device(device)
        self.kv_bytes_per_token = kv_bytes_per_token
        resolvers = resolvers or [None] * len(addresses)
        shared = shared or [False] * len(addresses)
        self.links = [WorkerLink(a, self, r, s) for a, r, s in zip(addresses, resolvers, shared)]
        self.events: queue.SimpleQueue[Closed] = queue.SimpleQueue()
        self.wake: Callable[[], None] = lambda: None  # the engine's loop, told there is something to poll
        self.pool: KVPool | None = None
        self.job_link: dict[int, WorkerLink] = {}
        self.next_job = 1
        self.local_tokens_s = PRIOR_TOKENS_S  # the decode engine's prefill rate (measured at its start)
        self.link_bytes_s = PRIOR_LINK_BYTES_S
        self.worker_blocks_held: dict[str, int] = {}
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    def register(self, pool: KVPool) -> None:
        """The target's K/V pool, which jobs write into."""
        self.pool = pool

    def start(self, wait_s: float = 0.0) -> None:
        """Connect (up to `wait_s` for the first links to come up) and watch the links."""
        deadline = time.monotonic() + wait_s
        for link in self.links:
            while True:
                try:
                    link.connect()
                    break
                except Exception as e:
                    if time.monotonic() >= deadline:
                        link.retry_at = time.monotonic() + link.backoff
                        log.warning("prefill worker %s: cannot connect (%s); retrying", link.address, e)
                        break
                    time.sleep(0.2)
        self._supervisor = threading.Thread(target=self._supervise, name="prefill-supervisor", daemon=True)
        self._supervisor.start()

    def close(self) -> None:
        self._stop.set()
        for link in self.links:
            link.fail("shutting down", logging.INFO)

    @property
    def workers_up(self) -> int:
        return sum(link.up for link in self.links)

    # -- the engine's calls ---------------------------------------------------

    def usable(self, link: WorkerLink) -> bool:
        return link.up and not (self.local_yields and link.shares_cores)

    def choose(self, uncached: int, chunk: int, decode_pass_s: float, local_queued_tokens: int) -> Decision:
        up = [link for link in self.links if self.usable(link)]
        least = min(up, key=lambda link: link.queued_tokens, default=None)
        sharing = sum(link.up for link in self.links) - len(up)
        pool = PoolState(len(up), least.queued_tokens if least else 0, sharing)
        est = Estimates(self.local_tokens_s, least.tokens_s if least else PRIOR_TOKENS_S, self.link_bytes_s,
                        self.kv_bytes_per_token, decode_pass_s, local_queued_tokens)
        c = self.config
        return decide(uncached, c.threshold_tokens, c.max_queue_tokens, c.remote_slack, chunk, pool, est)

    def start_job(self, tokens: list[int], have: int, table: list[int], salt: str) -> int | None:
        """Send a job to the least loaded worker; its id, or None when no worker is up."""
        for link in sorted(filter(self.usable, self.links), key=lambda lk: lk.queued_tokens):
            job = TransferJob(self.next_job, tokens, have, table, salt)
            self.next_job += 1
            self.job_link[job.id] = link
            if link.submit(job):
                return job.id
            del self.job_link[job.id]
        return None

    def abort(self, job_id: int) -> None:
        """Idempotent; the job still closes (as aborted, or lost) through poll()."""
        link = self.job_link.get(job_id)
        job = link.jobs.get(job_id) if link is not None else None
        if job is not None and job.aborted_at is None:
            link.abort(job)

    def poll(self) -> list[Closed]:
        out = []
        while True:
            try:
                closed = self.events.get_nowait()
            except queue.Empty:
                return out
            self.job_link.pop(closed.job, None)
            out.append(closed)

    def observe_local(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:
            self.local_tokens_s += EWMA * (tokens / seconds - self.local_tokens_s)

    # -- link threads ---------------------------------------------------------

    def closed(self, job: TransferJob, outcome: str, **fields) -> None:
        if outcome == "done":
            if job.recv_s > 0 and job.bytes > 0:
                self.link_bytes_s += EWMA * (job.bytes / job.recv_s - self.link_bytes_s)
        self.events.put(Closed(job.id, outcome, bytes=job.bytes, transfer_s=job.recv_s, **fields))
        self.wake()

    def _supervise(self) -> None:
        timeout = self.config.timeout_s
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for link in self.links:
                if link.up:
                    stuck = [j for j in list(link.jobs.values())
                             if j.aborted_at is not None and now - j.aborted_at > timeout]
                    if now - link.last_heard > timeout:
                        link.fail(f"silent for {now - link.last_heard:.1f} s")
                    elif stuck:
                        link.fail(f"no answer to an abort within {timeout} s")
                elif now >= link.retry_at:
                    try:
                        link.connect()
                    except Exception as e:
                        link.retry_at = time.monotonic() + link.backoff
                        link.backoff = min(link.backoff * 2, self.config.retry_max_s)
                        log.warning("prefill worker %s: cannot connect (%s); retrying in %.1f s",
                                    link.address, e, link.retry_at - time.monotonic())
