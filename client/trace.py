"""``paella trace``: a kernel-level trace of a running daemon, for Perfetto.

It sends one TRACE message (allowed before HELLO: it needs no segment) and waits for
the daemon's TRACE_REPLY, which carries the trace as a file descriptor (the daemon
writes the Trace Event JSON into a memfd, off its loop); this copies it to ``-o``.
Open the file in https://ui.perfetto.dev or ``chrome://tracing``. Only the daemon's
owner, root, and the users of its ``[access] trace_users`` may take one: a trace shows
every tenant's timing (docs/service.md, "Traces").
"""
from __future__ import annotations

import argparse
import os
import shutil

from paella import wire
from paella.client.control import ask
from paella.client.errors import DaemonError, DaemonUnavailable


def take_trace(output: str, seconds: float = 2.0, path: str | None = None,
               slack: float = 60.0) -> dict:
    """Record the daemon at ``path`` for ``seconds``, write the trace to ``output``;
    returns the daemon's summary (events, requests, kernels, truncated, bytes). Waits
    ``seconds + slack`` at most for the reply."""
    ms = round(seconds * 1000)
    if not 1 <= ms <= 600_000:
        raise ValueError(f"a trace lasts 0.001 to 600 seconds, got {seconds}")
    msg, fds = ask(wire.encode(wire.TRACE, {"milliseconds": ms}), wire.TRACE_REPLY, path,
                   seconds + slack, fds=1)
    try:
        if not fds:
            raise DaemonUnavailable("the daemon's trace reply came without its file")
        with open(os.dup(fds[0]), "rb", closefd=True) as src, open(output, "wb") as dst:
            src.seek(0)
            shutil.copyfileobj(src, dst, 1 << 20)
    finally:
        for fd in fds:
            os.close(fd)
    return msg["trace"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="a kernel-level trace of the daemon (Perfetto, "
                                     "chrome://tracing)",
                       description="Record what the running daemon does, kernel by kernel, "
                                   "for --seconds and write it in the Trace Event format. "
                                   "Allowed to the daemon's owner and [access] trace_users.")
    p.add_argument("--seconds", type=float, default=2.0, help="how long to record (default 2)")
    p.add_argument("-o", "--output", default="paella-trace.json",
                   help="the trace file to write (default paella-trace.json)")
    p.add_argument("--socket", help="the daemon's socket (default: $PAELLA_SOCKET or "
                                    "the system one)")
    p.set_defaults(func=_trace)


def _trace(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    try:
        info = take_trace(args.output, args.seconds, args.socket)
    except (ValueError, DaemonUnavailable) as e:
        raise CLIError(str(e)) from None
    except DaemonError as e:
        raise CLIError(f"the daemon refused the trace: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot write {args.output}: {e}") from None
    note = " (stopped at its size limit: trace_max_bytes)" if info.get("truncated") else ""
    print(f"wrote {args.output}: {info['requests']} request(s), {info['kernels']} kernel(s), "
          f"{info['bytes']} bytes{note}; open it in https://ui.perfetto.dev")
    return 0
