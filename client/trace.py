"""A kernel-level trace of a running daemon, for Perfetto (``paella trace``'s client side;
the command is ``paella/trace_command.py``).

:func:`take_trace` sends one TRACE message (allowed before HELLO: it needs no segment)
and waits for the daemon's TRACE_REPLY, which carries the trace as a file descriptor
(the daemon writes the Trace Event JSON into a memfd, off its loop); it copies the
file to ``output``.
Open the file in https://ui.perfetto.dev or ``chrome://tracing``. Only the daemon's
owner, root, and the users of its ``[access] trace_users`` may take one: a trace shows
every tenant's timing (docs/service.md, "Traces").
"""
from __future__ import annotations

import os
import shutil

from paella import wire
from paella.client.control import ask
from paella.client.errors import DaemonUnavailable


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
