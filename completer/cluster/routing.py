"""Where a request goes: the decision itself, free of Ray, so it can be
tested and timed alone (`router.py` wraps it in Serve's RequestRouter).

A keystroke's K/V is warm on the replica that served the keystroke before it
in the same document, so a route key (session and document) keeps its
replica (`hit`). A key the table does not know (a new document, another front
door's session, a router that restarted) goes where its prompt's head was
served recently (`prefix`, from the replicas' routing stats), else to the
least loaded replica (`new`). Load wins over warmth only past a margin: when
the home replica holds `move_margin` more requests in flight than the least
loaded one, the key moves there and stays (`moved`), as llm-d's session
scorer gives way to its load scorer and Dynamo's KV router weighs overlap
against load. Ties go to the replica that is home to fewer keys, so new
sessions spread while every replica is idle.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Literal, NamedTuple

import msgspec

from completer.engine.request import Request

PREFIX_HASH_TOKENS = 64  # the prompt head that names "the same file" across sessions
Outcome = Literal["hit", "prefix", "new", "moved"]
OUTCOMES: tuple[Outcome, ...] = ("hit", "prefix", "new", "moved")


class Hop(msgspec.Struct, frozen=True):
    """One request on its way from a front door to a replica."""

    request: Request
    route_key: str  # session and document: the key the router keeps affine ("" = no affinity)
    prefix_hash: int  # the prompt's head and cache salt (see prefix_hash)
    supersede: str | None = None  # as Engine.submit's
    ends_others: bool = True
    age_s: float = 0.0  # time since the request's arrival when sent (each process has its own clock)


def prefix_hash(tokens: list[int], salt: str) -> int:
    """64 bits naming the first PREFIX_HASH_TOKENS tokens under a cache salt."""
    h = hashlib.blake2b(salt.encode(), digest_size=8)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens[:PREFIX_HASH_TOKENS]))
    return int.from_bytes(h.digest(), "little", signed=True)


class Decision(NamedTuple):
    replica: str
    outcome: Outcome


class AffinityTable:
    """route key -> home replica, least recently used keys forgotten past `max_keys`."""

    def __init__(self, move_margin: int, max_keys: int = 200_000):
        self.move_margin = move_margin
        self.max_keys = max_keys
        self.home: OrderedDict[str, str] = OrderedDict()
        self.homed: dict[str, int] = {}  # replica -> keys whose home it is

    def choose(self, key: str, head: int, loads: dict[str, int],
               holders: dict[int, tuple[str, ...]]) -> Decision:
        """`loads`: requests in flight per live replica (not empty); `holders`:
        prefix hash -> replicas that served it recently."""
        least = min(loads, key=lambda r: (loads[r], self.homed.get(r, 0), r))
        within = loads[least] + self.move_margin  # the most a replica may hold and still be chosen for warmth
        home = self.home.get(key) if key else None
        if home in loads:
            decision = Decision(home, "hit") if loads[home] <= within else Decision(least, "moved")
        else:
            warm = [r for r in holders.get(head, ()) if r in loads and loads[r] <= within]
            if warm:
                decision = Decision(min(warm, key=lambda r: (loads[r], r)), "prefix")
            else:
                decision = Decision(least, "new" if home is None else "moved")
        if key:
            self._set(key, decision.replica)
        return decision

    def _set(self, key: str, replica: str) -> None:
        old = self.home.pop(key, None)
        if old is not None:
            self._unhome(old)
        self.home[key] = replica
        self.homed[replica] = self.homed.get(replica, 0) + 1
        while len(self.home) > self.max_keys:
            self._unhome(self.home.popitem(last=False)[1])

    def _unhome(self, replica: str) -> None:
        if replica in self.homed:  # a forgotten replica's count is gone already
            self.homed[replica] -= 1

    def forget_replica(self, replica: str) -> None:
        """A dead replica's keys go elsewhere on their next request (as `moved`)."""
        self.homed.pop(replica, None)


def prefix_holders(prefixes_by_replica: dict[str, list[int]]) -> dict[int, tuple[str, ...]]:
    """The replicas' routing stats turned around: prefix hash -> replicas."""
    index: dict[int, list[str]] = {}
    for replica, prefixes in prefixes_by_replica.items():
        for head in prefixes:
            index.setdefault(head, []).append(replica)
    return {head: tuple(rs) for head, rs in index.items()}


def ranks(first: str, candidates: list[str]) -> list[list[str]]:
    """What the router hands Serve: the chosen replica alone, then all the
    others (Serve takes the least loaded among them when the first is full)."""
    others = [u for u in candidates if u != first]
    return [[first], others] if others else [[first]]


class RouterStats:
    """What this process's router did, read by the front door's /metrics
    (the router runs on Serve's routing thread; the front door on its loop)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.routed: dict[str, int] = {}  # replica -> requests it accepted
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.replicas: dict[str, dict] = {}  # replica -> its latest routing stats
        self.decisions = 0
        self.decision_s = 0.0  # time spent deciding (choose_replicas), summed
        self.keys = 0  # route keys in the affinity table

    def snapshot(self) -> dict:
        with self.lock:
            return {"routed": dict(self.routed), "outcomes": dict(self.outcomes),
                    "replicas": {r: dict(s) for r, s in self.replicas.items()}, "decisions": self.decisions,
                    "decision_s": self.decision_s, "keys": self.keys, "stalled": HEALTH.snapshot()}


class ReplicaHealth:
    """Replicas that stopped answering, as the cluster engine (client.py) saw
    them, for the router (on Serve's routing thread) to pass over; and where
    the router sent each request, for the cluster engine to know whose
    silence it waits on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stalled: set[str] = set()
        self.placed: dict[str, str] = {}  # request id (as sent to the replicas) -> replica

    def place(self, request_id: str, replica: str) -> None:
        with self.lock:
            self.placed[request_id] = replica

    def placement(self, request_id: str) -> str | None:
        with self.lock:
            return self.placed.get(request_id)

    def unplace(self, request_id: str) -> None:
        with self.lock:
            self.placed.pop(request_id, None)

    def stall(self, replica: str) -> bool:
        """Mark it stalled; True when it was not already."""
        with self.lock:
            new = replica not in self.stalled
            self.stalled.add(replica)
            return new

    def answered(self, replica: str) -> bool:
        """It answered (or is gone): no longer stalled; True when it was."""
        with self.lock:
            if replica in self.stalled:
                self.stalled.discard(replica)
                return True
            return False

    def keep(self, replicas: set[str]) -> None:
        """Forget the replicas no longer in the deployment."""
        with self.lock:
            self.stalled &= replicas

    def usable(self, candidates: list[str]) -> list[str]:
        """The candidates not stalled; all of them when every one is (a hung
        replica is still better than none: its requests end at their deadlines)."""
        with self.lock:
            healthy = [r for r in candidates if r not in self.stalled]
        return healthy or list(candidates)

    def snapshot(self) -> list[str]:
        with self.lock:
            return sorted(self.stalled)


# One per process: Serve builds one router per deployment handle, in the process holding it.
ROUTER_STATS = RouterStats()
HEALTH = ReplicaHealth()
