"""``paella kserve``: the network front end of a running daemon: KServe v2 over REST
and gRPC, and the OpenAI-compatible API.

It runs in the foreground, as a process of its own beside ``paella serve``, and talks
to the daemon through the client library's asyncio connections (so remote requests take
the shared-memory path). Everything runs on one event loop (uvloop): the REST
application under uvicorn (httptools parses HTTP), gRPC on grpc.aio, and the daemon's
connections. No thread is held per connection or per request. SIGTERM or Ctrl-C stops
it: the servers stop taking connections, requests in flight get ``--grace`` seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kserve", help="network front end: KServe v2 (HTTP, gRPC) and OpenAI API",
                       description=__doc__.splitlines()[0])
    p.add_argument("--socket", help="the daemon's control socket (default $PAELLA_SOCKET or "
                                    "/run/paella/paella.sock)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=int, default=8000, help="REST port (default 8000; 0 picks one)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0 picks one)")
    p.add_argument("--clients", type=int, default=2,
                   help="connections to the daemon, each carrying many requests (default 2)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds an inference may take before a 504 (default 30)")
    p.add_argument("--max-body-mb", type=float, default=64.0,
                   help="largest request body or message, MiB (default 64)")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds an idle keep-alive HTTP connection is kept (default 60)")
    p.add_argument("--model-control", action="store_true",
                   help="let clients load and unload models (Triton's repository extension; "
                        "the daemon's [access] control_users must name this process's user)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds requests in flight get at SIGTERM (default 5)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_kserve)


def _kserve(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    try:
        import grpc  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CLIError(f"paella kserve needs its extra ({e.name} is missing): pip install "
                       f"'paella-py[kserve]'") from None
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s paella-kserve[%(process)d] %(levelname)s %(message)s")
    for name in ("http_port", "grpc_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise CLIError(f"--{name.replace('_', '-')} must be a TCP port 0..65535")
    if (args.clients < 1 or not args.timeout > 0 or not args.max_body_mb > 0
            or not args.idle_timeout > 0 or not args.grace >= 0):
        raise CLIError("--clients, --timeout, --max-body-mb and --idle-timeout must be "
                       "positive, --grace at least 0")
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:                        # (uvloop is not on every platform)
        runner = asyncio.run
    return runner(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from paella.cli import CLIError, version
    from paella.client import default_socket

    from .http_protocol import GuardedHttpToolsProtocol
    from .openai_api import OpenAIApp
    from .repository_control import RepositoryControl
    from .rest import KServeApp
    from .rpc import make_server
    from .service import InferenceService
    log = logging.getLogger("paella.kserve")
    max_body = int(args.max_body_mb * (1 << 20))
    svc = InferenceService(args.socket or default_socket(), args.clients, args.timeout,
                           version=version())
    control = RepositoryControl(svc.socket, allowed=args.model_control)
    app = KServeApp(svc, max_body, control, OpenAIApp(svc, max_body))
    config = uvicorn.Config(app, host=args.host, port=args.http_port, loop="none",
                            http=GuardedHttpToolsProtocol, lifespan="off", access_log=False,
                            log_level="warning", backlog=4096, server_header=False,
                            timeout_keep_alive=int(max(1, args.idle_timeout)),
                            timeout_graceful_shutdown=int(args.grace) or None)
    http = uvicorn.Server(config)
    http.install_signal_handlers = lambda: None      # (ours, below, stop both servers)
    try:
        grpc_server, grpc_port = make_server(svc, f"{args.host}:{args.grpc_port}", control,
                                             max_body=max_body)
    except (OSError, RuntimeError) as e:
        raise CLIError(f"cannot listen on {args.host}:{args.grpc_port}: {e}") from None
    await grpc_server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.ensure_future(http.serve())
    while not http.started and not serving.done():
        await asyncio.sleep(0.01)
    if serving.done():                          # it could not bind (uvicorn logged why)
        await grpc_server.stop(0)
        raise CLIError(f"cannot listen on {args.host}:{args.http_port} for HTTP")
    http_port = http.servers[0].sockets[0].getsockname()[1]
    log.info("for the daemon at %s: HTTP on %s:%d, gRPC on %s:%d (%s)", svc.socket,
             args.host, http_port, args.host, grpc_port,
             "daemon ready" if await svc.ready() else "no daemon answers yet: ready is 503")
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping")
    http.should_exit = True
    await asyncio.gather(serving, grpc_server.stop(args.grace), return_exceptions=True)
    svc.close()
    return 0
