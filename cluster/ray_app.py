"""The Ray Serve application of ``paella cluster``: GPU replicas behind the ingress.

:func:`build_app` binds the two deployments from a :class:`~.ray_config.ClusterConfig`:

* ``PaellaGPU``: :class:`~.ray_replica.PaellaReplica`, one replica per GPU (``num_gpus=1``
  or ``{"paella_sim_gpu": 1}``), routed by :class:`~.ray_router.PaellaRequestRouter`,
  health-checked every ``health_check_period_s``;
* ``PaellaIngress``: the KServe v2 REST front end, and gRPC on the config's
  ``[grpc] port`` (:mod:`.ray_ingress`), one replica, on this process's node when
  gRPC is on.

:func:`run` deploys it on the Ray cluster the process is connected to (``ray.init``
first), with Serve's HTTP proxy on the config's host and port.
"""
from __future__ import annotations

from typing import Any

from .ray_config import SIM_GPU_RESOURCE, ClusterConfig, ConfigError
from .ray_ingress import ingress_deployment
from .ray_replica import PaellaReplica
from .ray_router import PaellaRequestRouter

REPLICA_DEPLOYMENT = "PaellaGPU"


def gpus_in_cluster(config: ClusterConfig) -> int:
    """The GPUs (or simulated GPUs) Ray's cluster has: ``gpus.count = "auto"``."""
    import ray
    total = ray.cluster_resources()
    key = "GPU" if config.backend == "cuda" else SIM_GPU_RESOURCE
    return int(total.get(key, 0))


def replica_count(config: ClusterConfig) -> int:
    """The number of GPU replicas: the config's, or every GPU of the cluster; a
    :class:`ConfigError` if the cluster has fewer (the replicas would never start)."""
    have = gpus_in_cluster(config)
    want = config.gpus if config.gpus is not None else have
    what = "GPU" if config.backend == "cuda" else f"{SIM_GPU_RESOURCE} resource"
    if want < 1 or have < want:
        hint = ("ray start --num-gpus N" if config.backend == "cuda"
                else f"ray start --resources '{{\"{SIM_GPU_RESOURCE}\": N}}'")
        raise ConfigError(f"the config asks for {want or 'every'} {what}(s) and the Ray "
                          f"cluster has {have}; give the nodes some ({hint})")
    try:
        config.placed(want)
    except ValueError as e:
        raise ConfigError(f"placement over {want} replicas: {e}") from None
    return want


def build_app(config: ClusterConfig, n_replicas: int, seed: int | None = None) -> Any:
    """The bound application (``serve.run`` takes it)."""
    node = None
    if config.grpc_port is not None:       # (gRPC where paella cluster says it is)
        import ray
        node = ray.util.get_node_ip_address()
    return ingress_deployment(config, node).bind(gpu_replicas(config, n_replicas, seed))


def gpu_replicas(config: ClusterConfig, n_replicas: int, seed: int | None = None) -> Any:
    """The bound GPU deployment: ``n_replicas`` :class:`PaellaReplica` s."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    res = config.resource
    gpu = serve.deployment(
        PaellaReplica, name=REPLICA_DEPLOYMENT, num_replicas=n_replicas,
        ray_actor_options={"num_cpus": 0, "num_gpus": res["num_gpus"],
                           **({"resources": res["resources"]} if "resources" in res else {})},
        max_ongoing_requests=256,
        # a daemon that cannot start (no GPU, a bad bundle) fails the same way again:
        # a few tries, then the deployment is DEPLOY_FAILED with the daemon's error
        max_constructor_retry_count=3,
        health_check_period_s=config.health_check_period_s,
        health_check_timeout_s=max(10.0, config.health_check_period_s),
        request_router_config=RequestRouterConfig(
            request_router_class=PaellaRequestRouter,
            request_router_kwargs={"policy": config.router, "seed": seed},
            request_routing_stats_period_s=config.stats_period_s,
            request_routing_stats_timeout_s=max(2.0, config.stats_period_s)))
    return gpu.bind(config, n_replicas)


def run(config: ClusterConfig, blocking: bool = False, seed: int | None = None) -> Any:
    """Deploy on the connected Ray cluster; returns the ingress handle (``blocking``:
    serve until interrupted)."""
    from ray import serve
    n = replica_count(config)
    serve.start(http_options={"host": config.http_host, "port": config.http_port})
    return serve.run(build_app(config, n, seed), name=config.app_name, route_prefix="/",
                     blocking=blocking)


def failure_of(app_name: str) -> str:
    """Why the application's deployments failed, from Serve's status: each failed
    deployment's message (a replica's constructor error: the daemon's own words)."""
    from ray import serve
    app = serve.status().applications.get(app_name)
    if app is None:
        return "the application is gone"
    parts = [f"{name}: {d.message}" for name, d in app.deployments.items()
             if d.message and d.status not in ("HEALTHY", "UPDATING")]
    return "\n".join(parts) or app.message or str(app.status)
