"""``paella cluster CONFIG``: one daemon per GPU behind Ray Serve (docs/cluster.md).

It connects to a Ray cluster (``ray start --head`` on one node, ``ray start --address``
on the others; or ``--local``: a private one on this machine with the config's
simulated GPUs), deploys the application of :mod:`.ray_app`, prints where it serves,
and serves until interrupted (Ctrl-C or SIGTERM), when it removes the application.
``--check`` reads the config and stops there. Mistakes (the config, no Ray cluster,
too few GPUs, a replica whose daemon cannot start) are ``paella: error: ...``, status 2.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from paella.cli import CLIError

from .ray_config import SIM_GPU_RESOURCE, ClusterConfig, ConfigError, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="serve on many GPUs: a daemon per GPU behind Ray Serve",
                       description="Deploy one paella daemon per GPU on a Ray cluster, with "
                                   "the KServe v2 front end (REST, and gRPC with "
                                   "[grpc] port) and a router by the "
                                   "daemons' queued work (docs/cluster.md).")
    p.add_argument("config", help="the cluster's TOML config (models, [gpus], router, ...)")
    p.add_argument("--address", default="auto",
                   help="the Ray cluster to join (default auto: the one `ray start` runs "
                        "on this node, or $RAY_ADDRESS)")
    p.add_argument("--local", action="store_true",
                   help="start a private Ray on this machine with the config's simulated "
                        "GPUs (gpus.backend sim), instead of joining a cluster")
    p.add_argument("--check", action="store_true", help="check the config and exit")
    p.set_defaults(func=_cluster)


def _cluster(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    if args.check:
        print(f"{args.config}: ok: {len(config.models)} model(s), "
              f"{config.gpus or 'every'} {config.backend} GPU(s), router {config.router}")
        return 0
    _connect(config, args.address, args.local)
    try:
        return _serve(config)
    finally:
        import ray
        ray.shutdown()


def _connect(config: ClusterConfig, address: str, local: bool) -> None:
    import ray
    if local:
        if config.backend != "sim" or config.gpus is None:
            raise CLIError("--local runs simulated GPUs: set gpus.backend = \"sim\" and "
                           "gpus.count in the config")
        ray.init(num_cpus=2, resources={SIM_GPU_RESOURCE: config.gpus},
                 include_dashboard=False, log_to_driver=True)
        return
    try:
        ray.init(address=address, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CLIError(f"no Ray cluster at {address}: {e}. Start one (ray start --head), "
                       f"or pass --local to try simulated GPUs on this machine") from None


def _serve(config: ClusterConfig) -> int:
    from ray import serve

    from . import ray_app
    try:
        ray_app.run(config)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    except RuntimeError as e:          # (Serve's deployment failure: a replica's error)
        why = ray_app.failure_of(config.app_name)
        serve.shutdown()
        raise CLIError(f"the deployment failed: {e}\n{why}") from None
    grpc = (f" and {config.grpc_host}:{config.grpc_port} (KServe v2 gRPC)"
            if config.grpc_port is not None else "")
    print(f"paella cluster: serving {', '.join(config.models)} on "
          f"http://{config.http_host}:{config.http_port}/v2 (KServe v2 REST){grpc}; "
          f"daemons' sockets in {config.run_dir}; Ctrl-C to stop", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):     # (Ray's own SIGINT handler swallows ^C)
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("paella cluster: stopping", file=sys.stderr, flush=True)
    serve.shutdown()
    return 0
