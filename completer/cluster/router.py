"""The affinity policy (`routing.py`) as a Ray Serve RequestRouter.

Serve builds one per deployment handle, in the process that holds it (the
front door), and runs it on its routing thread: nothing here blocks. Each
call returns two ranks: the chosen replica alone, then all the others.
Serve takes the first rank with room (a replica at its
`max_ongoing_requests` rejects) and picks within a rank by queue length.
FIFOMixin is not used: it would hand the replica chosen for one session to
another session's request. Serve pickles this module by value: the counters
and the replicas' health are reached through the `routing` module (pickled
by name), so the front door's link reads and writes the very objects this
router uses. A replica the cluster engine marked stalled (client.py) is left
out of the candidates while any other is up.
"""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from completer.cluster import routing
from completer.cluster.routing import AffinityTable, Hop, prefix_holders, ranks


class AffinityRouter(RequestRouter):
    def initialize_state(self, move_margin: int = 4, max_keys: int = 200_000) -> None:
        self.table = AffinityTable(move_margin, max_keys)
        self.holders: dict[int, tuple[str, ...]] = {}
        self.in_flight: dict[str, int] = {}  # replica -> requests this router sent, not yet completed
        self.outcome_of: dict[str, str] = {}  # internal request id -> its decision's outcome, until routed

    def load(self, replica: RunningReplica) -> int:
        """Requests in flight: Serve's queue-length cache (every front door's,
        refreshed on each reply), else what this router sent there."""
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return cached if cached is not None else self.in_flight.get(replica.replica_id.unique_id, 0)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        started = time.perf_counter()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        # A replica that stopped answering (client.py) gets no new request while another can take it.
        by_id = {uid: by_id[uid] for uid in routing.HEALTH.usable(list(by_id))}
        loads = {uid: self.load(r) for uid, r in by_id.items()}
        hop = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(hop, Hop):
            decision = self.table.choose(hop.route_key, hop.prefix_hash, loads, self.holders)
            first = decision.replica
            self.outcome_of[pending_request.metadata.internal_request_id] = decision.outcome
        else:
            first = min(loads, key=loads.get)
        if pending_request is not None:  # when every rank is full, wait before asking again
            pending_request.routing_context.should_backoff = True
        with routing.ROUTER_STATS.lock:
            routing.ROUTER_STATS.decisions += 1
            routing.ROUTER_STATS.decision_s += time.perf_counter() - started
            routing.ROUTER_STATS.keys = len(self.table.home)
        return [[by_id[u] for u in rank] for rank in ranks(first, list(by_id))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        uid = replica_id.unique_id
        self.in_flight[uid] = self.in_flight.get(uid, 0) + 1
        hop = pending_request.args[0] if pending_request.args else None
        if isinstance(hop, Hop):  # whose silence the cluster engine waits on, if it comes to that
            routing.HEALTH.place(hop.request.id, uid)
        outcome = self.outcome_of.pop(pending_request.metadata.internal_request_id, None)
        with routing.ROUTER_STATS.lock:
            routing.ROUTER_STATS.routed[uid] = routing.ROUTER_STATS.routed.get(uid, 0) + 1
            if outcome is not None:
                routing.ROUTER_STATS.outcomes[outcome] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        uid = replica_id.unique_id
        if self.in_flight.get(uid, 0) > 0:
            self.in_flight[uid] -= 1
        self.outcome_of.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        stats = {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in replicas}
        self.holders = prefix_holders({uid: s.get("prefixes", []) for uid, s in stats.items()})
        for uid in set(self.in_flight) - set(stats):
            del self.in_flight[uid]
        routing.HEALTH.keep(set(stats))
        with routing.ROUTER_STATS.lock:
            routing.ROUTER_STATS.replicas = {uid: {k: v for k, v in s.items() if k != "prefixes"} for uid, s in stats.items()}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget_replica(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
        routing.HEALTH.answered(replica_id.unique_id)
