"""`completer prefill-worker`: prefills prompts for decode engines and ships
their K/V.

One compute thread takes jobs in arrival order. For each: match the prompt
against the worker's own prefix cache, send the K/V it already holds that the
decode side lacks, then run the rest in `prefill_chunk` chunks (aligned, as
the decode engine's own would be, at the first token the decode side lacks,
so the numbers come out the same). Within a chunk, every `layer_group` layers
the new K/V are gathered and sent while the next layers run; the first
token's logits follow the last group in `Done`. An `Abort` is seen between
layers; every send already announced still completes, then `Aborted` says
nothing more comes. A job's blocks are the worker's alone and are released
when the job ends (they stay in its prefix cache).

Past ~300 lines: the worker's link, its job queue and the chunked prefill
that streams K/V share one compute thread's state.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections import deque

import torch

from completer.disagg.messages import (PROTOCOL, Abort, Aborted, Done, Failed, Group, Heartbeat, Hello, Job,
                                       ModelShape, Welcome)
from completer.disagg.transport import ChannelClosed, FrameChannel, KVPair
from completer.engine.block_manager import BlockManager, OutOfBlocks
from completer.engine.calibration import prefill_rate
from completer.engine.kv_cache_manager import advance, restart
from completer.engine.model_runner import ModelRunner
from completer.engine.paged_kv import KVPool, pool_blocks
from completer.engine.sequence import CacheState

log = logging.getLogger(__name__)
MAX_SENDS_IN_FLIGHT = 8  # announced groups whose send has not completed (bounds the send buffers)


class JobAborted(Exception):
    pass


class LinkLost(Exception):
    """The decode engine's end of the link went away (its control channel or
    K/V pair failed): expected whenever a decode engine dies, stalls or drops
    the link, and no fault of the job's."""


def model_shape(name: str, cfg, precision: str, block_size: int, prefill_chunk: int) -> ModelShape:
    return ModelShape(name, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, precision,
                      prefill_chunk)


class Link:
    """One decode engine's connection: its control channel and K/V pair."""

    def __init__(self, channel: FrameChannel, pair: KVPair, name: str):
        self.channel, self.pair, self.name = channel, pair, name
        self.open = True
        self.next_tag = 1

    def tag(self) -> int:
        self.next_tag = self.next_tag % (2**31 - 1) + 1
        return self.next_tag


class WorkerJob:
    def __init__(self, link: Link, job: Job):
        self.link, self.job = link, job
        self.aborted = False


class PrefillWorker:
    def __init__(self, model, name: str, precision: str, block_size: int, prefill_chunk: int, kv_mb: float,
                 layer_group: int, token: str, timeout_s: float, prefix_cache: bool = True, threads: int = 0):
        cfg = model.config
        blocks = pool_blocks(cfg, kv_mb, block_size)
        self.pool = KVPool(cfg, blocks, block_size, device=next(model.parameters()).device)
        self.blocks = BlockManager(blocks, block_size, prefix_cache)
        self.runner = ModelRunner(model, self.pool, "torch")
        self.vocab = cfg.vocab_size
        self.shape = model_shape(name, cfg, precision, block_size, prefill_chunk)
        self.chunk = prefill_chunk
        self.layer_group = layer_group
        self.token = token
        self.timeout_s = timeout_s
        self.threads = threads
        self.queue: deque[WorkerJob] = deque()
        self.by_id: dict[tuple[int, int], WorkerJob] = {}  # (link, job id) -> job
        self.cond = threading.Condition()
        self.queued_tokens = 0
        self.tokens_s = 0.0
        self.calibrated = threading.Event()

    # -- connections ----------------------------------------------------------

    def serve(self, host: str, port: int, ready=print) -> None:
        """Accept decode engines forever; `ready(line)` once listening."""
        listener = socket.create_server((host, port), reuse_port=False)
        bound = listener.getsockname()
        threading.Thread(target=self._compute_loop, name="prefill-compute", daemon=True).start()
        self.calibrated.wait()
        ready(f"prefill worker listening on {bound[0]}:{bound[1]}")
        while True:
            conn, peer = listener.accept()
            threading.Thread(target=self._serve_link, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="prefill-link", daemon=True).start()

    def _serve_link(self, conn: socket.socket, name: str) -> None:
        channel = FrameChannel.to_decode(conn)
        conn.settimeout(self.timeout_s * 4)  # a peer that never says hello
        try:
            hello = channel.recv()
        except (ChannelClosed, TimeoutError):
            channel.close()
            return
        conn.settimeout(None)
        if not isinstance(hello, Hello):
            problem = f"expected hello, got {type(hello).__name__}"
        elif not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            problem = "wrong token"
        elif hello.protocol != PROTOCOL:
            problem = f"protocol {hello.protocol}, this worker speaks {PROTOCOL}"
        elif hello.shape != self.shape:
            problem = f"this worker runs {self.shape}, the decode engine {hello.shape}"
        else:
            problem = ""
        try:
            channel.send(Welcome(problem, self.tokens_s))
            if problem:
                log.warning("prefill worker: refused %s: %s", name, problem)
                channel.close()
                return
            pair = KVPair.join(hello.store_host, hello.store_port, hello.store_secret, hello.generation,
                               conn.getsockname()[0],
                               self.timeout_s, self.pool.device)
        except Exception as e:
            log.warning("prefill worker: %s: cannot set up the K/V pair: %s", name, e)
            channel.close()
            return
        link = Link(channel, pair, name)
        log.info("prefill worker: decode engine %s connected", name)
        threading.Thread(target=self._heartbeats, args=(link,), name="prefill-heartbeat", daemon=True).start()
        try:
            while True:
                msg = channel.recv()
                if isinstance(msg, Job):
                    with self.cond:
                        job = WorkerJob(link, msg)
                        self.queue.append(job)
                        self.by_id[(id(link), msg.id)] = job
                        self.queued_tokens += len(msg.tokens) - msg.have
                        self.cond.notify()
                elif isinstance(msg, Abort):
                    self._abort(link, msg.id)
        except ChannelClosed as e:
            log.info("prefill worker: decode engine %s gone (%s)", name, e)
        finally:
            link.open = False
            with self.cond:  # its jobs end; a running one stops at its next layer
                for (owner, job_id), job in list(self.by_id.items()):
                    if owner == id(link):
                        job.aborted = True
            channel.close()

    def _abort(self, link: Link, job_id: int) -> None:
        with self.cond:
            job = self.by_id.get((id(link), job_id))
            if job is None:
                return  # already over: its terminal frame is on its way
            job.aborted = True
            if job in self.queue:  # never started: answer now
                self.queue.remove(job)
                self._forget(job)
                self._send(job, Aborted(job_id))

    def _forget(self, job: WorkerJob) -> None:
        del self.by_id[(id(job.link), job.job.id)]
        self.queued_tokens -= len(job.job.tokens) - job.job.have

    def _send(self, job: WorkerJob, message) -> None:
        try:
            job.link.channel.send(message)
        except ChannelClosed:
            job.link.open = False

    def _heartbeats(self, link: Link) -> None:
        while link.open:
            try:
                link.channel.send(Heartbeat(self.queued_tokens, self.blocks_held))
            except ChannelClosed:
                link.open = False
            time.sleep(self.timeout_s / 4)
        link.pair.close()

    @property
    def blocks_held(self) -> int:
        return self.blocks.num_blocks - 1 - self.blocks.num_free

    # -- compute ------------------------------------------------------------

    def _compute_loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():  # on this thread: the one whose OpenMP team runs the jobs
            self.tokens_s = prefill_rate(self.runner, self.blocks, min(self.chunk, 512)) or 0.0
        self.calibrated.set()
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                job = self.queue.popleft()
            self._run(job)

    def _run(self, job: WorkerJob) -> None:
        msg, sends = job.job, deque()
        state = CacheState()
        try:
            try:
                started = time.perf_counter()
                logits, computed = self._prefill(job, state, sends)
                while sends:
                    sends.popleft().wait()
                end = Done(msg.id, logits.float().cpu().numpy().tobytes(), computed,
                           time.perf_counter() - started)
            except JobAborted:
                end = Aborted(msg.id)
            except OutOfBlocks as e:
                end = Failed(msg.id, f"prefill worker: {e}")
            except Exception as e:  # this job fails; the worker goes on
                if isinstance(e, LinkLost) or not job.link.open:  # its decode engine is gone: one line
                    log.warning("prefill worker: job %s of %s ended: the link is gone (%s)", msg.id,
                                job.link.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
                else:
                    log.exception("prefill worker: job %s failed", msg.id)
                end = Failed(msg.id, f"prefill worker: {type(e).__name__}: {e}")
            for work in sends:  # announced: they complete before the terminal frame
                try:
                    work.wait()
                except Exception:
                    pass
        finally:
            self.blocks.release(state.table)
            with self.cond:
                self._forget(job)
        self._send(job, end)

    def _prefill(self, job: WorkerJob, state: CacheState, sends: deque) -> tuple[torch.Tensor, int]:
        msg = job.job
        if not job.link.open:  # queued behind others while its decode engine went away
            raise JobAborted
        tokens, have = msg.tokens, msg.have
        state.table, state.chain = self.blocks.match_prefix(tokens, msg.salt)
        restart(state, len(state.table) * self.pool.block_size)
        self.blocks.grow(state.table, len(tokens))
        layers = self.pool.k.shape[0]
        if state.computed > have:  # held here already: only sent
            self._ship(job, state, have, state.computed, 0, layers, sends)
        computed = 0
        logits = None
        with torch.inference_mode():
            while state.computed < len(tokens):
                a = state.computed
                b = min(len(tokens), a + self.chunk, have if a < have else len(tokens))
                lo = max(a, have)  # this chunk's tokens the decode side lacks

                def written(layer: int, a=a, b=b, lo=lo) -> None:
                    if job.aborted or not job.link.open:
                        raise JobAborted
                    if lo < b and ((layer + 1) % self.layer_group == 0 or layer + 1 == layers):
                        first = (layer // self.layer_group) * self.layer_group
                        self._ship(job, state, lo, b, first, layer + 1, sends)

                logits = self.runner.execute([state], [tokens[a:b]], last_only=True, layer_written=written)[0]
                advance([state], [b - a])
                computed += b - a
                self.blocks.publish(state.table, state.chain, tokens, state.computed, msg.salt)
        return logits, computed

    def _ship(self, job: WorkerJob, state: CacheState, start: int, end: int, layer_lo: int, layer_hi: int,
              sends: deque) -> None:
        """Announce and start the send of K/V of tokens [start, end) in layers [layer_lo, layer_hi)."""
        bs = self.pool.block_size
        positions = torch.arange(start, end)
        table = torch.tensor(state.table, dtype=torch.long)
        slots = (table[positions // bs] * bs + positions % bs).to(self.pool.device)
        kv = torch.stack((self.pool.k[layer_lo:layer_hi].index_select(1, slots),
                          self.pool.v[layer_lo:layer_hi].index_select(1, slots)))
        while len(sends) >= MAX_SENDS_IN_FLIGHT:
            sends.popleft().wait()
        tag = job.link.tag()
        try:
            job.link.channel.send(Group(job.job.id, tag, start, end - start, layer_lo, layer_hi))
            work = job.link.pair.send(kv, tag)
        except (ChannelClosed, RuntimeError) as e:  # (RuntimeError: a pair already aborted)
            raise LinkLost(e) from None
        sends.append(_Send(work, kv))


class _Send:
    """A started send and the buffer it reads (kept alive until it completes)."""

    def __init__(self, work, buffer: torch.Tensor):
        self.work, self.buffer = work, buffer

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as e:  # gloo's: the peer closed the pair, or stalled past its timeout
            raise LinkLost(e) from None


def run_worker(config, token: str, host: str, port: int, cpus: list[int], ready=print) -> None:
    """Load the target of `config` and serve forever (`completer prefill-worker`)."""
    import os

    from completer.engine.engine import run_in_passing_thread
    from completer.loading import load_models

    if cpus:
        os.sched_setaffinity(0, cpus)
    m, d = config.model, config.disagg
    target, _ = run_in_passing_thread(load_models, m.target, "", m.precision, m.template or None,
                                      m.order or None, m.device, m.fuse_projections,
                                      m.int4_dense_rows, m.kernel_cache_entries)
    worker = PrefillWorker(target.model, target.name, target.precision, config.engine.block_size,
                           config.engine.prefill_chunk, d.worker_kv_mb, d.layer_group, token, d.timeout_s,
                           config.engine.prefix_cache, d.worker_threads or len(cpus))
    worker.serve(host, port, ready)
