"""One engine as a Ray Serve replica: the models loaded once, the engine's
thread started, and a streaming method the front doors call through the
deployment handle. Cancelling the call (a superseding keystroke, a closed
connection) cancels the request in the engine, which frees its K/V at once."""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict

import msgspec

from completer.cluster.ray_security import keep_replica_grpc_on_loopback
from completer.cluster.routing import Hop
from completer.config import Config
from completer.engine.engine import Engine, run_in_passing_thread
from completer.engine.request import EngineError, Failed, Finished
from completer.loading import load_models

PREFIXES_REPORTED = 512  # prompt heads a replica lists in its routing stats (most recent)


class EngineReplica:
    async def __init__(self, config_json: bytes):
        import torch

        keep_replica_grpc_on_loopback()
        config = msgspec.json.decode(config_json, type=Config)
        torch.set_num_threads(max(1, int(config.cluster.cpus_per_replica)))
        m = config.model
        target, draft = await asyncio.to_thread(
            run_in_passing_thread, load_models, m.target, m.draft, m.precision, m.template or None,
            m.order or None, m.device, m.fuse_projections, m.int4_dense_rows, m.kernel_cache_entries)
        self.engine = Engine.build(target, draft, config.engine, config.spec)
        self.engine.start()
        self.prefixes: OrderedDict[int, None] = OrderedDict()
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    async def generate(self, hop: Hop):
        """The request's events: its deltas, then its `Finished` (or `Failed`)."""
        request = msgspec.structs.replace(hop.request, arrival=time.perf_counter() - hop.age_s)
        self.prefixes.pop(hop.prefix_hash, None)
        self.prefixes[hop.prefix_hash] = None
        while len(self.prefixes) > PREFIXES_REPORTED:
            self.prefixes.popitem(last=False)
        stream = self.engine.submit(request, hop.supersede, hop.ends_others)
        try:
            async for delta in stream:
                yield delta
        except EngineError as e:
            yield Failed(request.id, e.code, str(e))
            return
        except asyncio.CancelledError:  # the caller cancelled: end it here too, its K/V freed
            self.engine.cancel(request.id)
            raise
        done: Finished = stream.result
        self.requests += 1
        self.prompt_tokens += done.timings.prompt_tokens
        self.cached_tokens += done.timings.cached_tokens
        yield done

    def record_routing_stats(self) -> dict:
        """Load and warm prompt heads, for the routers (and the front doors' /metrics)."""
        live = self.engine.live()
        return {"running": live.running, "waiting": live.waiting, "kv_cache_usage": round(live.kv_cache_usage, 4),
                "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "pid": os.getpid(), "prefixes": list(self.prefixes)}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine's thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()

