"""How `completer serve` gets from a bound port to an engine that answers:
the models loaded, the local prefill workers started and linked
(`[disagg]`), the fused CPU layer compiled where it will run, the engine
built and calibrated, or under `--cluster` the front door's tokenizer and
template with the engines as Ray Serve replicas. All of it off the event
loop, which answers /healthz (and refuses handshakes, saying how far it is)
meanwhile; each stage goes to the start's progress display
(completer/startup.py). server/app.py attaches what it hands back to the
completion service, and stops the workers however the server ends."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

from completer.checkpoint import CheckpointError
from completer.config import Config
from completer.cpu_quant import CPU_PRECISIONS
from completer.engine.engine import Engine, run_in_passing_thread
from completer.loading import LoadedModel, load_faces, load_models
from completer.model_store import ModelFetchError
from completer.startup import StartupProgress
from completer_kernels import cpu_decode

if TYPE_CHECKING:
    from completer.cluster.front import LinkedEngine


class EngineStart:
    """One server's start: `run()` returns the engine; meanwhile and after,
    the models it loaded (`target`, `draft`), the cluster's engine under
    `--cluster`, and the prefill workers it started (`stop_workers`)."""

    def __init__(self, config: Config, token: str, progress: StartupProgress):
        self.config, self.token, self.progress = config, token, progress
        self.target: LoadedModel | None = None
        self.draft: LoadedModel | None = None
        self.cluster: LinkedEngine | None = None  # the engine, under `--cluster`
        self.local_workers: list = []  # disagg.local_workers.LocalWorker
        # Set when the server stops mid-start: a wait for another process's build of the fused layer ends.
        self.stopping = threading.Event()

    def load_models(self) -> None:
        """Load target and drafter (raises CheckpointError naming the problem)."""
        m = self.config.model
        self.target, self.draft = load_models(m.target, m.draft, m.precision, m.template or None,
                                              m.order or None, m.device, m.fuse_projections,
                                              m.int4_dense_rows, m.kernel_cache_entries)

    async def start_workers(self) -> list[str]:
        """Start the local prefill workers (disagg.workers); every worker's address."""
        from completer.disagg.local_workers import LocalWorker

        d = self.config.disagg
        cpus = [d.worker_cpus[i] if i < len(d.worker_cpus) else [] for i in range(d.workers)]
        self.local_workers = [LocalWorker(self.config, self.token, i, cpus[i]) for i in range(d.workers)]
        local = await asyncio.gather(*(asyncio.to_thread(w.start) for w in self.local_workers))
        return list(local) + list(d.remote_workers)

    def connect_workers(self, addresses: list[str]):
        """The decode side of disaggregation as the engine's KV connector, its links up (or retrying)."""
        from completer.disagg.decision import shares_cores
        from completer.disagg.connector import RemotePrefillConnector
        from completer.disagg.remote import RemotePrefill
        from completer.disagg.worker import model_shape

        cfg, e = self.target.model.config, self.config.engine
        shape = model_shape(self.target.name, cfg, self.target.precision, e.block_size, e.prefill_chunk)
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
        d = self.config.disagg
        resolvers = [w.resolve for w in self.local_workers] + [None] * len(d.remote_workers)
        on_cpu = str(self.target.device).startswith("cpu")  # (a GPU engine's workers share no cores with it)
        shared = [on_cpu and shares_cores(d.engine_cpus, d.worker_cpus[i] if i < len(d.worker_cpus) else [])
                  for i in range(len(self.local_workers))] + [False] * len(d.remote_workers)
        remote = RemotePrefill(addresses, shape, self.token, d, kv_bytes, resolvers, self.target.device,
                               shared, e.interactive_first and not d.use_shared_cores)
        remote.start(wait_s=self.config.disagg.timeout_s)
        return RemotePrefillConnector(remote)

    def stop_workers(self) -> None:
        for worker in self.local_workers:
            worker.stop()

    async def start_cluster(self) -> LinkedEngine:
        """`--cluster`: the front door's tokenizer and template here, the
        engines as Ray Serve replicas (started, or joined) through the link
        process (cluster/link.py); this process never imports Ray."""
        from completer.cluster.front import LinkedEngine

        m = self.config.model
        self.target, self.draft = await asyncio.to_thread(load_faces, m.target, m.draft, m.precision,
                                                          m.template or None, m.order or None, m.device)
        engine = LinkedEngine(self.config)
        c = self.config.cluster
        self.progress.enter("starting the engine replicas", f"Ray Serve app {c.app!r}")
        await engine.start()
        self.cluster = engine
        return engine

    async def run(self) -> Engine | LinkedEngine:
        """Load the models (and start the prefill workers), then build and
        start the engine: all of it off the event loop."""
        if self.config.cluster.enabled:
            return await self.start_cluster()
        workers = asyncio.ensure_future(self.start_workers()) if self.config.disagg.enabled else None
        self.progress.enter("loading the model", str(self.config.model.target))
        try:
            await asyncio.to_thread(run_in_passing_thread, self.load_models)
        except (CheckpointError, ModelFetchError):
            raise
        except Exception as e:  # torch, safetensors, memory: still one line naming the model
            first_line = (str(e).strip().splitlines() or [""])[0]
            raise CheckpointError(f"{self.config.model.target}: cannot load the model "
                                  f"({type(e).__name__}: {first_line})") from e
        connector = None
        if workers is not None:
            try:
                connector = await asyncio.to_thread(self.connect_workers, await workers)
            except RuntimeError as e:  # a local worker that could not start
                raise CheckpointError(str(e)) from None
        loop = asyncio.get_running_loop()
        if self.config.engine.fused_cpu and self.target.precision in CPU_PRECISIONS \
                and self.config.model.device == "cpu":
            # Here, not in the engine's build: a wait for another process's build of it ends with the server.
            self.progress.enter("starting the engine", "loading the fused CPU layer" if cpu_decode.built()
                                else "compiling the fused CPU layer (once on this machine)")
            with contextlib.suppress(cpu_decode.FusedUnavailable):  # said once, where the engine is built
                await asyncio.to_thread(cpu_decode.extension, self.stopping)
            if self.stopping.is_set():  # (a wait for another process's build, ended by SIGTERM)
                raise asyncio.CancelledError
        self.progress.enter("starting the engine", "calibrating speculation")

        def build() -> Engine:  # the pools' allocation and the calibration passes take seconds
            engine = Engine.build(self.target, self.draft, self.config.engine, self.config.spec, connector=connector)
            engine.start(loop)
            return engine

        return await asyncio.to_thread(run_in_passing_thread, build)
