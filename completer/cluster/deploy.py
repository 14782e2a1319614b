"""Bring up (or attach to) the engine replicas: Ray started or joined, the
Serve application deployed with the affinity router, and a handle to it."""

from __future__ import annotations

import msgspec

from completer.cluster import ray_join, ray_security
from completer.config import Config

DEPLOYMENT = "engine"
ROUTER_CLASS = "completer.cluster.router:AffinityRouter"


def deployment_options(config: Config) -> dict:
    c, e = config.cluster, config.engine
    options = dict(
        name=DEPLOYMENT,
        ray_actor_options={"num_cpus": c.cpus_per_replica, "num_gpus": c.gpus_per_replica},
        # Past what the engine holds (running + queued) it refuses with `overloaded` itself.
        max_ongoing_requests=e.max_running + e.max_queue,
        health_check_period_s=c.health_check_period_s,
        health_check_timeout_s=max(10.0, 3 * c.health_check_period_s),
        graceful_shutdown_timeout_s=5.0,
    )
    if c.max_replicas:
        options["autoscaling_config"] = {"min_replicas": c.min_replicas, "max_replicas": c.max_replicas,
                                         "target_ongoing_requests": c.target_ongoing_requests,
                                         "upscale_delay_s": c.upscale_delay_s,
                                         "downscale_delay_s": c.downscale_delay_s,
                                         # averaged over a window as short as the delays it serves
                                         "look_back_period_s": max(2.0, min(30.0, 2 * c.upscale_delay_s))}
    else:
        options["num_replicas"] = c.replicas
    if c.router == "affinity":
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_router_kwargs={"move_margin": c.move_margin},
            request_routing_stats_period_s=c.routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, c.routing_stats_period_s))
    return options


class Cluster:
    """The Ray connection and the deployment's handle; `stop()` undoes what `start()` began."""

    def __init__(self, config: Config):
        self.config = config
        self.started_ray = False
        self.handle = None
        self.address = ""

    def start(self):
        """Blocking (minutes when replicas load models): call it off the event loop."""
        c = self.config.cluster
        # Before Ray is imported: it reads its auth mode and loopback switch then (ray_security.py).
        if c.address:  # refused unless the cluster demands a token and this machine has it
            address = ray_join.secure_join(c.address)
        else:
            temp_dir = ray_security.secure_local_cluster()
        import ray
        from ray import serve

        from completer.cluster.replica import EngineReplica

        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
            if c.address:
                ray.init(address=address, **kwargs)
            else:  # one machine: a cluster of its own (never one `ray start` left here), a small object store,
                # every port on loopback, its files in our private folder
                ray.init(address="local", object_store_memory=256 * 2**20, _node_ip_address="127.0.0.1",
                         _temp_dir=str(temp_dir), **kwargs)
                self.started_ray = True
                ray_security.check_private(temp_dir.parent)
        if c.deploy:
            serve.start(proxy_location="Disabled")
            app = serve.deployment(EngineReplica, **deployment_options(self.config)).bind(
                msgspec.json.encode(self.config))
            serve.run(app, name=c.app, route_prefix=None)
        self.handle = serve.get_deployment_handle(DEPLOYMENT, app_name=c.app)
        self.address = ray.get_runtime_context().gcs_address
        return self.handle

    def describe(self) -> str:
        c = self.config.cluster
        count = f"{c.min_replicas}-{c.max_replicas} (autoscaled)" if c.max_replicas else str(c.replicas)
        return (f"engine: {count} replicas of Serve app {c.app!r}, router {c.router}; "
                f"Ray cluster at {self.address} (front doors join with --set cluster.address=...)")

    def stop(self) -> None:
        import ray
        from ray import serve

        if self.started_ray:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
