"""The control channel between the decode engine and a prefill worker: typed
msgpack frames. K/V bytes never travel here; a `Group` frame announces each
torch.distributed send that carries them, so the receiver posts a receive
only for data that is already on its way (no receive is left dangling when a
job is aborted)."""

from __future__ import annotations

import msgspec

PROTOCOL = 2  # 2: the store's secret in Hello


class ModelShape(msgspec.Struct, frozen=True):
    """What both sides must agree on for K/V to be interchangeable."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    precision: str
    prefill_chunk: int


# decode engine -> worker

class Hello(msgspec.Struct, tag="hello", frozen=True):
    token: str
    protocol: int
    shape: ModelShape
    store_host: str  # the decode side's store (link_store), where the K/V pair group meets
    store_port: int
    generation: int  # a fresh group per connection: a failed one is never reused
    store_secret: bytes  # this connection's key to that store (fresh each time)


class Job(msgspec.Struct, tag="job", frozen=True):
    id: int
    tokens: list[int]
    have: int  # tokens whose K/V the decode side holds (block-aligned): never sent
    salt: str = ""


class Abort(msgspec.Struct, tag="abort", frozen=True):
    id: int


# worker -> decode engine

class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    error: str = ""  # not empty: refused (wrong token, another model), and why
    tokens_s: float = 0.0  # its prefill rate, measured at its start


class Group(msgspec.Struct, tag="group", frozen=True):
    """One send follows: K and V of tokens [start, start + count) in layers
    [layer_lo, layer_hi), as float32 [2, layers, count, kv_heads, head_dim]."""

    id: int
    tag: int
    start: int
    count: int
    layer_lo: int
    layer_hi: int


class Done(msgspec.Struct, tag="done", frozen=True):
    """After the job's last group: the logits of the prompt's last token."""

    id: int
    logits: bytes  # float32, the full vocabulary
    computed: int  # tokens the worker ran through the model (the rest came from its prefix cache)
    compute_s: float


class Failed(msgspec.Struct, tag="failed", frozen=True):
    id: int
    message: str


class Aborted(msgspec.Struct, tag="aborted", frozen=True):
    """The answer to `Abort`: nothing more of this job will be sent."""

    id: int


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    queued_tokens: int  # prompt tokens of the jobs it has not finished
    blocks_held: int  # KV blocks its jobs reference now (0 when idle)


ToWorker = Hello | Job | Abort
ToDecode = Welcome | Group | Done | Failed | Aborted | Heartbeat
# Every job ends with exactly one of these; after it, nothing of the job is sent.
TERMINAL = (Done, Failed, Aborted)
