"""``paella kserve``: the KServe v2 front end (REST and gRPC) of a running daemon.

It runs in the foreground, as a process of its own beside ``paella serve``, and talks
to the daemon through the client library (so remote requests take the shared-memory
path). SIGTERM or Ctrl-C stops it.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kserve", help="KServe v2 front end (HTTP and gRPC) of a running daemon",
                       description=__doc__.splitlines()[0])
    p.add_argument("--socket", help="the daemon's control socket (default $PAELLA_SOCKET or "
                                    "/run/paella/paella.sock)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=int, default=8000, help="REST port (default 8000; 0 picks one)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0 picks one)")
    p.add_argument("--clients", type=int, default=4,
                   help="connections to the daemon, i.e. requests in flight at once (default 4)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds an inference may take before a 504 (default 30)")
    p.add_argument("--max-body-mb", type=float, default=64.0,
                   help="largest request body or message, MiB (default 64)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_kserve)


def _kserve(args: argparse.Namespace) -> int:
    from paella.cli import CLIError, version
    from paella.client import default_socket
    try:
        from .rest import KServeHTTPServer
        from .rpc import make_server
    except ImportError as e:
        raise CLIError(f"paella kserve needs its extra ({e.name} is missing): pip install "
                       f"'paella-py[kserve]'") from None
    from .service import InferenceService
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s paella-kserve[%(process)d] %(levelname)s %(message)s")
    for name in ("http_port", "grpc_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise CLIError(f"--{name.replace('_', '-')} must be a TCP port 0..65535")
    if args.clients < 1 or not args.timeout > 0 or not args.max_body_mb > 0:
        raise CLIError("--clients, --timeout and --max-body-mb must be positive")
    max_body = int(args.max_body_mb * (1 << 20))
    svc = InferenceService(args.socket or default_socket(), args.clients, args.timeout,
                           version=version())
    try:
        http = KServeHTTPServer((args.host, args.http_port), svc, max_body)
        grpc_server, grpc_port = make_server(svc, f"{args.host}:{args.grpc_port}",
                                             workers=max(8, args.clients), max_body=max_body)
    except OSError as e:
        raise CLIError(f"cannot listen on {args.host}: {e}") from None
    log = logging.getLogger("paella.kserve")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    grpc_server.start()
    thread = threading.Thread(target=http.serve_forever, name="kserve-http", daemon=True)
    thread.start()
    log.info("KServe v2 for the daemon at %s: HTTP on %s:%d, gRPC on %s:%d (%s)", svc.socket,
             args.host, http.server_port, args.host, grpc_port,
             "daemon ready" if svc.ready() else "no daemon answers yet: ready is 503")
    stop.wait()
    log.info("stopping")
    http.shutdown()
    http.server_close()
    grpc_server.stop(grace=2).wait()
    svc.close()
    return 0
