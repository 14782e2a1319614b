"""`[disagg]`: prefill workers and when a prompt goes to one."""

from __future__ import annotations

import math

import msgspec

from completer.config.problem import ConfigProblem


class DisaggConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = False  # prefill long uncached prompts on workers
    workers: int = 1  # local workers `completer serve` starts (0: only remote_workers)
    remote_workers: list[str] = []  # "host:port" of `completer prefill-worker`s started elsewhere
    threshold_tokens: int = 1024  # uncached prompt tokens above which a prompt may go remote
    max_queue_tokens: int = 32768  # a worker with this many prompt tokens queued takes no more
    remote_slack: float = 1.5  # remote is chosen while its estimate is within this factor of local's
    layer_group: int = 6  # layers whose K/V are sent together (transfer overlaps the next layers)
    engine_cpus: list[int] = []  # CPUs the serving process runs on ([] = any)
    worker_cpus: list[list[int]] = []  # CPUs of each local worker ([] = any)
    # A local worker on the engine's CPUs (either unpinned, or pinned to a common one) is not sent
    # prompts while the engine makes way for keystrokes itself (engine.interactive_first): the OS
    # shares the cores without that rule (decision.py, `shared_cores`). true: send them anyway.
    use_shared_cores: bool = False
    worker_threads: int = 0  # torch threads of a local worker (0 = as many as its CPUs)
    worker_kv_mb: float = 512.0  # a worker's own KV pool (its prefix cache)
    timeout_s: float = 3.0  # a worker silent this long (no heartbeat, a send that does not come) is down
    retry_max_s: float = 10.0  # reconnecting to a down worker backs off up to this


def disagg_problems(d: DisaggConfig) -> list[ConfigProblem]:
    found = []
    for key in ("workers", "threshold_tokens", "worker_threads"):
        if getattr(d, key) < 0:
            found.append(ConfigProblem((f"disagg.{key}",), f"disagg.{key} = {getattr(d, key)}: must be at least 0"))
    for key in ("max_queue_tokens", "layer_group"):
        if getattr(d, key) < 1:
            found.append(ConfigProblem((f"disagg.{key}",), f"disagg.{key} = {getattr(d, key)}: must be at least 1"))
    for key in ("remote_slack", "worker_kv_mb", "timeout_s", "retry_max_s"):
        value = getattr(d, key)
        if not (value > 0 and math.isfinite(value)):
            found.append(ConfigProblem((f"disagg.{key}",), f"disagg.{key} = {value}: must be a positive number"))
    for address in d.remote_workers:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            found.append(ConfigProblem(("disagg.remote_workers",),
                                       f"disagg.remote_workers: {address!r} is not host:port"))
    if len(d.worker_cpus) > d.workers:
        found.append(ConfigProblem(("disagg.worker_cpus", "disagg.workers"),
                                   f"disagg.worker_cpus lists {len(d.worker_cpus)} workers but "
                                   f"disagg.workers = {d.workers}"))
    if d.enabled and d.workers == 0 and not d.remote_workers:
        found.append(ConfigProblem(("disagg.enabled", "disagg.workers", "disagg.remote_workers"),
                                   "disagg.enabled = true with no worker: set disagg.workers >= 1 "
                                   "or list disagg.remote_workers"))
    return found
