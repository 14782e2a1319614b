"""`[cluster]`: engine replicas on Ray Serve (read without importing Ray)."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from completer.config.problem import ConfigProblem


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = False  # `completer serve --cluster`: the engine runs as Ray Serve replicas
    # "" starts a Ray cluster in this process (one machine); "auto" joins the one `completer cluster
    # head|join` started here; "HOST:6379" joins a head elsewhere (with its token: ray_security.py).
    address: str = ""
    app: str = "completer"  # the Serve application's name (front doors of one app share its replicas)
    deploy: bool = True  # false: attach to the app another front door deployed (start no replicas)
    replicas: int = 2  # fixed replica count (when max_replicas is 0)
    min_replicas: int = 1  # autoscaling bounds, used when max_replicas > 0
    max_replicas: int = 0
    target_ongoing_requests: float = 8.0  # autoscaling: requests in flight per replica it aims for
    upscale_delay_s: float = 5.0  # autoscaling: above target this long before a replica is added
    downscale_delay_s: float = 60.0  # below target this long before one is removed (its cache goes with it)
    cpus_per_replica: float = 1.0  # Ray resources each replica holds; its torch threads = max(1, int(cpus))
    gpus_per_replica: float = 0.0
    router: Literal["affinity", "ray_default"] = "affinity"  # ray_default: Serve's power-of-two-choices
    # A session stays on its replica until that replica holds this many more requests
    # in flight than the least loaded one; then it moves (and stays where it moved).
    move_margin: int = 4
    routing_stats_period_s: float = 1.0  # how often replicas report load and warm prefixes to routers
    health_check_period_s: float = 1.0  # a dead replica is noticed (and replaced) within about this
    # The hop's own limit: a request no replica has started answering this long past its
    # deadline ends with an error (routing waits for a replica while none is up).
    answer_grace_s: float = 2.0


def cluster_problems(c: ClusterConfig) -> list[ConfigProblem]:
    found = []
    if c.replicas < 1:
        found.append(ConfigProblem(("cluster.replicas",), f"cluster.replicas = {c.replicas}: must be at least 1"))
    if c.max_replicas and not 1 <= c.min_replicas <= c.max_replicas:
        found.append(ConfigProblem(("cluster.min_replicas", "cluster.max_replicas"),
                                   f"cluster.min_replicas = {c.min_replicas}, cluster.max_replicas = "
                                   f"{c.max_replicas}: autoscaling needs 1 <= min_replicas <= max_replicas"))
    if c.max_replicas < 0:
        found.append(ConfigProblem(("cluster.max_replicas",),
                                   f"cluster.max_replicas = {c.max_replicas}: 0 (fixed count) or more"))
    if c.move_margin < 0:
        found.append(ConfigProblem(("cluster.move_margin",), f"cluster.move_margin = {c.move_margin}: "
                                   "must be at least 0"))
    for key in ("upscale_delay_s", "downscale_delay_s"):
        value = getattr(c, key)
        if not (value >= 0 and math.isfinite(value)):
            found.append(ConfigProblem((f"cluster.{key}",), f"cluster.{key} = {value}: must be 0 or more"))
    for key in ("target_ongoing_requests", "routing_stats_period_s", "health_check_period_s", "answer_grace_s"):
        value = getattr(c, key)
        if not (value > 0 and math.isfinite(value)):
            found.append(ConfigProblem((f"cluster.{key}",), f"cluster.{key} = {value}: must be a positive number"))
    for key in ("cpus_per_replica", "gpus_per_replica"):
        value = getattr(c, key)
        if not (value >= 0 and math.isfinite(value)):
            found.append(ConfigProblem((f"cluster.{key}",), f"cluster.{key} = {value}: must be 0 or more"))
    if not c.app or "#" in c.app:
        found.append(ConfigProblem(("cluster.app",), f"cluster.app = {c.app!r}: a non-empty name without '#'"))
    return found
