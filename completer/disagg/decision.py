"""Local or remote prefill, per request (Dynamo's conditional disaggregation).

A prompt leaves the decode engine only when its *uncached* part (what the
decode side's prefix cache does not hold) is long, a worker is up, the
workers' queue is short enough, and the estimated queue + prefill + transfer
time is within `remote_slack` of the local estimate. Local prefill runs in
chunks between the decode passes of every other running sequence, so its
estimate counts those passes; remote prefill leaves them alone, which is
worth some extra time (the slack).

With the machine in view: when the engine puts keystrokes before bulk work
(`engine.interactive_first`), a long prompt prefilled here stops between
layers for every keystroke, while a worker on the engine's own cores takes
them away from its keystrokes with no such yield (the operating system
shares the cores, not our scheduler). Such a worker (a local one without
CPUs of its own: `disagg.engine_cpus` and `disagg.worker_cpus` unset or
overlapping) is then not used: `shared_cores`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Reason = Literal["short", "no_worker", "shared_cores", "queue_full", "local_faster", "long"]


class Estimates(NamedTuple):
    local_tokens_s: float  # the decode engine's prefill rate
    remote_tokens_s: float  # a worker's prefill rate
    link_bytes_s: float  # K/V transfer rate
    kv_bytes_per_token: int
    decode_pass_s: float  # one decode pass of the running batch (0 when none runs)
    local_queued_tokens: int  # prompt tokens the decode engine has yet to prefill for others


class PoolState(NamedTuple):
    workers_up: int  # that may be used (with cores of their own, where that matters)
    least_queued_tokens: int  # prompt tokens queued at the least loaded of them
    sharing_cores: int = 0  # workers up but not used: they would take the engine's cores


class Decision(NamedTuple):
    remote: bool
    reason: Reason
    local_s: float = 0.0
    remote_s: float = 0.0


def shares_cores(engine_cpus: list[int], worker_cpus: list[int]) -> bool:
    """Whether a local worker computes on the engine's CPUs (either unpinned, or pinned to a common one)."""
    return not engine_cpus or not worker_cpus or bool(set(engine_cpus) & set(worker_cpus))


def local_prefill_s(uncached: int, chunk: int, est: Estimates) -> float:
    """Chunks of `chunk` tokens, each followed by a decode pass of the others."""
    chunks = -(-uncached // chunk)
    return (est.local_queued_tokens + uncached) / est.local_tokens_s + chunks * est.decode_pass_s


def remote_prefill_s(uncached: int, pool: PoolState, est: Estimates) -> float:
    transfer = uncached * est.kv_bytes_per_token / est.link_bytes_s
    return (pool.least_queued_tokens + uncached) / est.remote_tokens_s + transfer


def decide(uncached: int, threshold: int, max_queue_tokens: int, slack: float, chunk: int,
           pool: PoolState, est: Estimates) -> Decision:
    if uncached <= threshold:
        return Decision(False, "short")
    if pool.workers_up == 0:
        return Decision(False, "shared_cores" if pool.sharing_cores else "no_worker")
    if pool.least_queued_tokens + uncached > max_queue_tokens:
        return Decision(False, "queue_full")
    local, remote = local_prefill_s(uncached, chunk, est), remote_prefill_s(uncached, pool, est)
    if remote > slack * local:
        return Decision(False, "local_faster", local, remote)
    return Decision(True, "long", local, remote)
