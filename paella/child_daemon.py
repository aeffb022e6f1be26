"""A daemon as a child process: ``paella serve`` on a private socket, started and stopped
by a launcher (the demo, the experiments and benchmarks that time a real daemon, tests).

:func:`start_daemon` returns once the daemon says ``READY=1`` over a notify socket of its
own (sd_notify, as under systemd), so the caller never races its start-up; the socket
stays open, because the daemon reports reloads (``READY=1`` again) and ``STOPPING=1`` on
it too (:func:`notify_socket`). The child ends with its launcher (:mod:`.parent_death`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from paella.parent_death import end_with_parent

#: The daemon's command line without options: the daemon alone, in this interpreter.
DAEMON = (sys.executable, "-c",
          "import sys; from paella.dispatcher.daemon import main; sys.exit(main())")

_notify_sockets: dict[int, socket.socket] = {}


def start_daemon(*extra: str, timeout: float = 60.0,
                 command: tuple[str, ...] = DAEMON) -> tuple[subprocess.Popen, str, str]:
    """A daemon on a fresh socket; returns (process, socket path, temp dir) once READY.
    ``command`` starts it (default: the daemon alone; the overhead experiment passes
    its traced entry point)."""
    d = tempfile.mkdtemp(prefix="plbench")
    sock, notify_path = os.path.join(d, "p.sock"), os.path.join(d, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.2)                  # (to see a daemon that exits meanwhile)
    proc = subprocess.Popen([*command, "--socket", sock, "--log-level", "warning", *extra],
                            env=dict(os.environ, NOTIFY_SOCKET=notify_path),
                            preexec_fn=end_with_parent())
    deadline = time.monotonic() + timeout
    while True:
        try:
            if b"READY=1" in notify.recv(4096):
                break
        except socket.timeout:
            pass
        code = proc.poll()
        if code is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            notify.close()
            shutil.rmtree(d, ignore_errors=True)
            raise RuntimeError(f"the daemon exited with status {code} before it was ready "
                               f"(its error is above)" if code is not None else
                               f"the daemon did not become ready within {timeout:g} s")
    _notify_sockets[proc.pid] = notify      # kept open: the daemon reports STOPPING=1 too
    return proc, sock, d


def notify_socket(proc: subprocess.Popen) -> socket.socket:
    """The notify socket of a daemon :func:`start_daemon` started, to see it report a
    reload (``READY=1`` after SIGHUP) or its stop."""
    return _notify_sockets[proc.pid]


def stop_daemon(proc: subprocess.Popen) -> int:
    """SIGTERM (the daemon drains and removes its segments); its exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        sock = _notify_sockets.pop(proc.pid, None)
        if sock is not None:
            sock.close()
